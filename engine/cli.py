"""Engine commands: `fleetllm generate` (one generation, streamed to stdout) and
`fleetllm engine serve` (the OpenAI-compatible HTTP server)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetllm.engine.config import EngineConfig

from fleetllm.engine.scheduling_policy import DEFAULT_POLICY, POLICIES
from fleetllm.engine.tool_parsers import PARSERS
from fleetllm.logs import add_log_level_flag

DEFAULT_MODEL = "smollm2-135m"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt with the engine")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model alias, HF directory or .gguf")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    p.set_defaults(func=_generate)

    engine = sub.add_parser("engine", help="run the inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="COMMAND")
    _register_serve(engine_sub)


def _generate(args: argparse.Namespace) -> int:
    from fleetllm.engine.config import EngineConfig
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=1))
    prompt: str | list[int] = args.prompt
    if args.chat:
        assert engine.tokenizer is not None
        # The template writes its own special tokens: tokenized without adding a second BOS.
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    engine.add_request("cli", prompt, params)
    printed = 0
    if not args.chat:
        sys.stdout.write(args.prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


def _register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat "
        "completions, models, tokenize, health, Prometheus metrics).",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="model alias, HF directory or .gguf")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model; the first labels the metrics "
        "(default: the --model value)",
    )
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache size in blocks")
    kv.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.25,
        help="size the KV cache as this fraction of free memory (default 0.25)",
    )
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="a step's token budget (default: 512 on a CPU, 2048 elsewhere)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=POLICIES,
        default=DEFAULT_POLICY,
        help="which waiting request a step admits first: shortest-first (requests that arrived "
        "together go shortest prompt first; none starves) or fcfs (arrival order)",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads at most (default: the cores this process may use: its affinity, "
        "its cgroup's CPU quota)",
    )
    p.add_argument(
        "--adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a CPU, drop threads while other processes take cores and probe for them "
        "again (the kernel's run-queue delay tells); --no-adaptive-threads keeps the count",
    )
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: prompts must be token ids, outputs carry no text",
    )
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights of the model's shapes, for benchmarks (no checkpoint read)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run decode steps eagerly instead of replaying CUDA graphs",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many worker processes (one per GPU on a GPU)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["int8", "fp8"],
        help="weight-only quantization: int8, or fp8 on GPUs that have it (default: none)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8"],
        help="KV cache element type: auto (the model dtype), int8, or fp8 on GPUs with it",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    )
    _register_lora(p)
    p.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (Jinja) in place of the model's: a file, or the template itself",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='read tool calls out of the model\'s text for tool_choice "auto" (and allow '
        '"required" and named functions); needs --tool-call-parser',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>: Hermes, "
        "Qwen, SmolLM2) or llama3_json (Llama 3.x's JSON)",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help='publish KV-cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
        '"topic": "kv-events"}\' (vLLM\'s keys and defaults)',
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("FLEETLLM_API_KEY"),
        help="require 'Authorization: Bearer <key>' on the API (default: $FLEETLLM_API_KEY)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 to a request whose choices would take the number of engine requests "
        "waiting for a slot past this bound (default: no bound)",
    )
    p.add_argument(
        "--max-request-choices",
        type=int,
        default=128,
        help="the most engine requests one HTTP request may fan out into, prompts x n "
        "(default 128)",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=1 << 20,
        help="the most tokens one HTTP request may ask for over all its choices, prompt plus "
        "max_tokens each (default 1048576)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="/health answers 503 while one engine step has run longer than this many seconds "
        "(default 120; 0 turns the watchdog off)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="refuse larger request bodies with 413 (default 8 MiB)",
    )
    p.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default 30)",
    )
    p.add_argument(
        "--log-requests-text",
        action="store_true",
        help="include prompts and completions in the per-request log lines",
    )
    add_log_level_flag(p)
    p.set_defaults(func=_serve)


def _register_lora(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags, and the folders runtime loads may read."""
    p.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters beside the base model"
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help='adapters to serve from the start: name=path, or \'{"name": ..., "path": ..., '
        '"base_model_name": ...}\'',
    )
    p.add_argument("--max-loras", type=int, default=1, help="adapters in one batch (device slots)")
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the largest adapter rank (1, 8, 16, 32, 64, 128, 256, 320 or 512; default 16)",
    )
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters whose weights stay in CPU memory (default: --max-loras)",
    )
    p.add_argument(
        "--allowed-lora-paths",
        nargs="+",
        default=None,
        metavar="DIR",
        help="folders /v1/load_lora_adapter may load adapters from (default: any)",
    )


def _lora_settings(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    """The server's LoRA settings from the flags (`config` validated already)."""
    from fleetllm.engine.serving_lora import parse_lora_module

    if not args.enable_lora:
        if args.lora_modules or args.allowed_lora_paths:
            raise ValueError("--lora-modules and --allowed-lora-paths need --enable-lora")
        return {}
    roots = None
    if args.allowed_lora_paths is not None:
        roots = [str(Path(r).expanduser().resolve()) for r in args.allowed_lora_paths]
    return {
        "lora_modules": [parse_lora_module(m) for m in args.lora_modules or ()],
        "max_cpu_loras": config.max_cpu_loras,
        "allowed_lora_paths": roots,
    }


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from `fleetllm engine serve`'s arguments."""
    from fleetllm.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        device=args.device,
        num_threads=args.num_threads,
        adaptive_threads=args.adaptive_threads,
        enforce_eager=args.enforce_eager,
        load_format=args.load_format,
        skip_tokenizer_init=args.skip_tokenizer_init,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
        kv_events_config=args.kv_events_config,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )


def _serve(args: argparse.Namespace) -> int:
    import torch

    from fleetllm.engine.config import ModelConfig
    from fleetllm.engine.kv_cache import check_kv_cache_dtype
    from fleetllm.engine.model_files import resolve_model
    from fleetllm.engine.parallel import check_tensor_parallel
    from fleetllm.engine.quantization import check_quantization
    from fleetllm.engine.server import ServerSettings, run_server
    from fleetllm.engine.serving_tools import ToolSettings
    from fleetllm.tokenizer import load_chat_template

    for flag, value, low in (
        ("--port", args.port, 0),
        ("--max-request-body-bytes", args.max_request_body_bytes, 1),
        ("--max-waiting-requests", args.max_waiting_requests, 0),
        ("--shutdown-grace-period", args.shutdown_grace_period, 0),
        ("--max-request-choices", args.max_request_choices, 1),
        ("--max-request-tokens", args.max_request_tokens, 1),
        ("--step-timeout", args.step_timeout, 0),
    ):
        if value is not None and not value >= low:  # NaN included
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    config = config_from_args(args)
    # Fail fast, before binding, on what can be checked without loading the weights.
    config.validate()
    lora = _lora_settings(args, config)
    model_root = str(resolve_model(args.model))
    check_tensor_parallel(ModelConfig.from_pretrained(Path(model_root)), args.tensor_parallel_size)
    device = torch.device(config.device)
    check_quantization(config.quantization, device)
    check_kv_cache_dtype(config.kv_cache_dtype, device)
    settings = ServerSettings(
        model_names=args.served_model_name or [args.model],
        model_root=model_root,
        api_key=args.api_key or None,
        max_request_body_bytes=args.max_request_body_bytes,
        log_requests_text=args.log_requests_text,
        shutdown_grace_period=args.shutdown_grace_period,
        max_request_choices=args.max_request_choices,
        max_request_tokens=args.max_request_tokens,
        step_timeout=args.step_timeout,
        chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
        tools=ToolSettings(args.enable_auto_tool_choice, args.tool_call_parser),
        **lora,
    )
    return run_server(
        config,
        settings,
        host=args.host,
        port=args.port,
        max_waiting_requests=args.max_waiting_requests,
        log_level=args.log_level,
    )
