"""LoRA adapters through the engine, float32 greedy: SmolLM2-135M with seeded random PEFT
adapters (r=8 on q, k, v, o, gate, up and down) gives the tokens of the Hugging Face model with
the adapter merged; a batch mixing the base model and two adapters gives the tokens of the
three runs apart; the prefix cache never serves one adapter's KV to another (nor to the
base); a request waits for a slot while the others run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loras import write_peft_adapter
from tinymodels import hf_greedy

from fleetllm.api.catalog import MODELS
from fleetllm.engine import sizing
from fleetllm.engine.llm import LLM, LoRARequest
from fleetllm.engine.sampling_params import SamplingParams

NEW_TOKENS = 12
TEXTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def adapters(
    smollm2_hf: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[LoRARequest, torch.nn.Module]]:
    """Two adapters of SmolLM2 (the second with rsLoRA) and their merged references."""
    made = {}
    for i, (name, extra) in enumerate((("a", {}), ("b", {"use_rslora": True}))):
        path = tmp_path_factory.mktemp(f"adapter-{name}")
        merged = write_peft_adapter(smollm2_hf, path, seed=i + 1, **extra)
        made[name] = (LoRARequest(name, i + 1, str(path)), merged)
    return made


@pytest.fixture(scope="module")
def lora_llm(smollm2_dir: Path) -> LLM:
    return LLM(
        str(smollm2_dir),
        dtype="float32",
        num_kv_blocks=256,
        max_model_len=1024,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        num_threads=1,  # beside other work, one thread beats waiting for a second
    )


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_matches_the_merged_hf_model(
    lora_llm: LLM, smollm2_hf: torch.nn.Module, adapters: dict
) -> None:
    tok = lora_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    base = tokens(lora_llm.generate(prompts, greedy()))
    assert base == [hf_greedy(smollm2_hf, p, NEW_TOKENS) for p in prompts]
    for request, merged in adapters.values():
        got = tokens(lora_llm.generate(prompts, greedy(), lora_request=request))
        assert got == [hf_greedy(merged, p, NEW_TOKENS) for p in prompts], request.lora_name
        assert got != base  # the adapter changes what the model says


def test_a_batch_of_base_and_two_adapters_equals_the_runs_apart(
    lora_llm: LLM, adapters: dict
) -> None:
    tok = lora_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    choices = [None, adapters["a"][0], adapters["b"][0]]
    apart = [tokens(lora_llm.generate(prompts, greedy(), lora_request=c)) for c in choices]
    assert apart[0] != apart[1] != apart[2] != apart[0]
    # All six in the engine at once: the first step runs every prompt, of all three models.
    engine = lora_llm.engine
    for i, choice in enumerate(choices):
        adapter = choice and engine.load_lora(choice.lora_name, choice.lora_path)
        for j, prompt in enumerate(prompts):
            engine.add_request(f"mixed-{i}-{j}", prompt, greedy(), lora=adapter)
    engine.step()
    stats = engine.stats()
    assert stats.num_running == 6 and stats.num_waiting == 0
    assert stats.lora_running == ["a", "b"]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    mixed = [[done[f"mixed-{i}-{j}"] for j in range(len(prompts))] for i in range(3)]
    assert mixed == apart
    assert engine.stats().lora_running == []


def test_the_prefix_cache_keeps_adapters_and_the_base_apart(lora_llm: LLM, adapters: dict) -> None:
    tok = lora_llm.get_tokenizer()
    prompt = tok.encode("A long shared system prompt, " * 8)  # several full blocks
    a, b = adapters["a"][0], adapters["b"][0]
    lora_llm.engine.kv.reset_prefix_cache()

    def run(request: LoRARequest | None, **kw: object) -> tuple[list[int], int]:
        params = SamplingParams(temperature=0.0, max_tokens=4, **kw)  # type: ignore[arg-type]
        (out,) = lora_llm.generate([prompt], params, lora_request=request)
        return out.outputs[0].token_ids, out.num_cached_tokens

    # An adapter's prefill that scores the prompt first: its blocks are cached under its own
    # root, so the base model then computes its own KV and its own tokens.
    with_a, cached = run(a, prompt_logprobs=1)
    assert cached == 0
    base, cached = run(None)
    assert cached == 0
    with_b, cached = run(b)
    assert cached == 0
    for request, want in ((a, with_a), (None, base), (b, with_b)):
        again, cached = run(request)
        assert again == want and cached > 0  # each hits its own blocks


def test_a_request_waits_for_a_slot_while_base_requests_run(tiny_model, tmp_path: Path) -> None:
    path, hf = tiny_model("llama-mha")
    made = [LoRARequest(n, i, str(tmp_path / n)) for i, n in enumerate(("x", "y"), start=1)]
    for i, request in enumerate(made):
        write_peft_adapter(hf, Path(request.lora_path), seed=10 + i, b_std=0.2)
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip
    prompt = list(range(3, 20))
    apart = [tokens(llm.generate([prompt], greedy(), lora_request=r))[0] for r in [None, *made]]
    engine = llm.engine
    x, y = (engine.load_lora(r.lora_name, r.lora_path) for r in made)
    engine.add_request("x", prompt, greedy(), lora=x)
    engine.add_request("y", prompt, greedy(), lora=y)
    engine.add_request("base", prompt, greedy())
    engine.step()
    stats = engine.stats()
    assert (stats.lora_running, stats.lora_waiting) == (["x"], ["y"])
    assert stats.num_running == 2  # the base request went ahead of y
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert [done["base"], done["x"], done["y"]] == apart


def test_the_slots_take_what_the_planners_formula_says(lora_llm: LLM) -> None:
    planned = sizing.lora_bytes_per_rank(
        MODELS["SmolLM2-135M"], tensor=1, max_loras=2, max_lora_rank=8, dtype_bytes=4
    )
    assert lora_llm.engine.lora_bytes == [planned]
