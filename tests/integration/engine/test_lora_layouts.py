"""LoRA over the engine's other layouts, on tiny models, float32 greedy: tensor parallelism
(each rank holding its shard of A or B), int8 base weights (the reference being the merged
model over the engine's own dequantized weights), and the CUDA-graph runner's path (base-only
decode steps replayed, steps with adapter rows run eagerly)."""

from __future__ import annotations

from pathlib import Path

import torch
from loras import write_peft_adapter
from tinymodels import arch_of, build_hf_model, hf_greedy

from fleetllm.engine import sizing
from fleetllm.engine.llm import LLM, LoRARequest
from fleetllm.engine.quantization import QuantizedMatrix
from fleetllm.engine.sampling_params import SamplingParams

NEW_TOKENS = 12
PROMPTS = [[7], list(range(30, 45)), list(range(100, 140))]


def params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_adapters(hf: torch.nn.Module, root: Path) -> list[tuple[LoRARequest, torch.nn.Module]]:
    """Two adapters: every projection at r=8; and rsLoRA at r=4 on q, v and down only."""
    a = write_peft_adapter(hf, root / "a", seed=1, b_std=0.2)
    b = write_peft_adapter(
        hf, root / "b", seed=2, r=4, b_std=0.2, use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
    )  # fmt: skip
    return [
        (LoRARequest("a", 1, str(root / "a")), a),
        (LoRARequest("b", 2, str(root / "b")), b),
    ]


def mixed_run(llm: LLM, requests: list[LoRARequest]) -> list[list[list[int]]]:
    """Every prompt with the base model and each adapter, all in one generate call."""
    choices: list[LoRARequest | None] = [None, *requests]
    prompts = [p for _ in choices for p in PROMPTS]
    loras = [c for c in choices for _ in PROMPTS]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params(), lora_request=loras)]
    return [outs[i * len(PROMPTS) : (i + 1) * len(PROMPTS)] for i in range(len(choices))]


def test_tensor_parallel_ranks_shard_the_adapters_and_match_hf(tmp_path: Path) -> None:
    overrides = {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attention_bias": True,
        "mlp_bias": True,
    }
    hf = build_hf_model("llama", overrides)
    hf.save_pretrained(tmp_path / "base", safe_serialization=True)
    adapters = make_adapters(hf, tmp_path)
    with LLM(
        str(tmp_path / "base"),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        max_model_len=256,
        tensor_parallel_size=2,
        max_num_batched_tokens=32,  # chunked prefill beside decodes
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    ) as llm:
        got = mixed_run(llm, [r for r, _ in adapters])
        shares = llm.engine.lora_bytes
    references = [hf, *(merged for _, merged in adapters)]
    for outputs, ref in zip(got, references, strict=True):
        assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]
    planned = sizing.lora_bytes_per_rank(
        arch_of(tmp_path / "base"), tensor=2, max_loras=2, max_lora_rank=8, dtype_bytes=4
    )
    assert shares == [planned, planned]


def _dequantized_reference(llm: LLM, hf: torch.nn.Module) -> torch.nn.Module:
    """`hf` with every weight the engine quantized replaced by its dequantized value."""
    model = llm.engine.model
    ref = build_hf_model("llama", {})
    ref.load_state_dict(hf.state_dict())

    def weight(module: torch.nn.Module) -> torch.Tensor:
        matrix = QuantizedMatrix(module.qweight, module.scale, module.offset)
        return matrix.dequantize(torch.float32).t()

    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(weight(model.model.embed_tokens))
        ref.lm_head.weight.copy_(weight(model.lm_head))
        for ours, theirs in zip(model.model.layers, ref.model.layers, strict=True):
            attn, mlp = theirs.self_attn, theirs.mlp
            q, k, v = weight(ours.self_attn.qkv_proj.base).split(
                [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
            )
            for target, value in (
                (attn.q_proj, q),
                (attn.k_proj, k),
                (attn.v_proj, v),
                (attn.o_proj, weight(ours.self_attn.o_proj.base)),
                (mlp.down_proj, weight(ours.mlp.down_proj.base)),
            ):
                target.weight.copy_(value)
            gate, up = weight(ours.mlp.gate_up_proj.base).chunk(2)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
    return ref


def test_int8_base_weights_with_adapters_match_the_merged_dequantized_model(
    tmp_path: Path,
) -> None:
    hf = build_hf_model("llama", {})
    hf.save_pretrained(tmp_path / "base", safe_serialization=True)
    llm = LLM(
        str(tmp_path / "base"),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        quantization="int8",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    reference = _dequantized_reference(llm, hf)
    assert not torch.equal(reference.lm_head.weight, hf.lm_head.weight)  # int8 rounds
    adapters = make_adapters(reference, tmp_path)
    got = mixed_run(llm, [r for r, _ in adapters])
    for outputs, ref in zip(got, [reference, *(m for _, m in adapters)], strict=True):
        assert outputs == [hf_greedy(ref, p, NEW_TOKENS) for p in PROMPTS]


def test_graph_runner_replays_decodes_of_the_base_and_of_adapters_alike(
    tiny_model, eager_graphs, tmp_path: Path
) -> None:
    path, hf = tiny_model("llama-gqa-tied")
    (a, merged_a), (b, merged_b) = make_adapters(hf, tmp_path)
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
        enable_lora=True, max_loras=2, max_lora_rank=8, num_threads=1,
    )  # fmt: skip
    replayed = eager_graphs(llm.engine.runner)
    graphs = llm.engine.runner.graphs
    with_lora: list[bool] = []  # which graph of the bucket each decode step ran
    forward = graphs._forward

    def record(size: int, lora: bool) -> torch.Tensor:
        with_lora.append(lora)
        return forward(size, lora)

    graphs._forward = record  # type: ignore[method-assign]
    prompts = PROMPTS[:2]
    mixed = llm.generate(prompts * 3, params(), lora_request=[None] * 2 + [a] * 2 + [b] * 2)
    # Every decode step, base and adapter rows together, through the graphs' static buffers
    # (the slots as masks), padded 6 -> 8.
    assert replayed == [6] * (NEW_TOKENS - 1) and all(with_lora)
    assert graphs.lora_masks[:, 6:].eq(0).all()  # the padding rows
    got = [o.outputs[0].token_ids for o in mixed]
    for i, ref in enumerate((hf, merged_a, merged_b)):
        assert got[2 * i : 2 * i + 2] == [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
    with_lora.clear()
    base = llm.generate(prompts, params())  # the base model alone: the graphs without LoRA
    assert with_lora == [False] * (NEW_TOKENS - 1)
    assert [o.outputs[0].token_ids for o in base] == got[:2]
