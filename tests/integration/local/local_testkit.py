"""Helpers for the local fleet tests: `fleetllm up` as a subprocess, its log events, and
process trees (whether any of their processes is still alive)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import openai
import psutil
from local_services import free_port, git_blob_sha1, serve_http

ROOT = Path(__file__).resolve().parents[3]

GUARD_S = 60.0  # hang guard only


def wait_until(predicate: Callable[[], bool], what: str, guard_s: float = GUARD_S) -> None:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > guard_s:
            raise AssertionError(f"not reached within the {guard_s}s hang guard: {what}")
        time.sleep(0.05)


def snapshot(pids: Iterable[int]) -> list[psutil.Process]:
    """Processes by pid, remembered with their start time, so that a pid reused later by an
    unrelated process is not taken for a survivor."""
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            process.create_time()
            found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def alive(process: psutil.Process) -> bool:
    try:
        # is_running() compares the start time; a zombie has ended, only not been reaped yet.
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(processes: Iterable[psutil.Process]) -> list[str]:
    found = []
    for p in processes:
        try:
            if alive(p):
                found.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:  # ended (a zombie included) between the two looks
            pass
    return found


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class Up:
    """`fleetllm up` as a subprocess on a free port: its status lines in `status.txt`, its
    JSON log in `events.log`, the replicas' logs in `logs/`."""

    def __init__(
        self,
        args: list[str],
        workdir: Path,
        *,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        port: int | None = None,
        tty: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.events_path = workdir / "events.log"
        self.status_path = workdir / "status.txt"
        cmd = command or [
            sys.executable, "-m", "fleetllm.cli", "up", *args,
            "--port", str(self.port), "--log-dir", str(workdir / "logs"),
        ]  # fmt: skip
        environment = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "FLEETLLM_PORT": str(self.port),
            # Where the default log folder goes when no --log-dir is given.
            "XDG_STATE_HOME": str(workdir / "state"),
            **(env or {}),
        }
        self._reader: threading.Thread | None = None
        with self.status_path.open("wb") as out, self.events_path.open("wb") as err:
            stdout: Any = out
            if tty:
                # On a terminal the view is live and the JSON log goes to the log folder.
                self.events_path = workdir / "logs" / "fleetllm-up.log"
                terminal, stdout = pty.openpty()
                fcntl.ioctl(stdout, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
            # A session of its own, as a terminal gives a command: Ctrl-C is a SIGINT to it.
            self.proc = subprocess.Popen(
                cmd, stdout=stdout, stderr=err, env=environment, cwd=ROOT, start_new_session=True
            )
            if tty:
                os.close(stdout)
                self._reader = threading.Thread(target=self._drain, args=(terminal,), daemon=True)
                self._reader.start()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._seen: list[psutil.Process] = []

    def _drain(self, terminal: int) -> None:
        """Copy what the command writes to its terminal into `status.txt`."""
        with self.status_path.open("ab") as out:
            while True:
                try:
                    data = os.read(terminal, 65536)
                except OSError:  # the command closed its end
                    break
                if not data:
                    break
                out.write(data)
                out.flush()
        os.close(terminal)

    def events(self) -> list[dict[str, Any]]:
        found = []
        if not self.events_path.exists():
            return found
        for line in self.events_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line))
        return found

    def find(self, msg: str, **fields: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events()
            if e.get("msg") == msg and all(e.get(k) == v for k, v in fields.items())
        ]

    def wait_for(
        self, msg: str, count: int = 1, guard_s: float = GUARD_S, **fields: Any
    ) -> list[dict[str, Any]]:
        """The first `count` events `msg` with these fields, once there are that many."""

        def seen() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"fleetllm up exited with {self.proc.returncode}:\n"
                    + self.events_path.read_text(errors="replace")[-4000:]
                )
            return len(self.find(msg, **fields)) >= count

        wait_until(seen, f"{count} x {msg!r} {fields}", guard_s)
        return self.find(msg, **fields)[:count]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="-", max_retries=0, timeout=120)

    def tree(self) -> list[psutil.Process]:
        """Every process below `fleetllm up` now (guards, engines, their children); all are
        remembered, so that `close` can make sure none is left even if a test fails."""
        found = descendants(self.proc.pid)
        self._seen += found
        return found

    def engines(self) -> list[psutil.Process]:
        """The guards' children: the engine processes of the replicas."""
        tree = self.tree()
        guards = {p.pid for p in tree if "fleetllm.local.guard" in _cmdline(p)}
        return [p for p in tree if _ppid(p) in guards]

    def stop(self, sig: signal.Signals = signal.SIGTERM, guard_s: float = GUARD_S) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(guard_s)

    def interrupt(self, guard_s: float = GUARD_S) -> int:
        """Ctrl-C, as a terminal sends it: SIGINT to the command's process group."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(guard_s)

    def close(self) -> None:
        """Leave nothing running, whatever happened in the test."""
        self.tree()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for process in self._seen:
            if alive(process):
                with contextlib.suppress(psutil.Error):
                    process.kill()
        if self._reader is not None:
            self._reader.join(10)


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _ppid(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:
        return None


@contextlib.contextmanager
def fake_hub(repo: str, folder: Path) -> Iterator[str]:
    """A local HTTP server that serves the files of `folder` as the Hugging Face hub serves
    repository `repo` (the listing API and `resolve` downloads); yields its URL, for
    HF_ENDPOINT."""
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    commit = "0" * 40

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_GET(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            body: bytes | None = None
            if path.startswith(f"/api/models/{repo}/revision/"):
                siblings = [
                    {"rfilename": n, "size": len(d), "blobId": git_blob_sha1(d)}
                    for n, d in files.items()
                ]
                body = json.dumps({"id": repo, "sha": commit, "siblings": siblings}).encode()
            elif path.startswith(f"/{repo}/resolve/{commit}/"):
                body = files.get(urllib.parse.unquote(path.rsplit("/", 1)[1]))
            self.send_response(404 if body is None else 200)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

    with serve_http(Handler) as url:
        yield url
