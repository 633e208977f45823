"""The `fleetllm` command. Each area registers its own subcommands."""

from __future__ import annotations

import argparse
import sys

from fleetllm.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from fleetllm.engine import cli as engine_cli
    from fleetllm.local import cli as local_cli
    from fleetllm.operator import cli as operator_cli
    from fleetllm.router import cli as router_cli
    from fleetllm.weights import cli as weights_cli

    parser = argparse.ArgumentParser(prog="fleetllm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fleetllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    engine_cli.register(sub)
    weights_cli.register(sub)
    operator_cli.register(sub)
    router_cli.register(sub)
    local_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"fleetllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
