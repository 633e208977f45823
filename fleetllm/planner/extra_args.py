"""engine.extraArgs against the flags the planner owns and against the engine's own parser:
for the builtin engine, `fleetllm engine serve`'s argument parser, made to raise instead of
printing and exiting; for vLLM, its parser as the checked-in table of its flags describes it
(vllm_args).

So a flag the engine does not have, a value it cannot read, or a planned flag given again
under another spelling (argparse accepts any unambiguous prefix: `--max-model=...` sets
--max-model-len) is a refusal that names the problem, not a replica that exits at every start.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import IO, Any, NoReturn

from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.engine import cli as engine_cli
from fleetllm.planner.errors import ArgsRefused, PlanError
from fleetllm.planner.vllm_args import read_vllm_args, vllm_flags

# Flags the planner decides, and the spec field to use instead.
OWNED_FLAGS = {
    "--model": "model.source",
    "--revision": "model.source (hf://org/name@revision)",
    "--load-format": "model.source",
    "--host": "(fixed)",
    "--port": "(fixed)",
    "--served-model-name": "model.name",
    "--dtype": "engine.dtype",
    "--device": "gpu.type",
    "--shutdown-timeout": "engine.drainSeconds",
    "--shutdown-grace-period": "engine.drainSeconds",
    "--max-model-len": "maxModelLen",
    "--block-size": "(planned)",
    "--num-kv-blocks": "(planned)",
    "--kv-cache-memory-fraction": "(planned)",
    "--gpu-memory-utilization": "(planned)",
    "--max-num-seqs": "engine.maxNumSeqs",
    "--max-num-batched-tokens": "(planned)",
    "--max-waiting-requests": "(planned)",
    # The engine's key comes from the LLMDeployment's own Secret (the router sends it).
    "--api-key": "(the operator's engine-key Secret)",
    "--tensor-parallel-size": "parallelism.tensor",
    "-tp": "parallelism.tensor",
    "--pipeline-parallel-size": "parallelism.pipeline",
    "-pp": "parallelism.pipeline",
    "--quantization": "quantization.weights",
    "-q": "quantization.weights",
    "--kv-cache-dtype": "quantization.kvCache",
    "--speculative-config": "speculative",
    "--enable-lora": "lora",
    "--max-loras": "lora.maxLoras",
    "--max-lora-rank": "lora.maxLoraRank",
    "--max-cpu-loras": "lora.maxCpuLoras",
    # Adapters given at start would be fixed for the replica's life: spec.adapters loads
    # them at run time instead.
    "--lora-modules": "adapters",
    # vLLM reads a YAML file of flags: the planned ones could be set there unseen.
    "--config": "(planned)",
}


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


def check_extra_args(spec: LLMDeploymentSpec, planned: Sequence[str]) -> None:
    extra = spec.engine.extra_args
    if spec.engine.backend == "vllm":
        _check_vllm(planned, extra)
        return
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise PlanError(
                "InvalidEngineArgs",
                f"engine.extraArgs sets {flag}, which the planner owns; {_instead(flag)}",
            )
    if not extra:
        return
    try:
        changed = flags_changed(planned, extra)
    except ArgsRefused as exc:
        raise PlanError(
            "InvalidEngineArgs",
            f"engine.extraArgs: `fleetllm engine serve` refuses {' '.join(extra)!r}: {exc}",
        ) from None
    owned = [flag for flag in changed if flag in OWNED_FLAGS]
    if owned:
        raise PlanError(
            "InvalidEngineArgs",
            f"engine.extraArgs sets {owned[0]} (under another spelling), which the planner "
            f"owns; {_instead(owned[0])}",
        )


def _check_vllm(planned: Sequence[str], extra: Sequence[str]) -> None:
    """engine.extraArgs after the planned `vllm serve` arguments, read as vLLM reads them: a
    refusal of its parser, or a planned flag however spelt (`--max_model_len`, `--max-model`,
    `--max-model-len=...`), is refused."""
    if not extra:
        return
    try:
        given = read_vllm_args([*planned, *extra])[len(read_vllm_args(planned)) :]
    except ArgsRefused as exc:
        raise PlanError(
            "InvalidEngineArgs",
            f"engine.extraArgs: vLLM {vllm_flags().version}'s parser refuses "
            f"{' '.join(extra)!r}: {exc}",
        ) from None
    by_flag = vllm_flags().by_flag
    owned: dict[str, str] = {}
    for flag in OWNED_FLAGS:  # long flags come first: they name the option
        if flag in by_flag:
            owned.setdefault(by_flag[flag].dest, flag)
    for option in given:
        flag = owned.get(option.option.dest)
        if flag is not None:
            spelt = "" if option.written == flag else f" (as {option.written})"
            raise PlanError(
                "InvalidEngineArgs",
                f"engine.extraArgs sets {flag}{spelt}, which the planner owns; {_instead(flag)}",
            )


def _instead(flag: str) -> str:
    field = OWNED_FLAGS[flag]
    return "it is not configurable" if field.startswith("(") else f"use {field}"
