"""`python -m fleetllm.local.prepare MODEL`: get a model ready for the builtin engine (a GGUF
file is converted once into the cache) before its replicas start, so that they do not each
wait on the conversion, and so that the status view can show its progress.

It runs as a process of its own, so that stopping the fleet stops a conversion at once. It
writes JSON lines to stdout: `{"done": N, "total": M}` per converted tensor, then
`{"path": DIR}` (exit 0) or `{"error": MESSAGE}` (exit 1).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence


def _emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    from fleetllm.engine.model_files import resolve_model

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        _emit({"error": "usage: python -m fleetllm.local.prepare MODEL"})
        return 2
    try:
        path = resolve_model(
            args[0], on_progress=lambda done, total: _emit({"done": done, "total": total})
        )
    except (ValueError, OSError) as exc:
        _emit({"error": str(exc)})
        return 1
    _emit({"path": str(path)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
