"""GPU benchmark: fleetllm's engine on a Llama-3-8B-shaped model against the hardware's limit
and against Hugging Face transformers, on one GPU, with no download.

- The model: Llama-3-8B's config (32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336,
  vocab 128256) with random bfloat16 weights (`load_format="dummy"`; HF's model gets its own
  random weights of the same shapes).
- Copy bandwidth: a large device-to-device copy (bytes read + written per second).
- Single stream: one request (1024-token prompt, 128 outputs); its decode tokens/s against
  the roofline, copy bandwidth / bytes read per decode step (all weights once, plus the
  request's K/V).
- Throughput at 64 and 256 concurrent requests (1024-token prompts, 128 outputs each, all
  submitted at once) against `generate` at its best static batch (prompts of equal length, so
  no padding; greedy; the same dtype, SDPA attention).

Results go to $OUT/gpu_bench.json (OUT defaults to ./gpu_bench_out) and a table on stdout.
Takes about 5 minutes on one H200. `--dry-run` runs every part with tiny shapes on the CPU, so
the script can be checked where there is no GPU (the suite does).

    python benchmarks/gpu_bench.py [--dry-run] [--concurrency 64,256] [--hf-batch-sizes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from fleetllm.engine.config import ModelConfig
from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
TINY = {
    **LLAMA3_8B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes moved per second (read + written) by a large device-to-device copy; the best
    of `reps`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def decode_bytes(cfg: ModelConfig, dtype: torch.dtype, context: int) -> int:
    """Bytes a single-stream decode step must read: every weight but the embedding table (one
    row of it), and the request's K/V."""
    size = torch.empty((), dtype=dtype).element_size()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size
    weights = cfg.num_layers * per_layer + cfg.hidden_size * (cfg.vocab_size + 1)
    return weights * size + context * cfg.kv_bytes_per_token(dtype)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=gen).tolist()


def single_stream(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s of one request alone (its prefill step excluded)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("single", prompt, params)
    engine.step()  # the prefill, and the first token
    sync(engine.device)
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync(engine.device)
    return steps / (time.perf_counter() - t)


def engine_throughput(llm: LLM, batch: list[list[int]], new_tokens: int) -> float:
    """Output tokens/s over a batch of requests submitted at once (prefills included)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    sync(llm.engine.device)
    t = time.perf_counter()
    outs = llm.generate(batch, params)
    sync(llm.engine.device)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == len(batch) * new_tokens
    return produced / elapsed


def hf_model(config: dict[str, Any], dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' Llama with random weights, allocated straight on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(hf_config, dtype=dtype)
    return model.eval()


def hf_throughput(
    model: Any, batch: list[list[int]], new_tokens: int, batch_size: int, device: torch.device
) -> float:
    """Output tokens/s of `generate` over the requests in static batches of `batch_size`."""
    sync(device)
    t = time.perf_counter()
    for i in range(0, len(batch), batch_size):
        ids = torch.tensor(batch[i : i + batch_size], device=device)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    sync(device)
    return len(batch) * new_tokens / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--concurrency", default=None, help="default 64,256 (dry run: 2,4)")
    ap.add_argument("--hf-batch-sizes", default=None, help="default 16,32,64,128,256 (dry: 2,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 1024 (dry run: 32)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 128 (dry run: 4)")
    args = ap.parse_args()

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        log("no CUDA device: run on a GPU, or pass --dry-run to check the script on the CPU")
        return 2
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    config = TINY if dry else LLAMA3_8B
    concurrency = [int(c) for c in (args.concurrency or ("2,4" if dry else "64,256")).split(",")]
    hf_sizes = [
        int(b) for b in (args.hf_batch_sizes or ("2,4" if dry else "16,32,64,128,256")).split(",")
    ]
    prompt_len = args.prompt_len or (32 if dry else 1024)
    new_tokens = args.new_tokens or (4 if dry else 128)
    if dry:
        torch.set_num_threads(1)  # tiny shapes: threads only wait for each other
    out_dir = Path(os.environ.get("OUT") or "gpu_bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(config)
    max_len = prompt_len + new_tokens
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": dry,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": "tiny llama" if dry else "Llama-3-8B shapes, random weights",
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }
    started = time.perf_counter()

    bandwidth = copy_bandwidth(device, (64 << 20) if dry else (4 << 30))
    result["copy_bandwidth_gb_s"] = bandwidth / 1e9
    log(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s")

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        blocks = max(concurrency) * -(-max_len // 16) + 64
        llm = LLM(
            model_dir,
            dtype=str(dtype).removeprefix("torch."),
            load_format="dummy",
            skip_tokenizer_init=True,
            device=device.type,
            num_kv_blocks=blocks,
            max_model_len=max_len,
            max_num_seqs=max(concurrency),
            max_num_batched_tokens=max(8192, prompt_len),
        )
        log(f"engine ready ({time.perf_counter() - started:.0f} s)")
        warm = prompts(2, prompt_len, cfg.vocab_size, seed=0)
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
        single = single_stream(llm, prompts(1, prompt_len, cfg.vocab_size, 1)[0], new_tokens)
        roofline = bandwidth / decode_bytes(cfg, dtype, prompt_len + new_tokens // 2)
        result["single_stream"] = {
            "tok_s": single,
            "roofline_tok_s": roofline,
            "fraction_of_roofline": single / roofline,
        }
        log(f"single stream: {single:.1f} tok/s, {single / roofline:.0%} of the roofline")
        ours: dict[int, float] = {}
        for n in concurrency:
            ours[n] = engine_throughput(llm, prompts(n, prompt_len, cfg.vocab_size, n), new_tokens)
            log(f"fleetllm, {n} concurrent: {ours[n]:.0f} output tok/s")
        del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model = hf_model(config, dtype, device)
    result["concurrency"] = {}
    for n in concurrency:
        batch = prompts(n, prompt_len, cfg.vocab_size, n)
        hf = {b: hf_throughput(model, batch, new_tokens, b, device) for b in hf_sizes if b <= n}
        best = max(hf, key=hf.__getitem__)
        result["concurrency"][str(n)] = {
            "fleetllm_tok_s": ours[n],
            "hf_tok_s_by_batch": {str(b): v for b, v in hf.items()},
            "hf_best_batch": best,
            "hf_best_tok_s": hf[best],
            "ratio": ours[n] / hf[best],
        }
        log(f"HF, {n} requests: best static batch {best}, {hf[best]:.0f} output tok/s")
    del model
    result["wall_s"] = time.perf_counter() - started

    (out_dir / "gpu_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"device: {result['device']}  dtype: {result['dtype']}  model: {result['model']}")
    print(f"copy bandwidth          : {bandwidth / 1e9:10.0f} GB/s")
    s = result["single_stream"]
    print(
        f"single stream decode    : {s['tok_s']:10.1f} tok/s  roofline {s['roofline_tok_s']:.1f}"
        f"  = {s['fraction_of_roofline']:.0%}"
    )
    header = ("concurrent", "fleetllm tok/s", "HF best tok/s", "batch", "ratio")
    print("{:>10} {:>15} {:>14} {:>6} {:>7}".format(*header))
    for n, row in result["concurrency"].items():
        print(
            f"{n:>10} {row['fleetllm_tok_s']:15.1f} {row['hf_best_tok_s']:14.1f} "
            f"{row['hf_best_batch']:6d} {row['ratio']:6.2f}x"
        )
    print(f"results: {out_dir / 'gpu_bench.json'} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
