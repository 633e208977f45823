"""Helpers for the vLLM tier: vLLM replicas started with the planned command, a router and
`fleetllm up` as subprocesses, their log events, and metrics reads."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from local_services import free_port, stop_process
from prometheus_client.parser import text_string_to_metric_families

from fleetllm.local.launch import LocalModel, kv_events_endpoint, replica_argv, replica_env

ROOT = Path(__file__).resolve().parents[3]
MODEL = "smollm2-135m"
START_GUARD_S = 420.0
"""Hang guard only: vLLM's CPU build starts in about 70 s with --enforce-eager, two at a
time on two cores in about twice that."""
GUARD_S = 120.0

# SmolLM2 through vLLM's CPU build, as `fleetllm up` plans it. --enforce-eager: with the KV
# cache given in bytes, vLLM then skips its torch.compile warm-up (150-210 s here; about 70 s
# without), which the tier would otherwise pay for every replica it starts. Four sequence
# slots, so that a few concurrent requests fill a replica (its metrics show them waiting).
# Routed kv-aware: its replicas publish their KV events (a router over them may route by
# another strategy all the same).
MANIFEST = """\
apiVersion: fleetllm.io/v1alpha1
kind: LLMDeployment
metadata: {name: smollm2-vllm}
spec:
  model: {name: smollm2-135m, source: "builtin://smollm2-135m"}
  engine:
    backend: vllm
    dtype: bfloat16
    maxNumSeqs: 4
    drainSeconds: 120
    extraArgs: ["--enforce-eager", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
  gpu: {type: cpu}
  maxModelLen: 1024
  pod: {resources: {limits: {memory: 3Gi}}}
  routing: {strategy: kv-aware}
"""


FLEET = (
    MANIFEST.replace("strategy: kv-aware", "strategy: least-load")
    + """\
  scaling:
    minReplicas: 1
    maxReplicas: 2
    targetQueueTimeSeconds: 60
    scaleDownDelaySeconds: 5
"""
)
"""The same model under `fleetllm up`'s autoscaler: one replica, two under load (six clients
on four sequence slots need 6 / (4 x 0.8) = 1.9 replicas); back to one 5 s after. Least
load, so that two requests of one prompt run one on each replica (the prefix strategy would
keep both on the prompt's home)."""


def wait_until(predicate: Callable[[], bool], what: str, guard_s: float = GUARD_S) -> None:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > guard_s:
            raise AssertionError(f"not reached within the {guard_s}s hang guard: {what}")
        time.sleep(0.1)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and set(labels.items()) <= set(sample.labels.items())
    )


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.TransportError:
        return False


class Replica:
    """One vLLM process running the planned `vllm serve` command on a free port, in a
    process group of its own (vLLM runs its engine core and workers as children)."""

    def __init__(self, model: LocalModel, log_path: Path, cores: tuple[int, ...]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("ab")
        # Its KV-event sockets, where its model publishes them (a short path: Unix sockets).
        self._sockets = tempfile.TemporaryDirectory(prefix="kv-")
        self.kv_events = kv_events_endpoint(model, Path(self._sockets.name), self.port)
        self.proc = subprocess.Popen(
            replica_argv(model, self.port, threads=None, events=self.kv_events),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=replica_env(model, os.environ, None, cores),
            # A group, not a session: each session is a scheduling autogroup (see
            # fleetllm/local/process.py).
            process_group=0,
        )

    def wait_healthy(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"vLLM exited with {self.proc.returncode}:\n{tail}")
            return healthy(self.url)

        wait_until(up, f"vLLM on {self.port} healthy", START_GUARD_S)

    def metrics(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=10.0)
        response.raise_for_status()
        return response.text

    def kill(self) -> None:
        """SIGKILL the whole group: the API server and its engine core, at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        self._sockets.cleanup()


class Router:
    """`fleetllm router serve` over a fleet file, as a subprocess."""

    def __init__(self, fleet_file: Path, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_path.open("ab")
        cmd = [sys.executable, "-m", "fleetllm.cli", "router", "serve", "--fleet-file"]
        cmd += [str(fleet_file), *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(lambda: healthy(self.url), "router healthy")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=300)

    def upstream(self, replica: str) -> float:
        """Attempts the router sent to `replica`, whatever came of them."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        return metric_sum(text, "fleetllm:router_upstream_requests_total", replica=replica)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10.0).text

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()


class Up:
    """`fleetllm up` as a subprocess: its JSON log (stderr, as without a terminal) read as
    events."""

    def __init__(self, manifest: Path, workdir: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.events_path = workdir / "events.log"
        cmd = [sys.executable, "-m", "fleetllm.cli", "up", "-f", str(manifest)]
        cmd += ["--port", str(self.port), "--log-dir", str(workdir / "logs")]
        with (workdir / "status.txt").open("wb") as out, self.events_path.open("wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=err, env={**os.environ, **env}, cwd=ROOT
            )

    def events(self, msg: str, **fields: Any) -> list[dict[str, Any]]:
        found = []
        for line in self.events_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("msg") == msg and all(
                        event.get(k) == v for k, v in fields.items()
                    ):
                        found.append(event)
        return found

    def wait_for(
        self, msg: str, count: int = 1, guard_s: float = GUARD_S, **fields: Any
    ) -> list[dict[str, Any]]:
        def seen() -> bool:
            if self.proc.poll() is not None:
                tail = self.events_path.read_text(errors="replace")[-4000:]
                raise AssertionError(f"fleetllm up exited with {self.proc.returncode}:\n{tail}")
            return len(self.events(msg, **fields)) >= count

        wait_until(seen, f"{count} x {msg!r} {fields}", guard_s)
        return self.events(msg, **fields)[:count]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="-", max_retries=0, timeout=300)

    def close(self) -> int:
        """SIGTERM (drain and stop), then SIGKILL after the hang guard."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(GUARD_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
