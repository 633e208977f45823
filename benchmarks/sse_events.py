"""The router's SSE event splitter against the naive way, on one long event that arrives in
small chunks (what a hostile replica sends: an event with no blank line yet).

The naive splitter appends each chunk to the pending bytes and searches them all again for a
blank line: its time grows with the square of the event's length. fleetllm's
(`fleetllm.router.sse.EventSplitter`) searches only what is new: linear. Both run in this
process on the same chunks; the script prints each one's time per MiB at growing lengths and
the ratio naive / ours.

    python benchmarks/sse_events.py                   # 2, 4, 8, 16 MiB in 64 KiB chunks
    python benchmarks/sse_events.py --mib 1 4 16 --chunk-kib 16
"""

from __future__ import annotations

import argparse
import time

from fleetllm.router.sse import SSE_END, EventSplitter


def naive(chunks: list[bytes]) -> int:
    pending = b""
    for chunk in chunks:
        pending += chunk
        cut = pending.rfind(SSE_END)
        if cut >= 0:
            pending = pending[cut + len(SSE_END) :]
    return len(pending)


def ours(chunks: list[bytes]) -> int:
    splitter = EventSplitter(1 << 40)
    for chunk in chunks:
        splitter.feed(chunk)
    return len(splitter.rest())


def seconds(split: object, chunks: list[bytes]) -> float:
    start = time.perf_counter()
    split(chunks)  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--chunk-kib", type=int, default=64)
    args = parser.parse_args()
    chunk = b"x" * (args.chunk_kib * 1024)
    print(f"{'MiB':>5} {'naive s/MiB':>12} {'ours s/MiB':>11} {'naive/ours':>11}")
    for mib in args.mib:
        chunks = [b"data: "] + [chunk] * (mib * 1024 // args.chunk_kib)
        slow, fast = seconds(naive, chunks), seconds(ours, chunks)
        print(f"{mib:>5} {slow / mib:>12.5f} {fast / mib:>11.5f} {slow / fast:>11.1f}")


if __name__ == "__main__":
    main()
