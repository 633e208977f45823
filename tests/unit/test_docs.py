"""The documentation site: `mkdocs build --strict` passes (no broken link or anchor, no page
outside the nav), every command of the quickstart is run by a test or a script, and what the
docs say `fleetllm plan` prints is what it prints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from docblocks import DOCS, ROOT, Block, blocks, run_by

from fleetllm.cli import main

README_TEST = "tests/integration/local/test_local_readme.py"
KIND_SCRIPT = "scripts/kind-e2e.sh"
E2E_TIER = "tests/e2e"


def test_mkdocs_build_strict_passes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "runbook" / "index.html").is_file()
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert "quickstart.md" in str(nav) and "crd-reference.md" in str(nav)


def _readme_blocks() -> list[Block]:
    return blocks(ROOT / "README.md")


def test_every_quickstart_command_is_run_by_a_test_or_a_script() -> None:
    shell = [b for b in blocks("quickstart.md") if b.lang in ("bash", "shell", "sh")]
    assert shell
    for block in shell:
        assert block.note and block.note.startswith("run by: "), f"no runner for {block.body!r}"
    runners = {b.note.split("run by: ", 1)[1].split(" ", 1)[0] for b in shell if b.note}
    assert runners == {README_TEST, KIND_SCRIPT, E2E_TIER}
    for runner in runners:
        assert (ROOT / runner).exists(), runner

    # The local quickstart is README.md's, which the README test runs as written.
    readme = [b.body for b in _readme_blocks() if b.lang in ("bash", "shell")]
    for block in run_by("quickstart.md", README_TEST):
        assert block.body in readme
    readme_test = (ROOT / README_TEST).read_text()
    assert "```bash" in readme_test and "```shell" in readme_test

    # The kind script runs the cluster set-up lines, as written.
    script_lines = {line.strip() for line in (ROOT / KIND_SCRIPT).read_text().splitlines()}
    for block in run_by("quickstart.md", KIND_SCRIPT):
        for command in block.commands:
            assert command in script_lines, command

    # The e2e tier reads its commands from the page itself, and runs them first.
    e2e = (ROOT / E2E_TIER / "conftest.py").read_text()
    assert f'run_by("quickstart.md", "{E2E_TIER}")' in e2e
    commands = [c for b in run_by("quickstart.md", E2E_TIER) for c in b.commands]
    assert any(c.startswith(".venv/bin/helm install fleetllm charts/fleetllm") for c in commands)
    assert any(c.startswith("curl ") for c in commands)


@pytest.mark.parametrize(("page", "outputs"), [("planner.md", 2), ("lora.md", 1)])
def test_documented_plan_outputs_are_current(
    page: str, outputs: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = blocks(page)
    checked = 0
    for i, block in enumerate(found):
        if not (block.note or "").startswith("output of: fleetllm plan -f "):
            continue
        source = block.note.split("output of: fleetllm plan -f ", 1)[1]
        if source == "(the LLMDeployment above)":
            manifest = tmp_path / f"{i}.yaml"
            manifest.write_text(found[i - 1].body)
        else:
            manifest = ROOT / source
        main(["plan", "-f", str(manifest)])
        assert capsys.readouterr().out.rstrip("\n") == block.body, f"{page}: {block.note}"
        checked += 1
    assert checked == outputs


def test_every_doc_page_is_reachable() -> None:
    pages = {p.name for p in DOCS.glob("*.md")}
    nav = str(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert {p for p in pages if p not in nav} == set()
