"""benchmarks/gpu_bench.py runs end to end in its dry-run mode (tiny shapes on the CPU), so the
GPU benchmark does not rot where there is no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "gpu_bench.py"


def test_dry_run_writes_its_results_and_table(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert result["dry_run"] is True and result["device"] == "cpu"
    assert result["copy_bandwidth_gb_s"] > 0
    single = result["single_stream"]
    assert single["tok_s"] > 0 and single["roofline_tok_s"] > 0
    assert single["fraction_of_roofline"] == single["tok_s"] / single["roofline_tok_s"]
    assert set(result["concurrency"]) == {"2", "4"}
    for n, row in result["concurrency"].items():
        assert row["fleetllm_tok_s"] > 0
        assert row["hf_best_batch"] <= int(n)
        assert row["hf_best_tok_s"] == max(row["hf_tok_s_by_batch"].values())
        assert row["ratio"] == row["fleetllm_tok_s"] / row["hf_best_tok_s"]
    assert "single stream decode" in proc.stdout
    assert "HF best tok/s" in proc.stdout
