"""The guard of one replica: `python -m fleetllm.local.guard --kill-fd N -- COMMAND ...`.

`fleetllm up` starts every engine through a guard, which stays the engine's parent, because
neither the supervisor nor the engine alone can promise that no process outlives the fleet:
the supervisor may be killed without a chance to clean up (SIGKILL, the OOM killer), and an
engine may have children of its own (vLLM's tensor-parallel ranks, tokenizer workers) that a
signal to the engine alone does not reach. The guard

- becomes a child subreaper (Linux), so that descendants orphaned by the engine are
  re-parented to the guard instead of init, and stay within reach;
- reads the pipe `--kill-fd`, whose write end only the supervisor holds: end-of-file means
  the supervisor closed it or died, and the guard kills the whole tree at once;
- passes SIGTERM and SIGINT on to the engine, which drains and exits; once the engine has
  exited, kills whatever is left of its tree and exits with the engine's status (128 + N
  when signal N ended it).

The engine runs with PR_SET_PDEATHSIG, so that it dies even if the guard itself is killed,
and stays in the guard's process group (the supervisor starts the guard as a group leader):
the engine's children that PDEATHSIG does not reach (vLLM's engine core and workers) are
still in that group, which the supervisor kills once the guard is gone. Only the standard
library and psutil are imported: the guard starts in milliseconds and holds next to no memory.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import select
import signal
import sys
from collections.abc import Sequence

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.1
# A tree that keeps forking while it is being killed gets this many rounds.
KILL_ROUNDS = 50
EXEC_FAILED = 127


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def _exec_child(command: Sequence[str], guard_pid: int) -> None:
    """In the forked child: die with the guard, then become COMMAND."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The guard may have died between the fork and the prctl; then nothing would signal.
        if os.getppid() != guard_pid:
            os._exit(EXEC_FAILED)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.execvp(command[0], list(command))
    except OSError as exc:
        os.write(2, f"fleetllm guard: cannot run {command[0]!r}: {exc}\n".encode())
    finally:
        os._exit(EXEC_FAILED)


def kill_tree() -> None:
    """SIGKILL every descendant of this process, and reap them. As a subreaper the guard is
    the parent of every orphan of the tree, even of those that left its process group."""
    me = psutil.Process()
    for _ in range(KILL_ROUNDS):
        try:
            children = me.children(recursive=True)
        except psutil.Error:
            children = []
        if not children:
            break
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(children, timeout=1.0)
        _reap()
    _reap()


def _reap() -> list[tuple[int, int]]:
    """Collect every exited child (the engine or adopted orphans): (pid, wait status)."""
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        reaped.append((pid, status))
    return reaped


def exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def run(command: Sequence[str], kill_fd: int) -> int:
    pending: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        pending.append(signum)

    # Before the fork: a stop request that arrives while the engine starts is not lost.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    guard_pid = os.getpid()
    engine = os.fork()
    if engine == 0:
        _exec_child(command, guard_pid)

    forwarded = 0
    while True:
        while forwarded < len(pending):
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, pending[forwarded])
            forwarded += 1
        for pid, status in _reap():
            if pid == engine:
                kill_tree()
                return exit_code(status)
        readable, _, _ = select.select([kill_fd], [], [], POLL_S)
        if readable and not os.read(kill_fd, 64):
            kill_tree()
            return 128 + signal.SIGKILL


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetllm.local.guard")
    parser.add_argument("--kill-fd", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to guard")
    return run(command, args.kill_fd)


if __name__ == "__main__":
    sys.exit(main())
