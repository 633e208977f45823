"""`vllm serve`'s command line read the way vLLM's own parser reads it, from the checked-in table
of its flags (vllm_flags.json, written by scripts/vllm_flags.py from vLLM's parser; the vLLM
tier's tests keep the two equal), without vLLM here.

vLLM's parser is argparse with a preprocessing step (FlexibleArgumentParser): `--max_model_len`
is `--max-model-len`, `-O3` is `--optimization-level 3`, `--compilation-config.mode 3` sets one
key of the JSON flag `--compilation-config`; argparse then takes `--flag=value` forms and any
unambiguous prefix of a long flag (`--max-model` is `--max-model-len`). So the planner sees
which flag each of engine.extraArgs really sets, and refuses what vLLM would refuse (an
unknown flag, a missing value, a bad choice, a value that is not an int) with the message
vLLM's parser gives (argparse's, of the Python the table was read with), instead of a replica
that exits at every start. Values vLLM converts with its own functions are left to vLLM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from fleetllm.planner.errors import ArgsRefused

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
HELP_REFUSAL = "it would print its help and exit instead of serving"


@dataclass(frozen=True)
class VllmOption:
    """One option of `vllm serve`, as its parser declares it."""

    flags: tuple[str, ...]
    dest: str
    kind: str
    """"value" (takes values), "flag" and "boolean" (take none), "help"."""
    nargs: str | None
    type: str | None
    """How values convert: None (strings), "int", "float", "vllm-int", "vllm-float", with "?"
    where "" and "None" are None, or "other" (left to vLLM)."""
    choices: tuple[Any, ...] | None

    @property
    def name(self) -> str:
        """The canonical spelling: the first long flag."""
        return next((flag for flag in self.flags if flag.startswith("--")), self.flags[0])

    @property
    def label(self) -> str:
        """How argparse names the option in its messages."""
        return "/".join(self.flags)


@dataclass(frozen=True)
class VllmFlags:
    version: str
    options: tuple[VllmOption, ...]

    @property
    def by_flag(self) -> dict[str, VllmOption]:
        # In the parser's order: argparse lists ambiguous matches in it.
        return {flag: option for option in self.options for flag in option.flags}


@dataclass(frozen=True)
class GivenOption:
    """One option of a command line: the option it resolves to and how it was written."""

    option: VllmOption
    written: str
    """The flag as written (after vLLM's underscore rule), before any `=value`."""
    values: tuple[str, ...]


@cache
def vllm_flags() -> VllmFlags:
    text = resources.files("fleetllm.planner").joinpath("vllm_flags.json").read_text("utf-8")
    data = json.loads(text)
    options = tuple(
        VllmOption(
            flags=tuple(entry["flags"]),
            dest=entry["dest"],
            kind=entry["kind"],
            nargs=entry["nargs"],
            type=entry["type"],
            choices=None if entry["choices"] is None else tuple(entry["choices"]),
        )
        for entry in data["options"]
    )
    return VllmFlags(version=data["vllm"], options=options)


def _dashes(arg: str) -> str:
    """FlexibleArgumentParser's spelling rule: underscores become dashes in a long flag's name
    (up to its first `.`), never in its value."""
    key, sep, value = arg.partition("=")
    name, dot, rest = key[2:].partition(".")
    return "--" + name.replace("_", "-") + dot + rest + sep + value


def preprocess(args: Sequence[str]) -> list[str]:
    """FlexibleArgumentParser's rewriting before argparse sees the arguments."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--help="):
            out.append("--help")
        elif arg.startswith("--"):
            out.append(_dashes(arg))
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            out.append("--optimization-level")
        else:
            out.append(arg)
    return _gather_dotted(out)


def _gather_dotted(args: list[str]) -> list[str]:
    """`--json-flag.key value` forms, gathered as vLLM does into one `--json-flag JSON` at the
    end (the merged value is vLLM's business; which flag they set is the planner's)."""
    kept: list[str] = []
    dotted: dict[str, None] = {}
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        key = arg.split("=", 1)[0] if "=" in arg else arg
        if arg.startswith("-") and "." in key:
            if "=" not in arg:
                if i + 1 >= len(args):
                    raise ArgsRefused(f"argument {key}: expected one argument")
                skip = True
            dotted[key.split(".", 1)[0]] = None
            continue
        kept.append(arg)
    for key in dotted:
        kept += [key, "{}"]
    return kept


def _option_tuples(
    arg: str, by_flag: dict[str, VllmOption]
) -> list[tuple[VllmOption, str, str | None]]:
    """argparse's prefix matches of `arg` (its _get_option_tuples)."""
    if arg[1] == "-":
        prefix, sep, explicit = arg.partition("=")
        value = explicit if sep else None
        return [(opt, flag, value) for flag, opt in by_flag.items() if flag.startswith(prefix)]
    short, rest = arg[:2], arg[2:]
    found: list[tuple[VllmOption, str, str | None]] = []
    for flag, opt in by_flag.items():
        if flag == short:
            found.append((opt, flag, rest))
        elif flag.startswith(arg):
            found.append((opt, flag, None))
    return found


_Optional = tuple[VllmOption | None, str, str | None]


def _classify(arg: str, by_flag: dict[str, VllmOption]) -> _Optional | None:
    """argparse's _parse_optional: None for a positional, else (option or None when unknown,
    the flag, its explicit value)."""
    if not arg or arg[0] != "-":
        return None
    if arg in by_flag:
        return by_flag[arg], arg, None
    if len(arg) == 1:
        return None
    if "=" in arg:
        flag, value = arg.split("=", 1)
        if flag in by_flag:
            return by_flag[flag], flag, value
    matches = _option_tuples(arg, by_flag)
    if len(matches) > 1:
        spelt = ", ".join(flag for _, flag, _ in matches)
        raise ArgsRefused(f"ambiguous option: {arg} could match {spelt}")
    if matches:
        return matches[0]
    if _NEGATIVE_NUMBER.match(arg) or " " in arg:
        return None
    return None, arg, None


def _converted(option: VllmOption, value: str) -> Any:
    """The value as vLLM's parser converts it, where the table says how (see
    scripts/vllm_flags.py); raises ArgsRefused with the converter's message."""
    kind = option.type
    if kind is None or kind == "other":
        return value
    if kind.endswith("?") and value in ("", "None"):
        return None
    base = kind.removeprefix("vllm-").removesuffix("?")
    if base == "str":
        return value
    try:
        return int(value) if base == "int" else float(value)
    except ValueError:
        if kind.startswith("vllm-"):  # vLLM's parse_type, around int or float
            message = f"Value {value} cannot be converted to <class '{base}'>."
        else:
            message = f"invalid {base} value: {value!r}"
        raise ArgsRefused(f"argument {option.label}: {message}") from None


def _checked(option: VllmOption, value: str) -> None:
    """argparse's conversion, then its choices check."""
    converted = _converted(option, value)
    if option.choices is not None and converted not in option.choices:
        choices = ", ".join(map(repr, option.choices))
        raise ArgsRefused(
            f"argument {option.label}: invalid choice: {converted!r} (choose from {choices})"
        )


def option_spellings(arg: str) -> tuple[str, ...]:
    """Every spelling of the option `arg` names as vLLM's parser reads it (an abbreviation,
    underscores, `=value`): the flag as written and, when it resolves to one option, all of
    that option's flags. A policy that denies a flag must see through each of them."""
    flag = arg.split("=", 1)[0]
    written = _dashes(flag) if flag.startswith("--") else flag
    try:
        found = _classify(written, vllm_flags().by_flag)
    except ArgsRefused:  # ambiguous: the plan refuses it with vLLM's message
        found = None
    option = found[0] if found is not None else None
    return tuple(dict.fromkeys((flag, written, *(option.flags if option else ()))))


def read_vllm_args(args: Sequence[str], flags: VllmFlags | None = None) -> list[GivenOption]:
    """The options of `vllm serve ARGS` (the model first) in order, as vLLM's parser reads
    them; raises ArgsRefused with its message where it would refuse them."""
    by_flag = (flags or vllm_flags()).by_flag
    processed = preprocess(args)
    if "--" in processed:
        cut = processed.index("--")
        positional_tail = [arg for arg in processed[cut + 1 :] if arg != "--"]
        processed = processed[:cut]
    else:
        positional_tail = []
    # Every argument is classified before any is read: an ambiguous prefix is refused first.
    classified = [_classify(arg, by_flag) for arg in processed]
    given: list[GivenOption] = []
    extras: list[str] = []
    model_taken = False
    i = 0
    while i < len(processed):
        found = classified[i]
        if found is None:
            if model_taken:
                extras.append(processed[i])
            model_taken = True
            i += 1
            continue
        option, _, explicit = found
        if option is None:
            extras.append(processed[i])
            i += 1
            continue
        written = processed[i].split("=", 1)[0] if explicit is not None else processed[i]
        values, i = _values(option, explicit, processed, classified, i)
        given.append(GivenOption(option, written, values))
        if option.kind == "help":
            raise ArgsRefused(HELP_REFUSAL)
    extras += positional_tail
    if extras:
        raise ArgsRefused(f"unrecognized arguments: {' '.join(extras)}")
    return given


def _values(
    option: VllmOption,
    explicit: str | None,
    args: list[str],
    classified: list[_Optional | None],
    i: int,
) -> tuple[tuple[str, ...], int]:
    """The values `option` takes at args[i] and the index after them (argparse's
    consume_optional)."""
    takes_none = option.kind != "value"
    if explicit is not None:
        if takes_none:
            raise ArgsRefused(f"argument {option.label}: ignored explicit argument {explicit!r}")
        _checked(option, explicit)
        return (explicit,), i + 1
    following: list[str] = []
    j = i + 1
    if not takes_none:
        # One value, or as many as follow for nargs "+"; a value that looks like a flag ends them.
        while j < len(args) and classified[j] is None and (option.nargs == "+" or not following):
            following.append(args[j])
            j += 1
    if option.nargs is None and not takes_none and not following:
        raise ArgsRefused(f"argument {option.label}: expected one argument")
    if option.nargs == "+" and not following:
        raise ArgsRefused(f"argument {option.label}: expected at least one argument")
    for value in following:
        _checked(option, value)
    return tuple(following), j
