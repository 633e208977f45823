"""The engine pods' preStop hook against a real engine process: the exact command the renderer
puts in the pod (python3 -c SOURCE SETTLE CAP PORT), run with the machine's own python3, which
has no fleetllm (as in vLLM's image)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from deployment_manifests import smollm2
from local_services import free_port
from server_helpers import SERVED_NAME, ServerProcess, parse_sse, tiny_server_args
from test_server_shutdown import EXIT_GUARD_S, StreamThread, start_streams

from fleetllm.api.contract import ENGINE_PORT
from fleetllm.api.deployment import LLMDeployment
from fleetllm.operator.render import PRESTOP_SECONDS, render
from fleetllm.planner.plan import plan

SMOLLM2 = smollm2(served_name=SERVED_NAME, maxModelLen=2048, engine={"drainSeconds": 45})


def _rendered_hook() -> list[str]:
    cr = LLMDeployment.model_validate(SMOLLM2)
    (deployment,) = [o for o in render(cr, plan(cr.spec)) if o["kind"] == "Deployment"]
    command = deployment["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]
    return list(command["exec"]["command"])


def _hook(port: int, cap: float, settle: float = 0.0) -> subprocess.Popen[str]:
    """The rendered hook with the test's settle time, cap and port."""
    command = _rendered_hook()
    assert command[:2] == ["python3", "-c"]
    assert command[3:] == [str(PRESTOP_SECONDS), "45", str(ENGINE_PORT)]
    command[3:] = [str(settle), str(cap), str(port)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


class TimedStream(StreamThread):
    """A stream that records when its response was read to the end."""

    finished_at = 0.0

    def run(self) -> None:
        super().run()
        self.finished_at = time.monotonic()


@pytest.fixture(scope="module")
def long_context_server(launch: Callable[..., ServerProcess], tiny_chat_dir: Path) -> ServerProcess:
    """One engine for the module (the last test stops it): a context long enough for streams
    that outlast the cap, and a short grace period, so that SIGTERM aborts what still runs."""
    args = tiny_server_args(tiny_chat_dir, "--shutdown-grace-period", "0.5")
    args[args.index("--max-model-len") + 1] = "2048"
    return launch(args)


def test_the_hook_returns_only_after_both_streams_finished(
    long_context_server: ServerProcess,
) -> None:
    server = long_context_server
    threads = start_streams(server, 2, 300, TimedStream)
    assert server.metric("vllm:num_requests_running") == 2
    started = time.monotonic()
    hook = _hook(server.port, cap=120)
    output, _ = hook.communicate(timeout=EXIT_GUARD_S + 120)
    returned = time.monotonic()
    assert hook.returncode == 0, output
    for t in threads:
        t.join(EXIT_GUARD_S)
        assert not t.is_alive() and t.error is None
        finish = [c["finish_reason"] for e in parse_sse(t.raw) for c in e["choices"]]
        assert finish[-1] == "length"  # the streams ran to their end, nothing was cut
    last_stream = max(t.finished_at for t in threads)
    assert returned >= last_stream, "the hook returned while a stream was still running"
    # ...and soon after: two idle reads a second apart.
    assert returned - last_stream < 10
    assert returned - started >= 0.5
    assert server.metric("vllm:num_requests_running") == 0
    assert output == ""  # no cap message


def test_an_idle_or_absent_engine_is_not_waited_for(long_context_server: ServerProcess) -> None:
    started = time.monotonic()
    idle = _hook(long_context_server.port, cap=60)
    assert idle.wait(EXIT_GUARD_S) == 0
    assert time.monotonic() - started < 10  # two idle reads, not the cap
    started = time.monotonic()
    gone = _hook(free_port(), cap=60)
    assert gone.wait(EXIT_GUARD_S) == 0
    assert time.monotonic() - started < 5


def test_the_hook_returns_at_the_cap_with_streams_still_running(
    long_context_server: ServerProcess,
) -> None:
    server = long_context_server
    threads = start_streams(server, 2, 2000, TimedStream)
    started = time.monotonic()
    hook = _hook(server.port, cap=1.5)
    output, _ = hook.communicate(timeout=EXIT_GUARD_S)
    took = time.monotonic() - started
    assert hook.returncode == 0
    assert 1.5 <= took < 1.5 + 10  # the cap, plus at most one slow metrics read
    assert all(t.is_alive() for t in threads), "these streams outlast the cap"
    assert "requests in flight" in output
    # What the kubelet does next (this ends the module's server): the engine drains for its
    # grace period, then aborts what still runs, and exits.
    server.terminate()
    for t in threads:
        t.join(EXIT_GUARD_S)
        assert not t.is_alive() and t.error is None
    assert server.proc.wait(EXIT_GUARD_S) == 0
