"""`fleetllm model pull`: the weights' commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fleetllm.logs import configure_logging
from fleetllm.weights.fetch import PullError, Settings, log
from fleetllm.weights.pull import pull


def register(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="model weights")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    p = model_sub.add_parser(
        "pull",
        help="fetch a model's files into a folder (resumable, checksum-verified)",
        description="Fetch the config, tokenizer and safetensors files of SOURCE into DIR, "
        "resuming cut transfers and verifying sizes and checksums; a no-op when DIR already "
        "holds a complete pull of SOURCE. hf://ORG/NAME[@REVISION] (HF_ENDPOINT, HF_TOKEN), "
        "s3://BUCKET/PREFIX (AWS_* credentials, AWS_ENDPOINT_URL), builtin://NAME (converted "
        "from its GGUF file into a Hugging Face folder, where the model's package is installed) "
        "and pvc:// (nothing to fetch). Progress is logged as JSON lines on stderr.",
    )
    p.add_argument("source", help="hf://, s3://, pvc:// or builtin:// source")
    p.add_argument("dir", help="the model folder to fill")
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per connect or read (default 60)"
    )
    p.add_argument(
        "--attempts", type=int, default=8, help="tries per request, resuming (default 8)"
    )
    p.add_argument(
        "--read-only",
        action="store_true",
        help="DIR is a cache filled beforehand: succeed if it holds SOURCE, else fail",
    )
    p.set_defaults(func=_pull)


def _pull(args: argparse.Namespace) -> int:
    if args.timeout <= 0 or args.attempts < 1:
        raise ValueError("--timeout must be positive and --attempts at least 1")
    configure_logging("info")
    try:
        settings = Settings(timeout=args.timeout, attempts=args.attempts, read_only=args.read_only)
        pull(args.source, Path(args.dir), settings)
    except PullError as exc:
        log.error("pull failed", extra={"error": str(exc)})
        print(f"fleetllm: model pull: {exc}", file=sys.stderr)
        return 1
    return 0
