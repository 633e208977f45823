"""Preparing a model reports progress over all of a pull's files, in bytes."""

from __future__ import annotations

import json
import logging

import pytest

from fleetllm.local.prepare import PullProgress


def test_pull_progress_adds_up_the_files(capsys: pytest.CaptureFixture[str]) -> None:
    handler = PullProgress()
    log = logging.getLogger("test.pull-progress")
    log.propagate = False
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.info("pulling", extra={"bytes": 300, "files": 2})
    log.info("progress", extra={"file": "a", "bytes": 50})
    log.info("pulled", extra={"file": "a", "bytes": 100})
    log.info("progress", extra={"file": "b", "bytes": 120})
    log.info("pulled", extra={"file": "b", "bytes": 200})
    log.info("pull complete", extra={"bytes": 300})
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["done"], r["total"], r["unit"]) for r in lines] == [
        (0, 300, "bytes"),
        (50, 300, "bytes"),
        (100, 300, "bytes"),
        (220, 300, "bytes"),
        (300, 300, "bytes"),
    ]
