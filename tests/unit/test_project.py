"""Project-wide contracts: CI runs the README's test command and the code is lint clean."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert main_job.startswith("scripts/setup.sh && ")
    assert tests.startswith("scripts/setup.sh && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines()


def test_ruff_is_clean() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    for args in (["check", "--quiet"], ["format", "--check", "--quiet"]):
        result = subprocess.run(
            [str(ruff), *args, str(ROOT)], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_repository_root_does_not_shadow_stdlib_operator() -> None:
    # `python -m` puts the working directory first on sys.path before the standard library's
    # `operator` is imported; the operator/ folder must not be a package that shadows it.
    for args in (
        ["-S", "-c", "import operator; print(operator.__file__)"],
        ["-m", "fleetllm.cli", "--version"],
    ):
        result = subprocess.run(
            [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stderr
        assert str(ROOT / "operator") not in result.stdout
