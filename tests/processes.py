"""Whether a process still runs, read from /proc: a zombie has exited (only its parent has not
collected it yet), and a process reaped between two reads is gone, not an error."""

from __future__ import annotations


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
