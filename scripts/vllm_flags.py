"""Write the table of `vllm serve`'s flags that the planner checks engine.extraArgs against
(fleetllm/planner/vllm_flags.json), read from vLLM's own argument parser.

Run it with vLLM's Python, not fleetllm's (vLLM lives in an environment of its own):

    .venv-vllm/bin/python scripts/vllm_flags.py > fleetllm/planner/vllm_flags.json

The vLLM tier's tests run it again and compare, so the table cannot drift from the vLLM the
suite tests. Only what a pure check can use is kept: each option's spellings, destination,
how many values it takes, the values it allows, and its type where it is a plain int or float
(vLLM's other converters are its own functions, left to vLLM at start).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any


def kind(action: argparse.Action) -> str:
    if isinstance(action, argparse._HelpAction):
        return "help"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "boolean"
    if action.nargs == 0:
        return "flag"
    return "value"


PLAIN = {int: "int", float: "float"}


def value_type(action: argparse.Action) -> str | None:
    """How the option's values are converted: None (kept as strings), "int" or "float"
    (argparse's), "vllm-int" or "vllm-float" (vLLM's parse_type around them: its own message),
    the same with "?" (optional_type: "" and "None" are None), or "other" (another converter of
    vLLM's, left to vLLM)."""
    convert = action.type
    if type(action).__module__ != "argparse":
        return "other"  # an action of vLLM's own reads the values (--lora-modules)
    if convert is None or convert is str:
        return None
    if convert in PLAIN:
        return PLAIN[convert]  # type: ignore[index]
    qualname = getattr(convert, "__qualname__", "")
    cells = [cell.cell_contents for cell in getattr(convert, "__closure__", None) or ()]
    if qualname == "parse_type.<locals>._parse_type" and cells and cells[0] in PLAIN:
        return f"vllm-{PLAIN[cells[0]]}"
    if qualname == "optional_type.<locals>._optional_type" and cells:
        inner = cells[0]
        if inner is str:
            return "vllm-str?"
        if inner in PLAIN:
            return f"vllm-{PLAIN[inner]}?"
    return "other"


def option(action: argparse.Action) -> dict[str, Any]:
    choices = None
    if action.choices is not None:
        choices = [
            c if c is None or isinstance(c, (int, float)) else str(c) for c in action.choices
        ]
    nargs = action.nargs
    return {
        "flags": list(action.option_strings),
        "dest": action.dest,
        "kind": kind(action),
        "nargs": nargs if nargs in ("?", "*", "+") else None,
        "type": value_type(action),
        "choices": choices,
    }


def table() -> dict[str, Any]:
    from vllm import __version__
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    return {
        "vllm": __version__,
        # argparse's messages, which the planner's refusals repeat, are this Python's.
        "python": ".".join(platform.python_version_tuple()[:2]),
        "allow_abbrev": parser.allow_abbrev,
        "options": [option(action) for action in parser._actions if action.option_strings],
    }


def dump(data: dict[str, Any]) -> str:
    """The table as JSON with one option a line (a new vLLM's changes read as a short diff)."""
    head = {key: value for key, value in data.items() if key != "options"}
    lines = [json.dumps(head)[:-1] + ', "options": [']
    lines += [json.dumps(entry) + "," for entry in data["options"]]
    lines[-1] = lines[-1].removesuffix(",")
    return "\n".join([*lines, "]}"]) + "\n"


def main() -> int:
    sys.stdout.write(dump(table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
