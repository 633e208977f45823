"""Print the runtime requirements of one image, from pyproject.toml (the one list).

    python docker/requirements.py control-plane   # without the engine's dependencies
    python docker/requirements.py engine          # all but torch (installed on its own)

The control plane (operator, router, `fleetllm model pull`) never imports the engine's
modules, so its image leaves their dependencies out; a test runs those commands with the
packages below made unimportable.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# Needed only by fleetllm.engine (torch is installed first, from its own index, in the engine
# images), and by `fleetllm up` (rich, psutil), which runs engines and is no image's command.
# (tokenizers and jinja2 stay: the router tokenizes prompts for kv-aware routing.)
ENGINE_ONLY = frozenset(
    {
        "rich",
        "psutil",
        "torch",
        "numpy",
        "safetensors",
        "gguf",
        "ninja",
        "tqdm",
        "platformdirs",
        "fastapi",
        "uvicorn",
    }
)


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return match.group(0).lower().replace("_", "-")


def requirements(flavor: str, pyproject: Path) -> list[str]:
    deps: list[str] = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    if flavor == "control-plane":
        return [d for d in deps if requirement_name(d) not in ENGINE_ONLY]
    if flavor == "engine":
        return [d for d in deps if requirement_name(d) != "torch"]
    raise ValueError(f"unknown image flavor {flavor!r}: control-plane or engine")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write(__doc__ or "")
        return 2
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    sys.stdout.write("".join(f"{r}\n" for r in requirements(argv[0], pyproject)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
