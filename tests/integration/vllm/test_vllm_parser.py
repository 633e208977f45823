"""vLLM's own parser reads every `vllm serve` command the planner makes: each vLLM example in
manifests/examples and, as a property, any plan of a vLLM deployment (LoRA slots included),
with the planned values;
the checked-in table of vLLM's flags the planner reads engine.extraArgs with is the installed
vLLM's, the default image is that version, and the planner's reading of extraArgs agrees with
vLLM's parser on what it accepts, what each flag sets and the message of a refusal."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_parser import VllmParser

from fleetllm.api.catalog import GPU_TYPES, MODELS, ModelArch
from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.manifests import load_llmdeployments
from fleetllm.images import VLLM_IMAGE, VLLM_VERSION
from fleetllm.planner.errors import ArgsRefused, PlanError
from fleetllm.planner.lora_fit import RANKS
from fleetllm.planner.plan import Plan, plan
from fleetllm.planner.vllm_args import read_vllm_args, vllm_flags
from fleetllm.planner.vllm_cpu import kv_cache_bytes

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
TABLE = ROOT / "fleetllm" / "planner" / "vllm_flags.json"
SLOW = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
)


def assert_reads_the_plan(read: dict[str, Any], planned: Plan) -> None:
    """What vLLM reads from the planned argv is what the plan says."""
    s = planned.status
    assert read["model_tag"] == planned.model_path
    assert read["max_num_seqs"] == s.max_num_seqs
    assert read["max_num_batched_tokens"] == s.max_num_batched_tokens
    assert read["max_model_len"] == s.max_model_len
    assert read["block_size"] == s.block_size
    assert read["dtype"] == s.dtype
    if planned.gpu.is_gpu:
        assert read["gpu_memory_utilization"] == pytest.approx(s.gpu_memory_utilization, abs=0.005)
    else:
        # No device memory to take a share of: the KV cache is given in bytes instead.
        assert read["kv_cache_memory_bytes"] == kv_cache_bytes(planned.estimate)
    assert read["shutdown_timeout"] == planned.drain_seconds
    assert read["kv_cache_dtype"] == ("auto" if s.kv_cache_dtype == s.dtype else s.kv_cache_dtype)
    assert read["enable_prefix_caching"] is True


def test_the_flag_table_is_the_installed_vllms(requires_vllm: Path) -> None:
    written = subprocess.run(
        [str(requires_vllm), str(ROOT / "scripts" / "vllm_flags.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert written == TABLE.read_text(encoding="utf-8"), (
        "fleetllm/planner/vllm_flags.json is not the installed vLLM's: run "
        "`.venv-vllm/bin/python scripts/vllm_flags.py > fleetllm/planner/vllm_flags.json`"
    )


def test_the_default_image_is_the_tested_vllm(vllm_parser: VllmParser) -> None:
    assert vllm_parser.version == VLLM_VERSION == vllm_flags().version
    assert VLLM_IMAGE.endswith(f":v{vllm_parser.version}")


def test_every_vllm_example_parses_with_the_planned_values(vllm_parser: VllmParser) -> None:
    examples = [
        cr
        for path in EXAMPLES
        for cr in load_llmdeployments(path)
        if cr.spec.engine.backend == "vllm"
    ]
    assert len(examples) >= 4
    for cr in examples:
        planned = plan(cr.spec)
        assert planned.command == ("vllm", "serve")
        answer = vllm_parser.parse(list(planned.args))
        assert "error" not in answer, (cr.metadata.name, answer)
        read = answer["args"]
        assert_reads_the_plan(read, planned)
        assert read["served_model_name"] == [cr.spec.model.name]
        assert read["tensor_parallel_size"] == cr.spec.parallelism.tensor
        assert read["pipeline_parallel_size"] == cr.spec.parallelism.pipeline


@SLOW
@given(
    model=st.sampled_from(list(MODELS.values())),
    gpu=st.sampled_from([g for g in GPU_TYPES.values() if g.is_gpu]),
    tensor=st.sampled_from([1, 2, 4, 8]),
    pipeline=st.sampled_from([1, 2]),
    weights=st.sampled_from(["none", "int8", "fp8", "awq", "gptq"]),
    kv_cache=st.sampled_from(["auto", "fp8"]),
    context=st.integers(256, 1 << 17),
    max_num_seqs=st.none() | st.integers(1, 512),
    drain=st.integers(1, 600),
    speculative=st.booleans(),
    lora=st.none()
    | st.fixed_dictionaries(
        {"maxLoras": st.integers(1, 16), "maxLoraRank": st.sampled_from(RANKS)},
        optional={"maxCpuLoras": st.integers(16, 64)},
    ),
)
def test_any_vllm_plan_parses_with_the_planned_values(
    vllm_parser: VllmParser,
    model: ModelArch,
    gpu: Any,
    tensor: int,
    pipeline: int,
    weights: str,
    kv_cache: str,
    context: int,
    max_num_seqs: int | None,
    drain: int,
    speculative: bool,
    lora: dict[str, int] | None,
) -> None:
    engine: dict[str, Any] = {"backend": "vllm", "drainSeconds": drain}
    if max_num_seqs is not None:
        engine["maxNumSeqs"] = max_num_seqs
    body: dict[str, Any] = {
        "model": {"name": "m", "source": "s3://b/m", "architecture": model.name},
        "gpu": {"type": gpu.name},
        "engine": engine,
        "maxModelLen": min(context, model.max_position),
        "parallelism": {"tensor": tensor, "pipeline": pipeline},
        "quantization": {"weights": weights, "kvCache": kv_cache},
    }
    if speculative:
        body["speculative"] = {"numSpeculativeTokens": 3}
    if lora is not None:
        body["lora"] = lora
    try:
        planned = plan(LLMDeploymentSpec.model_validate(body))
    except PlanError:
        return  # a refusal names its reason (the planner's tests); nothing reaches vLLM
    answer = vllm_parser.parse(list(planned.args))
    assert "error" not in answer, answer
    read = answer["args"]
    assert_reads_the_plan(read, planned)
    assert (read["tensor_parallel_size"], read["pipeline_parallel_size"]) == (tensor, pipeline)
    flag = {"none": None, "int8": "compressed-tensors", "fp8": "fp8", "awq": "awq", "gptq": "gptq"}
    expected = flag[weights]
    if expected in ("awq", "gptq") and (gpu.compute_capability or (9, 0)) >= (8, 0):
        expected += "_marlin"
    assert read["quantization"] == expected
    if speculative:
        assert json.loads(json.dumps(read["speculative_config"]))["num_speculative_tokens"] == 3
    assert bool(read["enable_lora"]) is (lora is not None)
    if lora is not None:
        assert (read["max_loras"], read["max_lora_rank"]) == (lora["maxLoras"], lora["maxLoraRank"])
        assert read["max_cpu_loras"] == lora.get("maxCpuLoras", lora["maxLoras"])


# -- engine.extraArgs: the planner reads them as vLLM does ------------------------------------

PLANNED = ["/models/m", "--max-model-len", "4096", "--served-model-name", "m"]


def _spellings(flag: str) -> st.SearchStrategy[str]:
    """`flag` as vLLM also takes it: underscores, or a prefix (ambiguous ones included)."""
    if not flag.startswith("--"):
        return st.just(flag)
    return st.sampled_from(
        [flag, flag.replace("-", "_").replace("__", "--", 1), flag[: max(3, len(flag) - 3)]]
    )


def _option_args() -> st.SearchStrategy[list[str]]:
    options = vllm_flags().options
    values = st.sampled_from(["8", "x", "-1", "half", "fp8", "1.5", "", "auto", "a b"])

    @st.composite
    def one(draw: st.DrawFn) -> list[str]:
        # --config reads a file (the planner refuses it outright); --help prints and exits.
        option = draw(st.sampled_from([o for o in options if o.dest not in ("help", "config")]))
        spelt = draw(_spellings(draw(st.sampled_from(option.flags))))
        choice = st.sampled_from([str(c) for c in option.choices or ()] or ["8"])
        value = draw(values | choice)
        form = draw(st.sampled_from(["apart", "equals", "bare"]))
        if form == "bare":
            return [spelt]
        return [f"{spelt}={value}"] if form == "equals" else [spelt, value]

    unknown = st.sampled_from([["--no-such-flag"], ["stray"], ["-O3"], ["-tp4"], ["-cc.mode", "3"]])
    return st.lists(one() | unknown, min_size=1, max_size=4).map(
        lambda parts: [arg for part in parts for arg in part]
    )


@settings(max_examples=400, deadline=None)
@given(extra=_option_args())
def test_the_planner_reads_extra_args_as_vllms_parser_does(
    vllm_parser: VllmParser, extra: list[str]
) -> None:
    argv = [*PLANNED, *extra]
    answer = vllm_parser.parse(argv)
    # vLLM's own converters (JSON, human-readable sizes) are left to vLLM at start: a value only
    # they refuse may be refused by vLLM alone, or first.
    unchecked = [f for o in vllm_flags().options if o.type == "other" for f in o.flags]
    left_to_vllm = any(
        re.search(rf"{re.escape(flag)}(?![\w-])", answer.get("error", "")) for flag in unchecked
    )
    try:
        given_options = read_vllm_args(argv)
    except ArgsRefused as exc:
        assert "error" in answer, (argv, str(exc))
        assert str(exc) == answer["error"] or left_to_vllm, argv
        return
    if left_to_vllm:
        return
    assert "error" not in answer, (argv, answer)
    read = answer["args"]
    # Each option the planner saw sets the destination vLLM set, to the value vLLM read there.
    last = {g.option.dest: g for g in given_options}
    for dest, seen in last.items():
        if seen.option.type in ("int", "vllm-int") and seen.values and seen.option.nargs is None:
            assert read[dest] == int(seen.values[-1]), (argv, dest)
        elif seen.option.choices is not None and seen.option.type is None and seen.values:
            assert str(read[dest]) == seen.values[-1], (argv, dest)
