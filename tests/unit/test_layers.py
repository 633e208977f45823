"""The layers of docs/architecture.md, read from the source: who may import whom, and no room
grown past the size one reader can hold (600 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# folder in the tree -> the package it installs as (pyproject's package-dir)
PACKAGE_OF = {
    "engine": "fleetllm.engine",
    "operator": "fleetllm.operator",
    "router": "fleetllm.router",
    "fleetllm/api": "fleetllm.api",
    "fleetllm/planner": "fleetllm.planner",
    "fleetllm/autoscale": "fleetllm.autoscale",
    "fleetllm/weights": "fleetllm.weights",
    "fleetllm/local": "fleetllm.local",
    "fleetllm/kube": "fleetllm.kube",
    "fleetllm/policy": "fleetllm.policy",
}

# folder -> packages none of its modules may import (a backward arrow in the map)
FORBIDDEN = {
    "router": ["fleetllm.operator", "fleetllm.local", "fleetllm.engine"],
    "fleetllm/local": ["fleetllm.operator"],
    "fleetllm/api": [
        "fleetllm.operator",
        "fleetllm.planner",
        "fleetllm.engine",
        "fleetllm.router",
        "fleetllm.local",
        "fleetllm.autoscale",
        "fleetllm.kube",
    ],
    "fleetllm/planner": ["fleetllm.operator", "fleetllm.router", "fleetllm.local"],
    "fleetllm/autoscale": [
        "fleetllm.operator",
        "fleetllm.router",
        "fleetllm.local",
        "fleetllm.engine",
        "fleetllm.kube",
    ],
    "fleetllm/weights": ["fleetllm.operator", "fleetllm.router", "fleetllm.local"],
    # The admin's rules are pure: the operator and `fleetllm render` both apply them.
    "fleetllm/policy": [
        "fleetllm.operator",
        "fleetllm.planner",
        "fleetllm.engine",
        "fleetllm.router",
        "fleetllm.local",
        "fleetllm.kube",
    ],
    "engine": ["fleetllm.operator", "fleetllm.router", "fleetllm.local", "fleetllm.kube"],
}


# Leaves a lower room may still import: pure modules that import nothing of the project.
LEAVES = ["fleetllm.kube.resources"]
# Named exceptions per folder: the admin policy sees through vLLM's spellings of a flag with
# the planner's reading of vLLM's parser (pure, table-driven).
ALLOWED = {"fleetllm/policy": ["fleetllm.planner.vllm_args"]}


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module `path` imports, relative imports resolved against `package`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if path.name != "__init__.py" or node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def reaches(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_backward_imports(folder: str) -> None:
    sources = sorted((ROOT / folder).rglob("*.py"))
    assert sources, f"{folder} holds no Python source"
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sources
        for module in sorted(imported_modules(path, PACKAGE_OF[folder]))
        for banned in FORBIDDEN[folder]
        if reaches(module, banned)
        and not any(reaches(module, ok) for ok in LEAVES + ALLOWED.get(folder, []))
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_nothing_of_the_project(leaf: str) -> None:
    path = ROOT / (leaf.replace(".", "/") + ".py")
    package = leaf.rsplit(".", 1)[0]
    project = [m for m in imported_modules(path, package) if reaches(m, "fleetllm")]
    assert not project, project


def test_import_reader_sees_a_known_backward_import(tmp_path: Path) -> None:
    # The check above is only as good as its reader: both import forms must be seen.
    module = tmp_path / "probe.py"
    module.write_text(
        "import fleetllm.operator.render\nfrom ..operator import api\nfrom . import x\n"
    )
    found = imported_modules(module, "fleetllm.router")
    assert reaches("fleetllm.operator.render", "fleetllm.operator")
    assert "fleetllm.operator.api" in found
    assert "fleetllm.router.x" in found
    assert any(reaches(m, "fleetllm.operator") for m in found)


def python_sources() -> list[Path]:
    skip = {".git", "node_modules"}
    return [
        path
        for path in ROOT.rglob("*.py")
        if not any(part in skip or part.startswith(".venv") for part in path.parts)
    ]


def test_no_source_file_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in python_sources()
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert not long, long
