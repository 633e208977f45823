"""The builtin engine's arguments, as `fleetllm engine serve` parses them: every planned flag is
one the engine has, with the planned value, and engine.extraArgs the engine would refuse (an
unknown flag, a bad value, a planned flag under another spelling) are refused by the planner
with the reason, instead of a replica that exits at every start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.api.manifests import load_llmdeployments
from fleetllm.planner.errors import PlanError
from fleetllm.planner.extra_args import OWNED_FLAGS, ArgsRefused, flags_changed, parse_serve_args
from fleetllm.planner.plan import plan

CPU = {"model": {"name": "smol", "source": "builtin://smollm2-135m"}, "gpu": {"type": "cpu"}}
GPU = {
    "model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
    "gpu": {"type": "H100-80GB"},
    "maxModelLen": 16384,
}


def spec(base: dict[str, Any], **engine: Any) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate({**base, "engine": engine})


@pytest.mark.parametrize("base", [CPU, GPU], ids=["cpu", "gpu"])
def test_every_planned_flag_reaches_the_engine_with_its_planned_value(base: dict[str, Any]) -> None:
    planned = plan(spec(base, drainSeconds=45, dtype="float32"))
    assert planned.command == ("fleetllm", "engine", "serve")
    read = parse_serve_args(planned.args)
    s = planned.status
    assert read["model"] == planned.model_path
    assert read["served_model_name"] == [base["model"]["name"]]
    assert read["dtype"] == s.dtype == "float32"
    assert read["max_model_len"] == s.max_model_len
    assert read["num_kv_blocks"] == s.num_kv_blocks
    assert read["max_num_seqs"] == s.max_num_seqs
    assert read["max_num_batched_tokens"] == s.max_num_batched_tokens
    assert read["block_size"] == s.block_size
    assert read["device"] == s.device
    assert read["shutdown_grace_period"] == 45


EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "manifests" / "examples").glob("*.yaml"))


def test_every_builtin_example_plans_arguments_the_engine_reads() -> None:
    builtin = [
        cr
        for path in EXAMPLES
        for cr in load_llmdeployments(path)
        if cr.spec.engine.backend == "builtin"
    ]
    assert builtin
    for cr in builtin:
        planned = plan(cr.spec)
        read = parse_serve_args(planned.args)
        assert read["max_model_len"] == planned.status.max_model_len, cr.metadata.name
        assert read["num_kv_blocks"] == planned.status.num_kv_blocks, cr.metadata.name


def test_extra_args_the_engine_has_are_passed_after_the_planned_ones() -> None:
    extra = ["--num-threads=3", "--no-enable-prefix-caching", "--step-timeout", "30"]
    extra += ["--scheduling-policy=fcfs"]
    planned = plan(spec(CPU, extraArgs=extra))
    assert list(planned.args[-5:]) == extra
    read = parse_serve_args(planned.args)
    assert (read["num_threads"], read["enable_prefix_caching"], read["step_timeout"]) == (
        3,
        False,
        30.0,
    )
    assert read["scheduling_policy"] == "fcfs"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--num-threads", "many"], "--num-threads: invalid int value: 'many'"),
        (["--log-level=loud"], "invalid choice: 'loud'"),
        # vLLM's other policy: this engine takes no per-request priority to order by.
        (["--scheduling-policy", "priority"], "invalid choice: 'priority'"),
        (["--help"], "print its help and exit"),
        (["stray"], "unrecognized arguments: stray"),
        (["--num-threads"], "expected one argument"),
        (["--max-model=64"], "sets --max-model-len (under another spelling)"),
        (["--max-num-seq", "4"], "sets --max-num-seqs (under another spelling)"),
        (["--shutdown-grace=1"], "sets --shutdown-grace-period (under another spelling)"),
        (["--dtype=float16"], "sets --dtype, which the planner owns; use engine.dtype"),
        (["--block-size", "32"], "it is not configurable"),
    ],
)
def test_extra_args_the_engine_would_refuse_are_refused_with_the_reason(
    extra: list[str], words: str
) -> None:
    with pytest.raises(PlanError) as info:
        plan(spec(CPU, extraArgs=extra))
    assert info.value.reason == "InvalidEngineArgs"
    assert words in info.value.message


def test_vllm_extra_args_are_not_checked_against_the_builtin_engine() -> None:
    planned = plan(spec(GPU, backend="vllm", extraArgs=["--enable-chunked-prefill"]))
    assert planned.args[-1] == "--enable-chunked-prefill"
    with pytest.raises(PlanError, match="use maxModelLen"):
        plan(spec(GPU, backend="vllm", extraArgs=["--max-model-len=4096"]))


def test_flags_changed_names_the_long_flag_however_spelt() -> None:
    planned = ["--max-model-len", "2048", "--dtype", "float32"]
    assert flags_changed(planned, ["--max-model-l", "1024"]) == ["--max-model-len"]
    assert flags_changed(planned, ["--max-model-len", "2048"]) == []
    with pytest.raises(ArgsRefused):
        flags_changed(planned, ["--bogus"])


FLAGS = sorted({*OWNED_FLAGS, "--num-threads", "--seed", "--step-timeout", "--log-level", "-x"})
TOKENS = st.one_of(
    st.sampled_from(FLAGS),
    st.builds(lambda f, v: f"{f}={v}", st.sampled_from(FLAGS), st.text(max_size=6)),
    st.text(max_size=8),
    st.sampled_from(["1", "-1", "nan", "1e9", "debug", "--", "-"]),
)


@settings(max_examples=150, deadline=None)
@given(extra=st.lists(TOKENS, max_size=4))
def test_any_extra_args_either_reach_the_engine_unrefused_or_are_refused(
    extra: list[str],
) -> None:
    try:
        planned = plan(spec(CPU, extraArgs=extra))
    except PlanError as exc:
        assert exc.reason == "InvalidEngineArgs"
        return
    parse_serve_args(planned.args)  # the engine reads them
    base = planned.args[: len(planned.args) - len(extra)]
    assert not set(flags_changed(base, extra)) & set(OWNED_FLAGS)


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_tool_calling_and_chat_template_flags_pass_for_both_backends(backend: str) -> None:
    """vLLM's tool-calling flags, which the builtin engine has too, under the same names."""
    extra = [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--chat-template",
        "/models/tools.jinja",
    ]
    planned = plan(spec(CPU, backend=backend, extraArgs=extra))
    assert list(planned.args[-5:]) == extra
    if backend == "builtin":
        read = parse_serve_args(planned.args)
        assert read["enable_auto_tool_choice"] is True
        assert (read["tool_call_parser"], read["chat_template"]) == (
            "hermes",
            "/models/tools.jinja",
        )


def test_a_tool_call_parser_the_builtin_engine_lacks_is_refused() -> None:
    with pytest.raises(PlanError, match="invalid choice: 'mistral'"):
        plan(spec(CPU, extraArgs=["--tool-call-parser", "mistral"]))
