"""`fleetllm generate`: a one-shot generation with the engine, streamed to stdout."""

from __future__ import annotations

import argparse
import sys

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


def _generate(args: argparse.Namespace) -> int:
    from fleetllm.engine.config import EngineConfig
    from fleetllm.engine.engine import LLMEngine
    from fleetllm.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=1))
    prompt = args.prompt
    if args.chat:
        assert engine.tokenizer is not None
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
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
