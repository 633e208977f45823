"""The engine's CPU benchmark scripts run end to end on a tiny random model, so that a change to
the engine's interfaces cannot leave them broken where no test would notice (throughput.py
once failed on a changed return value of the step builder). The figures are not checked, only
that each run completes and prints figures consistent with one another."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tinymodels import write_tiny_chat_model

BENCHMARKS = Path(__file__).parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("bench-chat"))


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def figure(output: str, pattern: str) -> float:
    found = re.search(pattern, output)
    assert found, f"no match for {pattern!r} in:\n{output}"
    return float(found.group(1))


def ratio_shown(shown: float, num: float, den: float, shown_step: float) -> bool:
    """Whether `shown` (printed to `shown_step`) is num / den, for num and den printed to one
    decimal: the bounds allow for the rounding of all three."""
    low = (num - 0.05) / (den + 0.05) - shown_step / 2
    high = (num + 0.05) / max(den - 0.05, 1e-9) + shown_step / 2
    return low <= shown <= high


def test_throughput_compares_the_engine_with_hf_and_the_matmul_peak(chat_model: Path) -> None:
    out = run(
        "throughput.py", "--model", str(chat_model), "--requests", "4", "--max-num-seqs", "4",
        "--hf-batch-sizes", "2,4", "--threads", "1",
    ).stdout  # fmt: skip
    ours = figure(out, r"fleetllm engine\s*:\s*([\d.]+) output tokens/s")
    hf = figure(out, r"HF transformers\s*:\s*([\d.]+) output tokens/s")
    assert figure(out, r"best static batch (\d+)") in (2, 4)
    assert ratio_shown(figure(out, r"ratio fleetllm / HF\s*:\s*([\d.]+)x"), ours, hf, 0.01)
    step = figure(out, r"decode step \(4 seqs\): ([\d.]+) ms")
    forward = figure(out, r"bare forward ([\d.]+) ms")
    assert ratio_shown(figure(out, r"overhead ([\d.]+)x"), step, forward, 0.001)
    achieved = figure(out, r"decode FLOP/s\s*:\s*([\d.]+) GFLOP/s")
    peak = figure(out, r"matmul's ([\d.]+) GFLOP/s")
    assert ratio_shown(figure(out, r"= ([\d.]+)% of") / 100, achieved, peak, 0.001)
    assert "cpu flags" in out and "load average" in out


@pytest.mark.parametrize("adaptive", ["--adaptive-threads", "--no-adaptive-threads"])
def test_throughput_beside_a_busy_neighbour_stops_its_spinner(chat_model: Path, adaptive: str):
    done = run(
        "throughput.py", "--model", str(chat_model), "--requests", "4", "--max-num-seqs", "4",
        "--threads", "1", "--skip-hf", "--busy-neighbour", adaptive,
    )  # fmt: skip
    out = done.stdout + done.stderr  # the progress lines go to stderr
    assert "busy neighbour: a process spinning on CPU" in out
    assert ("(adaptive)" in out) == (adaptive == "--adaptive-threads")
    assert figure(out, r"fleetllm engine\s*:\s*([\d.]+) output tokens/s") > 0
    assert not spinning_processes()  # the neighbour went with the run


def spinning_processes() -> list[str]:
    """The command lines of running processes that are throughput.py's neighbour."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        if "os.sched_setaffinity" in text and "while True" in text:
            found.append(text)
    return found


def test_step_profile_breaks_fleetllm_steps_down(chat_model: Path, tmp_path: Path) -> None:
    result = tmp_path / "profile.json"
    run(
        "step_profile.py", "--engine", "fleetllm", "--model", str(chat_model), "--batch", "1", "2",
        "--steps", "2", "--warmup", "1", "--threads", "1", "--json-out", str(result),
    )  # fmt: skip
    found = json.loads(result.read_text())["fleetllm"]
    assert found["matmul"]["peak_flops"] > 0
    for size in ("1", "2"):
        prefill, decode = found[size]["prefill"], found[size]["decode"]
        assert prefill["prefill_ms"] > 0 and decode["step_ms"] > 0
        # The kinds account for the whole time: what no operator took is "outside operators".
        assert sum(prefill["by_kind_ms"].values()) == pytest.approx(prefill["prefill_ms"])
        assert sum(decode["by_kind_ms"].values()) == pytest.approx(decode["profiled_step_ms"])
        # The engine's own kernels are named, so their time is not lost among "outside".
        assert "fleetllm::decode" in dict(decode["top_ops_ms"])
        assert "fleetllm::paged_prefill" in dict(prefill["top_ops_ms"])


def test_prefill_attention_times_the_kernel_against_the_reference() -> None:
    proc = run("prefill_attention.py", "--repeats", "1", "--threads", "1", "--dtype", "float32")
    lines = [line for line in proc.stdout.splitlines() if "reference / kernel" in line]
    assert len(lines) == 6, proc.stdout
    for line in lines:
        ours = figure(line, r"kernel +([\d.]+) ms")
        theirs = figure(line, r"reference +([\d.]+) ms")
        shown = figure(line, r"reference / kernel ([\d.]+)x")
        assert ours > 0 and theirs > 0
        # Times are printed to 0.001 ms and the ratio to 0.01.
        rounding = 0.005 + theirs / ours * (0.0005 / ours + 0.0005 / theirs) + 1e-9
        assert abs(shown - theirs / ours) <= rounding, line
