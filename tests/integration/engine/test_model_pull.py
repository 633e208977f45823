"""`fleetllm model pull` against local HTTP servers: one that serves a checkpoint in the Hugging
Face hub's layout (`/api/models/...`, `/{repo}/resolve/{commit}/...`, large files redirected to
a CDN host that must not see the token), and one that speaks S3's ListObjectsV2 and checks
Signature Version 4. Faults are injected: cut connections, a corrupted file."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import torch
from local_services import git_blob_sha1, serve_http
from tinymodels import float32_engine

from fleetllm.engine.loader import checkpoint_files
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.weights.fetch import PullError, Settings, check_redirect
from fleetllm.weights.pull import MARKER, pull
from fleetllm.weights.s3 import AwsCredentials, sigv4_headers

TOKEN = "hf_test_token"
REPO = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FAST = Settings(timeout=5.0, attempts=4, backoff=0.05, progress_every=0.0)
# Big files go through the "CDN" (the hub stores them with git LFS).
LFS_MIN_BYTES = 1024


@dataclass
class Hub:
    """What the fake hub serves and what it saw."""

    files: dict[str, bytes]
    corrupt: set[str] = field(default_factory=set)
    """Files served with their last byte flipped (the listed checksum stays the real one)."""
    cut_once: set[str] = field(default_factory=set)
    """Files whose first transfer breaks off halfway."""
    broken_api: bool = False
    """The API answers with an HTML page (a captive proxy, say)."""
    unhashed: set[str] = field(default_factory=set)
    """Files listed with their size only (no git blob id, no LFS sha256)."""
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    api_calls: int = 0
    url: str = ""
    cdn_url: str = ""

    def sibling(self, name: str) -> dict[str, Any]:
        data = self.files[name]
        entry: dict[str, Any] = {"rfilename": name, "size": len(data)}
        if name in self.unhashed:
            return entry
        entry["blobId"] = git_blob_sha1(data)
        if len(data) >= LFS_MIN_BYTES:
            sha = hashlib.sha256(data).hexdigest()
            entry["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 130}
        return entry


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            hub.requests.append((self.path, dict(self.headers)))
            path = urllib.parse.urlsplit(self.path).path
            cdn = path.startswith("/cdn/")
            if not cdn and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._send(401, b'{"error": "Invalid credentials"}')
                return
            if cdn and "Authorization" in self.headers:
                self._send(400, b"only one auth mechanism allowed")
                return
            api = f"/api/models/{REPO}/revision/"
            if path.startswith(api):
                hub.api_calls += 1
                if hub.broken_api:
                    self._send(200, b"<html>sign in</html>", {"Content-Type": "text/html"})
                    return
                body = {"id": REPO, "sha": COMMIT, "siblings": [hub.sibling(n) for n in hub.files]}
                body["siblings"].append({"rfilename": "original/consolidated.pth", "size": 10})
                self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                return
            resolve = f"/{REPO}/resolve/{COMMIT}/"
            if path.startswith(resolve):
                name = urllib.parse.unquote(path[len(resolve) :])
                if name not in hub.files:
                    self._send(404, b"Entry not found")
                    return
                if len(hub.files[name]) >= LFS_MIN_BYTES:
                    # Another host, as the hub's CDN is: the token must not follow.
                    location = f"{hub.cdn_url}/cdn/{urllib.parse.quote(name)}"
                    self._send(302, b"", {"Location": location})
                    return
                self._serve(name)
                return
            if cdn:
                self._serve(urllib.parse.unquote(path[len("/cdn/") :]))
                return
            self._send(404, b"not found")

        def _serve(self, name: str) -> None:
            data = hub.files[name]
            if name in hub.corrupt:
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            start = 0
            ranged = self.headers.get("Range")
            if ranged:
                start = int(ranged.removeprefix("bytes=").split("-")[0])
            body = data[start:]
            self.send_response(206 if ranged else 200)
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if name in hub.cut_once:
                hub.cut_once.discard(name)
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@pytest.fixture(scope="module")
def checkpoint(tiny_model: Callable[..., tuple[Path, torch.nn.Module]]) -> dict[str, bytes]:
    """A sharded tiny checkpoint (index + several safetensors files) and its config."""
    path, _ = tiny_model("llama-mha", max_shard_size="40KB")
    files = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
    assert sum(name.endswith(".safetensors") for name in files) >= 2
    return files


@pytest.fixture
def hub(checkpoint: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    state = Hub(files=dict(checkpoint))
    with serve_http(_handler(state)) as url:
        state.url = url
        state.cdn_url = url.replace("127.0.0.1", "localhost")
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield state


def _shards(hub: Hub) -> list[str]:
    return sorted(n for n in hub.files if n.endswith(".safetensors"))


def _messages(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict[str, Any]]]:
    standard = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}
    return [
        (r.getMessage(), {k: v for k, v in r.__dict__.items() if k not in standard})
        for r in caplog.records
        if r.name == "fleetllm.pull"
    ]


def test_pull_resumes_after_a_cut_connection_and_logs_progress(
    hub: Hub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fleetllm.pull")
    shard = _shards(hub)[0]
    hub.cut_once = {shard, "config.json"}  # one through the CDN, one served by the hub itself
    folder = tmp_path / "model"

    pull(f"hf://{REPO}", folder, FAST)

    for name, data in hub.files.items():
        assert (folder / name).read_bytes() == data, name
    assert not list(folder.glob("*.part"))
    assert not (folder / "original").exists()  # only what an engine loads
    # The second transfer of the cut file asked only for what was missing.
    ranges = [h.get("Range") for path, h in hub.requests if path.endswith(f"/cdn/{shard}")]
    size = len(hub.files[shard])
    assert ranges == [None, f"bytes={size // 2}-"]
    messages = _messages(caplog)
    assert ("resuming", {"file": shard, "from_bytes": size // 2}) in messages
    pulled = [f for m, f in messages if m == "pulled"]
    assert {f["file"] for f in pulled} == set(hub.files)
    assert all(f["bytes"] == f["total"] == len(hub.files[f["file"]]) for f in pulled)
    assert any(m == "progress" and f["file"] == shard for m, f in messages)
    assert any(m == "retrying" for m, _ in messages)
    marker = json.loads((folder / MARKER).read_text())
    assert marker["source"] == f"hf://{REPO}" and marker["commit"] == COMMIT
    # The token went to the hub, never to the CDN host.
    for path, headers in hub.requests:
        assert ("Authorization" in headers) == (not path.startswith("/cdn/")), path


def test_a_checksum_mismatch_fails_clearly_and_keeps_no_partial_file(
    hub: Hub, tmp_path: Path
) -> None:
    bad = _shards(hub)[-1]
    hub.corrupt = {bad, "config.json"}
    folder = tmp_path / "model"
    with pytest.raises(PullError) as info:
        pull(f"hf://{REPO}", folder, FAST)
    message = str(info.value)
    # config.json sorts first: a small file, verified by its git blob id.
    assert "config.json: checksum mismatch: expected git-sha1" in message
    hub.corrupt = {bad}
    with pytest.raises(
        PullError, match=rf"{bad}: checksum mismatch: expected sha256 [0-9a-f]{{64}}"
    ):
        pull(f"hf://{REPO}", folder, FAST)
    assert not (folder / bad).exists() and not (folder / f"{bad}.part").exists()
    assert not (folder / MARKER).exists()
    hub.corrupt = set()
    pull(f"hf://{REPO}", folder, FAST)
    assert (folder / bad).read_bytes() == hub.files[bad]


def test_a_complete_pull_is_reused_and_a_read_only_cache_never_touched(
    hub: Hub, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    pull(f"hf://{REPO}", folder, FAST)
    downloads = len([p for p, _ in hub.requests if "/resolve/" in p or "/cdn/" in p])

    # A branch: one metadata request, no download.
    pull(f"hf://{REPO}", folder, FAST)
    assert hub.api_calls == 2
    assert len([p for p, _ in hub.requests if "/resolve/" in p or "/cdn/" in p]) == downloads
    # A pinned commit the folder already holds: no request at all.
    pull(f"hf://{REPO}@{COMMIT}", folder, FAST)
    assert hub.api_calls == 2

    # A read-only cache filled beforehand: used as is, without asking the hub.
    read_only = dataclasses.replace(FAST, read_only=True)
    pull(f"hf://{REPO}", folder, read_only)
    assert hub.api_calls == 2
    with pytest.raises(PullError, match="read-only and does not hold"):
        pull(f"hf://{REPO}", tmp_path / "empty", read_only)
    assert not (tmp_path / "empty").exists()


def test_errors_are_clear(hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "wrong")
    with pytest.raises(PullError, match="HTTP 401"):
        pull(f"hf://{REPO}", tmp_path / "a", FAST)
    with pytest.raises(PullError, match="not an hf://"):
        pull("ftp://x/y", tmp_path / "b", FAST)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.broken_api = True
    with pytest.raises(PullError, match="unusable answer: JSONDecodeError"):
        pull(f"hf://{REPO}", tmp_path / "d", FAST)
    hub.broken_api = False
    hub.files = {"config.json": hub.files["config.json"]}
    with pytest.raises(PullError, match=r"no \*\.safetensors weights"):
        pull(f"hf://{REPO}", tmp_path / "c", FAST)


def test_the_engine_loads_what_the_cli_pulled(
    hub: Hub, checkpoint: dict[str, bytes], tmp_path: Path
) -> None:
    folder = tmp_path / "cache" / "hf" / REPO / "main"
    result = subprocess.run(
        [sys.executable, "-m", "fleetllm.cli", "model", "pull", f"hf://{REPO}", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN},
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert {line["msg"] for line in lines} >= {"pulling", "pulled", "pull complete"}
    assert all(TOKEN not in json.dumps(line) for line in lines)

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = []
    for model in (folder, tmp_path / "original"):
        if model.name == "original":
            model.mkdir()
            for name, data in checkpoint.items():
                (model / name).write_bytes(data)
        engine = float32_engine(model, num_kv_blocks=16, max_model_len=64)
        engine.add_request("r", [1, 2, 3, 4], params)
        while engine.has_unfinished_requests():
            done = engine.step()
        outputs.append(done[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


# -- S3 --------------------------------------------------------------------------------------


def test_sigv4_matches_awss_documented_example() -> None:
    """The GET Object example of AWS's Signature Version 4 documentation."""
    headers = sigv4_headers(
        "GET",
        "https://examplebucket.s3.amazonaws.com/test.txt",
        AwsCredentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
        "us-east-1",
        datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC),
        signed={"Range": "bytes=0-9"},
    )
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )


S3_KEYS = AwsCredentials("AKIDTEST", "secret/test+key", "session-token")


def _s3_handler(objects: dict[str, bytes], seen: list[str]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_: Any) -> None:
            pass

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            # Check the signature as S3 would: recompute it from what arrived.
            auth = self.headers.get("Authorization", "")
            when = datetime.datetime.strptime(self.headers["x-amz-date"], "%Y%m%dT%H%M%SZ")
            url = f"http://{self.headers['Host']}{self.path}"
            expected = sigv4_headers(
                "GET", url, S3_KEYS, "eu-west-1", when.replace(tzinfo=datetime.UTC)
            )
            if auth != expected["authorization"]:
                self._send(403, b"<Error><Code>SignatureDoesNotMatch</Code></Error>")
                return
            seen.append(self.path)
            parts = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(parts.query))
            if parts.path in {"/models", "/models/"}:
                prefix = query["prefix"]
                keys = sorted(k for k in objects if k.startswith(prefix))
                # Two pages, to follow continuation tokens.
                start = int(query.get("continuation-token", "0"))
                page = keys[start : start + 2]
                more = start + 2 < len(keys)
                items = "".join(
                    f"<Contents><Key>{k}</Key><Size>{len(objects[k])}</Size>"
                    f"<ETag>&quot;{hashlib.md5(objects[k], usedforsecurity=False).hexdigest()}"
                    "&quot;</ETag></Contents>"
                    for k in page
                )
                token = (
                    f"<NextContinuationToken>{start + 2}</NextContinuationToken>" if more else ""
                )
                body = (
                    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                    f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>{items}{token}"
                    "</ListBucketResult>"
                )
                self._send(200, body.encode())
                return
            key = urllib.parse.unquote(parts.path.removeprefix("/models/"))
            if key in objects:
                self._send(200, objects[key])
            else:
                self._send(404, b"<Error><Code>NoSuchKey</Code></Error>")

    return Handler


def test_s3_pull_lists_pages_signs_requests_and_verifies_md5(
    checkpoint: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = {f"llama/tiny/{name}": data for name, data in checkpoint.items()}
    objects["llama/tiny/sub/ignored.safetensors"] = b"x"
    seen: list[str] = []
    with serve_http(_s3_handler(objects, seen)) as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        monkeypatch.setenv("AWS_REGION", "eu-west-1")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEYS.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_KEYS.secret_key)
        monkeypatch.setenv("AWS_SESSION_TOKEN", S3_KEYS.token or "")
        folder = tmp_path / "s3model"
        pull("s3://models/llama/tiny", folder, FAST)
        for name, data in checkpoint.items():
            assert (folder / name).read_bytes() == data
        assert not (folder / "sub").exists()
        listings = [p for p in seen if "list-type=2" in p]
        assert len(listings) >= 2  # followed the continuation token
        # Pulled again: S3 sources are listings, so one is complete for good.
        before = len(seen)
        pull("s3://models/llama/tiny", folder, FAST)
        assert len(seen) == before

        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(PullError, match="HTTP 403"):
            pull("s3://models/llama/tiny", tmp_path / "other", FAST)


def test_a_folder_another_endpoint_filled_is_fetched_again_and_checked(
    hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A tenant's pull from its own hub (HF_ENDPOINT) fills the shared folder with other bytes
    # under the same repository, commit and sizes...
    planted = {
        name: (data[:-1] + bytes([data[-1] ^ 0xFF]) if name.endswith(".safetensors") else data)
        for name, data in hub.files.items()
    }
    folder = tmp_path / "shared"
    with serve_http(_handler(Hub(files=planted))) as evil:
        monkeypatch.setenv("HF_ENDPOINT", evil)
        pull(f"hf://{REPO}@{COMMIT}", folder, FAST)
    assert json.loads((folder / MARKER).read_text())["endpoint"] == evil
    # ...the next pull of that pinned commit, from the real hub, does not call it done: every
    # file is fetched again and checked against the real hub's hashes.
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    caplog.set_level(logging.INFO, logger="fleetllm.pull")
    pull(f"hf://{REPO}@{COMMIT}", folder, FAST)
    assert "already pulled" not in [m for m, _ in _messages(caplog)]
    for name, data in hub.files.items():
        assert (folder / name).read_bytes() == data, name
    assert json.loads((folder / MARKER).read_text())["endpoint"] == hub.url


def test_a_listing_without_a_files_hash_is_refused(hub: Hub, tmp_path: Path) -> None:
    # A size alone would let other bytes of that size through: no file is taken unchecked.
    hub.unhashed = {_shards(hub)[0]}
    with pytest.raises(PullError, match=f"the listing gives no hash of {_shards(hub)[0]}"):
        pull(f"hf://{REPO}", tmp_path / "m", FAST)
    assert not list((tmp_path / "m").glob("*.safetensors"))


def test_redirects_never_downgrade_nor_reach_link_local_addresses(hub: Hub, tmp_path: Path) -> None:
    check_redirect("https://hub.example/a", "https://cdn.example/a")
    check_redirect("http://127.0.0.1:1/a", "http://localhost:1/a")  # a plain-http mirror
    with pytest.raises(PullError, match="not https"):
        check_redirect("https://hub.example/a", "http://cdn.example/a")
    with pytest.raises(PullError, match="not https"):
        check_redirect("https://hub.example/a", "file:///etc/passwd")
    for target in ("https://169.254.169.254/latest", "https://[fe80::1]/x"):
        with pytest.raises(PullError, match="link-local"):
            check_redirect("https://hub.example/a", target)
    # The hub's redirect of a large file to cloud metadata: refused, nothing written.
    hub.cdn_url = "http://169.254.169.254:9"
    with pytest.raises(PullError, match="link-local"):
        pull(f"hf://{REPO}", tmp_path / "m", FAST)
    assert not list((tmp_path / "m").glob("*.safetensors"))


def test_an_index_naming_files_outside_the_folder_is_refused(hub: Hub, tmp_path: Path) -> None:
    index = json.loads(hub.files["model.safetensors.index.json"])
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../victim/model.safetensors"
    hub.files["model.safetensors.index.json"] = json.dumps(index).encode()
    folder = tmp_path / "m"
    with pytest.raises(PullError, match="names files that are not among this pull's"):
        pull(f"hf://{REPO}", folder, FAST)
    assert not (folder / MARKER).exists()  # never marked complete
    # The engine's loader refuses such an index too (a pvc:// folder is never pulled).
    with pytest.raises(ValueError, match="outside the model folder"):
        checkpoint_files(folder)


def test_an_s3_folder_from_another_endpoint_is_listed_again(
    checkpoint: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = {f"llama/tiny/{name}": data for name, data in checkpoint.items()}
    seen: list[str] = []
    with serve_http(_s3_handler(objects, seen)) as url:
        monkeypatch.setenv("AWS_REGION", "eu-west-1")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEYS.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_KEYS.secret_key)
        monkeypatch.setenv("AWS_SESSION_TOKEN", S3_KEYS.token or "")
        folder = tmp_path / "s3model"
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        pull("s3://models/llama/tiny", folder, FAST)
        before = len(seen)
        monkeypatch.setenv("AWS_ENDPOINT_URL", url.replace("127.0.0.1", "localhost"))
        pull("s3://models/llama/tiny", folder, FAST)
        assert any("list-type=2" in p for p in seen[before:])  # not skipped
