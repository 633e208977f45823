"""`python -m fleetllm.local.prepare SOURCE PATH [--resolve]`: get a model's weights ready on
this machine before its replicas start, so that they do not each wait on the work, and so
that the status view can show its progress:

- an hf:// or s3:// SOURCE is pulled into the folder PATH (`fleetllm model pull`, as the
  operator's init container pulls it into a pod);
- with `--resolve` (the builtin engine, and vLLM for a builtin:// SOURCE), PATH is resolved as
  the engine will: a GGUF file, such as the embedded default model's, is converted once into
  the cache (a builtin:// SOURCE into the folder `converted_dir_for` names, which vLLM loads).

It runs as a process of its own, so that stopping the fleet stops it at once. It writes JSON
lines to stdout: `{"done": N, "total": M, "unit": "bytes" | "tensors"}` as it goes, then
`{"path": DIR}` (exit 0) or `{"error": MESSAGE}` (exit 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path


def _emit(record: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


class PullProgress(logging.Handler):
    """The pull's log records (a total, then bytes per file) as progress over all files."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.finished = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        done = getattr(record, "bytes", None)
        if not isinstance(done, int):
            return
        if message == "pulling":
            self.total = done
            _emit({"done": 0, "total": done, "unit": "bytes"})
        elif message in ("progress", "pulled") and self.total:
            current = self.finished + done
            if message == "pulled":
                self.finished = current
            _emit({"done": min(current, self.total), "total": self.total, "unit": "bytes"})


def main(argv: Sequence[str] | None = None) -> int:
    from fleetllm.api.source import ModelSource
    from fleetllm.engine.model_files import resolve_model
    from fleetllm.weights.fetch import PullError
    from fleetllm.weights.pull import pull

    parser = argparse.ArgumentParser(prog="python -m fleetllm.local.prepare")
    parser.add_argument("source")
    parser.add_argument("path")
    parser.add_argument("--resolve", action="store_true")
    args = parser.parse_args(argv)
    try:
        path = Path(args.path)
        source = ModelSource.parse(args.source)
        if source.downloaded:
            pull_log = logging.getLogger("fleetllm.pull")
            pull_log.setLevel(logging.INFO)
            pull_log.addHandler(PullProgress())
            pull(args.source, path)
        if args.resolve:
            # A built-in model by its source: PATH may be the folder it is converted into.
            path = resolve_model(
                args.source if source.scheme == "builtin" else args.path,
                on_progress=lambda done, total: _emit(
                    {"done": done, "total": total, "unit": "tensors"}
                ),
            )
    except (ValueError, OSError, PullError) as exc:
        _emit({"error": str(exc)})
        return 1
    _emit({"path": str(path)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
