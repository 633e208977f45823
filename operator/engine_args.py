"""The builtin engine's command line as `fleetllm engine serve` itself parses it. Pure: the
engine's own argument parser, made to raise instead of printing and exiting.

The planner checks engine.extraArgs with it, so that a flag the engine does not have, a value
it cannot read, or a planned flag given again under another spelling (argparse accepts any
unambiguous prefix: `--max-model=...` sets --max-model-len) is a refusal that names the
problem, not a replica that exits at every start.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import IO, Any, NoReturn

from fleetllm.engine import cli as engine_cli


class ArgsRefused(ValueError):
    """`fleetllm engine serve` would refuse the arguments; the message is argparse's."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ArgsRefused(message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        # Reached by --help: the engine would print its help and exit instead of serving.
        raise ArgsRefused(message or "it would print its help and exit instead of serving")

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        pass


def parse_serve_args(args: Sequence[str]) -> dict[str, Any]:
    """What `fleetllm engine serve ARGS` reads, by destination; raises ArgsRefused."""
    root = _Parser(prog="fleetllm", add_help=False)
    engine_cli.register(root.add_subparsers(dest="command"))
    return vars(root.parse_args(["engine", "serve", *args]))


def flags_changed(planned: Sequence[str], extra: Sequence[str]) -> list[str]:
    """The long flags whose value `extra`, appended to `planned`, changes, however spelt
    (the engine's flags are `--` + their destination with dashes); raises ArgsRefused when
    the engine would refuse the whole command line."""
    after = parse_serve_args([*planned, *extra])
    before = parse_serve_args(planned)
    return ["--" + dest.replace("_", "-") for dest in before if before[dest] != after.get(dest)]
