"""vLLM's own argument parser, asked from fleetllm's tests: one process of vLLM's Python
(vLLM must not be imported into fleetllm's environment) that reads a JSON argv a line and
answers a JSON line: what `vllm serve ARGS` would read, or its parser's refusal.

Run by vLLM's Python as a script (`python tests/vllm_parser.py`), it is that process; imported,
VllmParser talks to it. Only the standard library at the top: both Pythons import this file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


class VllmParser:
    """One long-lived process of vLLM's parser (importing vLLM takes seconds; a parse, none)."""

    def __init__(self, python: Path) -> None:
        self._process = subprocess.Popen(
            [str(python), __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.version: str = self._ask(None)["version"]

    def _ask(self, argv: list[str] | None) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(argv) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM's parser process exited ({self._process.wait()})")
        return json.loads(line)

    def parse(self, argv: list[str]) -> dict[str, Any]:
        """`{"args": {dest: value}}` (values as JSON; enums by name) or `{"error": message}`."""
        return self._ask(argv)

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=30)


def _serve() -> None:
    import os

    # Answers go to the real stdout; whatever vLLM prints or logs goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import __version__
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Raising(FlexibleArgumentParser):
        def error(self, message: str) -> Any:
            raise ValueError(message)

    def value(item: Any) -> Any:
        return getattr(item, "name", str(item))

    parser = make_arg_parser(Raising())
    for line in sys.stdin:
        argv = json.loads(line)
        if argv is None:
            answer: dict[str, Any] = {"version": __version__}
        else:
            try:
                namespace = parser.parse_args(argv)
                answer = {"args": json.loads(json.dumps(vars(namespace), default=value))}
            except SystemExit:
                answer = {"error": "exit (help)"}
            except Exception as exc:  # any refusal is an answer
                answer = {"error": str(exc) or type(exc).__name__}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
