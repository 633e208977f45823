"""A request the router cannot parse (bare-LF line endings) is logged as one WARNING line with
its status and peer, rate-limited, never with its raw bytes (a key, a prompt), on a real
router process."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from router_testkit import write_fleet

SECRET = "sk-never-in-logs-0123456789"
PROMPT = "the-private-prompt-text"


def _send_raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)  # no half-close: the router answers, then closes the connection
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        return answer


def test_malformed_requests_become_one_rate_limited_warning(
    start_router: Any, tmp_path: Path
) -> None:
    fleet, keys = tmp_path / "fleet.json", tmp_path / "keys.txt"
    write_fleet(fleet, {"m": []})
    keys.write_text(SECRET + "\n")
    router = start_router("--fleet-file", str(fleet), "--api-keys-file", str(keys))
    body = json.dumps({"model": "m", "prompt": PROMPT}).encode()
    raw = (
        b"POST /v1/completions HTTP/1.1\nHost: x\n"
        + f"Authorization: Bearer {SECRET}\nContent-Length: {len(body)}\n\n".encode()
        + body
    )
    for _ in range(5):
        assert _send_raw(router.port, raw).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    router.stop()
    lines = [json.loads(line) for line in router.log_text().splitlines() if line.startswith("{")]
    refused = [line for line in lines if line["msg"] == "malformed HTTP request refused"]
    assert len(refused) == 1  # five in a row: one line, the rest counted in the next
    assert refused[0]["level"] == "warning"
    assert refused[0]["status"] == 400 and refused[0]["peer"] == "127.0.0.1"
    text = router.log_text()
    assert SECRET not in text and PROMPT not in text
    assert not [line for line in lines if line["level"] == "error"]
