"""The cluster tier's control plane: installed by running docs/quickstart.md's cluster commands
as written (Helm chart, the CPU example, Ready, a request through the router), once for the
session; removed at the end."""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from docblocks import run_by
from e2e_cluster import ENV, ROOT, SYSTEM, Quickstart, kubectl, run, tool


@pytest.fixture(scope="session")
def quickstart() -> Iterator[Quickstart]:
    commands = [c for b in run_by("quickstart.md", "tests/e2e") for c in b.commands]
    assert commands, "docs/quickstart.md has no commands for the cluster tier"
    done = Quickstart(commands)
    background: list[subprocess.Popen[bytes]] = []
    try:
        for command in commands:
            if command.endswith("&"):
                background.append(
                    subprocess.Popen(
                        ["bash", "-c", command.removesuffix("&")],
                        cwd=ROOT,
                        env=ENV,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                continue
            # A cold node pulls nothing (the images are loaded) but starts the engine: minutes.
            done.outputs[command] = run("bash", "-c", command, timeout=900)
        yield done
    finally:
        for process in background:
            process.send_signal(signal.SIGTERM)
            process.wait(10)
        kubectl(
            "delete", "-f", "manifests/examples/smollm2-cpu.yaml", "--ignore-not-found",
            "--wait=true", "--timeout=180s", check=False,
        )  # fmt: skip
        run(tool("helm"), "uninstall", "fleetllm", "--namespace", SYSTEM, "--wait", check=False)
        kubectl("delete", "namespace", SYSTEM, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture()
def namespace(quickstart: Quickstart) -> Iterator[str]:
    """A fresh namespace, served by the installed control plane; deleted afterwards."""
    name = f"fleetllm-e2e-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)
