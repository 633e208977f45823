"""The engine container's preStop hook: hold the stop until the replica has no request left.

Kubernetes runs it when a pod is told to stop, and sends SIGTERM only once it returns. It first
waits SETTLE seconds, while the pod's removal from the endpoints reaches the routers (requests
routed just before still arrive), then reads the engine's /metrics every second and returns
after two reads in a row with nothing running or waiting, or after CAP seconds, or at once when
the engine does not answer (nothing left to drain).

It needs only a python3 (no fleetllm): it runs in fleetllm's engine image and in vLLM's, whose
metrics carry the same names. The renderer passes this file's source inline:
`python3 -c SOURCE SETTLE CAP PORT`.
"""

from __future__ import annotations  # any python3 of an engine image will do

import math
import re
import sys
import time
import urllib.request

IN_FLIGHT = re.compile(
    r"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})?\s+([-+0-9.eE]+|NaN)\s*$", re.MULTILINE
)


def in_flight(port: int) -> float | None:
    """Requests running or waiting in the engine; None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    values = [float(value) for value in IN_FLIGHT.findall(text)]
    return sum(v for v in values if math.isfinite(v)) if values else None


def main(argv: list[str]) -> int:
    settle, cap, port = float(argv[0]), float(argv[1]), int(argv[2])
    time.sleep(settle)
    deadline = time.monotonic() + cap
    idle_reads = 0
    count = in_flight(port)
    while count is not None and time.monotonic() < deadline:
        idle_reads = idle_reads + 1 if count == 0 else 0
        if idle_reads >= 2:
            return 0
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        count = in_flight(port)
    if count:
        print(f"drain: {cap:g} s passed with {count:g} requests in flight", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
