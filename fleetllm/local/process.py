"""Starting and stopping guarded process trees (`fleetllm.local.guard`): the only place where
`fleetllm up` creates processes, replicas and model preparation alike."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may take it before the replica binds
    it; the replica then fails to start, and its restart picks another)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class GuardedProcess:
    """A guarded process tree. `terminate` asks the engine to drain and exit; `kill` ends the
    whole tree at once; the tree also ends when this process dies, however it dies."""

    def __init__(self, guard: asyncio.subprocess.Process, kill_fd: int) -> None:
        self._guard = guard
        self._kill_fd: int | None = kill_fd
        self.stdout = guard.stdout

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        *,
        capture_stdout: bool = False,
    ) -> GuardedProcess:
        """Start `argv` under a guard; its output goes to `log_path`, or stdout to a pipe
        (`stdout`) when `capture_stdout`."""
        read_fd, write_fd = os.pipe()  # neither end is inherited unless passed
        try:
            with log_path.open("ab") as log:
                guard = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "fleetllm.local.guard",
                    "--kill-fd",
                    str(read_fd),
                    "--",
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE if capture_stdout else log,
                    stderr=log if capture_stdout else asyncio.subprocess.STDOUT,
                    env=dict(env),
                    pass_fds=(read_fd,),
                    # Out of the terminal's process group: Ctrl-C reaches the supervisor only,
                    # which stops the fleet in order (the router first, then the engines).
                    # Not a session of its own: on Linux each session is a scheduling
                    # autogroup, and a replica starting in a group of its own next to a busy
                    # replica's group got almost no CPU time (minutes to start, not one).
                    process_group=0,
                )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        return cls(guard, write_fd)

    @property
    def pid(self) -> int:
        """The guard's pid (the engine is its only child)."""
        return self._guard.pid

    @property
    def returncode(self) -> int | None:
        return self._guard.returncode

    async def wait(self) -> int:
        code = await self._guard.wait()
        self._close()
        # A guard that was killed could not clear its tree: the engine died of PDEATHSIG, but
        # its own children live on in the guard's process group. A guard that exited on its
        # own left that group empty, and this finds no one.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._guard.pid, signal.SIGKILL)
        return code

    def terminate(self) -> None:
        """Ask the engine to drain and exit (SIGTERM through the guard)."""
        if self._guard.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._guard.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """End the whole tree now: the guard kills it when its pipe closes."""
        self._close()

    def _close(self) -> None:
        if self._kill_fd is not None:
            os.close(self._kill_fd)
            self._kill_fd = None


def describe_exit(code: int) -> str:
    """An exit status in words: `exit 1`, `killed by SIGKILL` (asyncio reports -N, the guard
    128 + N, for signal N)."""
    number = -code if code < 0 else code - 128 if code > 128 else 0
    with contextlib.suppress(ValueError):
        if number:
            return f"killed by {signal.Signals(number).name}"
    return f"exit {code}"
