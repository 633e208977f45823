"""Helpers of the cluster tier: helm and kubectl from the virtual environment, waiting, and a
port-forward to the router."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from local_services import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RELEASE = "fleetllm"
SYSTEM = "fleetllm-system"
ROUTER_SERVICE = "svc/fleetllm-router"
# The key the quickstart installs the chart with.
KEY = "sk-quickstart"
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}

needs_cluster = pytest.mark.skipif(
    not os.environ.get("KUBECONFIG"),
    reason="needs a real cluster: set KUBECONFIG (scripts/kind-e2e.sh makes one with kind)",
)

T = TypeVar("T")


@dataclass
class Quickstart:
    """docs/quickstart.md's cluster commands, and what each printed."""

    commands: list[str]
    outputs: dict[str, str] = field(default_factory=dict)
    """stdout of each command that ran in the foreground."""


def tool(name: str) -> str:
    path = BIN / name
    if not path.is_file():
        pytest.fail(f"{name} is missing from {BIN}: run scripts/setup.sh")
    return str(path)


def run(
    *args: str, stdin: str | None = None, timeout: float = 120.0, check: bool = True,
    cwd: Path = ROOT,
) -> str:  # fmt: skip
    result = subprocess.run(
        args, input=stdin, capture_output=True, text=True, check=False, timeout=timeout, env=ENV,
        cwd=cwd,
    )  # fmt: skip
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result.stdout


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    return run(tool("kubectl"), *args, stdin=stdin, check=check)


def get_json(*args: str) -> dict[str, Any]:
    return dict(json.loads(kubectl("get", *args, "-o", "json")))


def wait_for(predicate: Callable[[], T | None], what: str, timeout: float = 300.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(2.0)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond.get("type") == kind:
            return dict(cond)
    return None


@contextlib.contextmanager
def router_url() -> Iterator[str]:
    """The router's Service, port-forwarded to a free local port."""
    port = free_port()
    forward = subprocess.Popen(
        [tool("kubectl"), "-n", SYSTEM, "port-forward", ROUTER_SERVICE, f"{port}:80"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )

    def listening() -> bool:
        assert forward.poll() is None, "kubectl port-forward exited"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(listening, "the port-forward to the router", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        forward.terminate()
        forward.wait(10)
