"""The guard of a replica's process tree, with real processes: no process of the tree
outlives the supervisor, even a grandchild that left the engine's session, nor the guard
itself killed, and a stop request reaches the engine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from local_testkit import alive, snapshot, survivors, wait_until

# An "engine" with two children: one plain, one that left for a session of its own (as
# daemonising workers do). Once that one has left, it writes all pids to a file and waits
# for a signal.
ENGINE = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    left = sys.argv[1] + ".left"
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    detached = subprocess.Popen([
        sys.executable, "-c",
        "import os, sys, time; os.setsid(); open(sys.argv[1], 'w').close(); time.sleep(600)",
        left,
    ])
    while not os.path.exists(left):
        time.sleep(0.01)
    def stop(signum, frame):
        sys.exit(3)
    signal.signal(signal.SIGTERM, stop)
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump({"engine": os.getpid(), "children": [plain.pid, detached.pid]}, f)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
    """
)

# A supervisor stand-in: starts one guarded engine the way `fleetllm up` does, reports the
# guard's pid, and either waits to be killed or stops the engine on SIGTERM.
SUPERVISOR = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys
    from pathlib import Path
    from fleetllm.local.process import GuardedProcess

    async def main():
        engine = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
        process = await GuardedProcess.start(engine, os.environ, Path(sys.argv[3]))
        print(json.dumps({"guard": process.pid}), flush=True)
        exited = asyncio.create_task(process.wait())  # as the supervisor's replica task does
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        process.terminate()
        print(json.dumps({"exit": await exited}), flush=True)

    asyncio.run(main())
    """
)


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], int, dict[str, object]]:
    pids_file = tmp_path / "pids.json"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, ENGINE, str(pids_file), str(tmp_path / "engine.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert supervisor.stdout is not None
    guard = json.loads(supervisor.stdout.readline())["guard"]
    wait_until(pids_file.exists, "the engine wrote its pids")
    return supervisor, guard, json.loads(pids_file.read_text())


def test_killing_the_supervisor_takes_the_whole_tree_with_it(tmp_path: Path) -> None:
    supervisor, guard, pids = _start(tmp_path)
    tree = snapshot([guard, pids["engine"], *pids["children"]])  # type: ignore[list-item]
    assert len(tree) == 4 and not [p for p in tree if not alive(p)]
    supervisor.kill()
    supervisor.wait()
    wait_until(lambda: not survivors(tree), "every process of the tree ended")


def test_an_engine_that_dies_leaves_no_orphans_and_its_status_is_reported(
    tmp_path: Path,
) -> None:
    supervisor, guard, pids = _start(tmp_path)
    try:
        children = snapshot(pids["children"])  # type: ignore[arg-type]
        guard_process = psutil.Process(guard)
        psutil.Process(pids["engine"]).kill()  # type: ignore[arg-type]
        wait_until(lambda: not survivors(children), "the engine's orphans were killed")
        wait_until(lambda: not alive(guard_process), "the guard exited with the engine")
    finally:
        supervisor.send_signal(signal.SIGTERM)
        out, _ = supervisor.communicate(timeout=30)
    # 128 + SIGKILL: the supervisor learns how the engine ended.
    assert json.loads(out.splitlines()[-1]) == {"exit": 128 + signal.SIGKILL}


def test_a_stop_request_reaches_the_engine_and_the_tree_is_cleared(tmp_path: Path) -> None:
    supervisor, guard, pids = _start(tmp_path)
    tree = snapshot([guard, pids["engine"], *pids["children"]])  # type: ignore[list-item]
    supervisor.send_signal(signal.SIGTERM)
    out, _ = supervisor.communicate(timeout=30)
    # The engine's own SIGTERM handler chose the status.
    assert json.loads(out.splitlines()[-1]) == {"exit": 3}
    wait_until(lambda: not survivors(tree), "every process of the tree ended")
    assert supervisor.returncode == 0


def test_killing_the_guard_takes_the_engine_and_its_children_with_it(tmp_path: Path) -> None:
    """Nothing in the guard runs once it is SIGKILLed: the engine dies of PDEATHSIG, and its
    children (as vLLM's engine core and workers are) by the supervisor, which kills what is
    left of the guard's process group. Only a descendant that left the group and the session
    (`detached`) is beyond reach: its subreaper, the guard, is gone."""
    supervisor, guard, pids = _start(tmp_path)
    plain, detached = pids["children"]  # type: ignore[misc]
    try:
        tree = snapshot([guard, pids["engine"], plain])  # type: ignore[list-item]
        psutil.Process(guard).kill()
        wait_until(lambda: not survivors(tree), "the engine and its child ended with the guard")
    finally:
        supervisor.send_signal(signal.SIGTERM)
        out, _ = supervisor.communicate(timeout=30)
        psutil.Process(detached).kill()
    assert json.loads(out.splitlines()[-1]) == {"exit": -signal.SIGKILL}
