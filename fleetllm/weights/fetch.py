"""The files of a pull and their transfer: which files an engine needs, and HTTP GETs that
survive a cut connection (retries with backoff, downloads resumed with a Range request) and
verify what arrived (size, and sha256, git blob id or MD5 where the source lists one). Each
file is written to `NAME.part` and becomes `NAME` only once it checks out."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import http.client
import ipaddress
import logging
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("fleetllm.pull")

PARTIAL = ".part"
# Files an engine needs from a checkpoint folder; weights only as safetensors.
WANTED = (
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
)
CHUNK = 1 << 20
USER_AGENT = "fleetllm-model-pull"


class PullError(Exception):
    """A pull that cannot complete; the message says why and what to do."""


Headers = Callable[[str], dict[str, str]]
"""URL -> the authentication headers of a request to it."""


@dataclass(frozen=True)
class Settings:
    timeout: float = 60.0
    """Seconds any single network operation (connect, one read) may take."""
    attempts: int = 8
    """Tries per request before giving up (resuming where the last one stopped)."""
    backoff: float = 1.0
    """First pause between tries; doubles each time, at most 30 s."""
    progress_every: float = 5.0
    """Seconds between progress lines of one file."""
    read_only: bool = False
    """The folder is a cache filled beforehand: use it if complete, else fail (never write,
    never ask the source)."""


@dataclass(frozen=True)
class RemoteFile:
    name: str
    """Path inside the model folder."""
    url: str
    size: int | None
    checksum: tuple[str, str] | None = None
    """(kind, hex digest): sha256, git-sha1 (hash of `blob SIZE\\0` + content) or md5."""


@dataclass(frozen=True)
class Listing:
    revision: str
    """The commit (hub) or listing (S3) the files are fetched from."""
    files: tuple[RemoteFile, ...]
    headers: Headers = field(default=lambda _url: {})


def wanted(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, pattern) for pattern in WANTED)


class _HTTPError(PullError):
    def __init__(self, status: int, url: str, detail: str) -> None:
        super().__init__(f"GET {_redact(url)}: HTTP {status}: {detail[:300]}")
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.status in (408, 429) or self.status >= 500


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def _link_local(host: str) -> bool:
    """Whether `host` is, or resolves to, a link-local address (cloud metadata lives there)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_link_local
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # unresolvable: the request itself fails
    return any(ipaddress.ip_address(info[4][0].split("%")[0]).is_link_local for info in infos)


def check_redirect(origin: str, target: str) -> None:
    """A redirect may not downgrade (from an https source, https only) nor lead to a
    link-local address: the files land in a cache other models may share."""
    old, new = urllib.parse.urlsplit(origin), urllib.parse.urlsplit(target)
    refused = f"GET {_redact(origin)}: refused a redirect to {_redact(target)}"
    if new.scheme not in ("https", "http") or (old.scheme == "https" and new.scheme != "https"):
        raise PullError(f"{refused} (not https)")
    if _link_local(new.hostname or ""):
        raise PullError(f"{refused} (a link-local address)")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(
        self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any, newurl: str
    ) -> urllib.request.Request | None:
        check_redirect(req.full_url, newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_CheckedRedirects)


@contextlib.contextmanager
def _open(url: str, headers: dict[str, str], auth: dict[str, str], timeout: float) -> Iterator[Any]:
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **headers})
    # Credentials stay with this host: a redirect (the hub's CDN, a presigned URL) drops them.
    for name, value in auth.items():
        request.add_unredirected_header(name.capitalize(), value)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            yield response
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace") if exc.fp else str(exc.reason)
        raise _HTTPError(exc.code, url, detail) from None


def _retrying(what: str, settings: Settings, action: Callable[[], Any]) -> Any:
    delay = settings.backoff
    for attempt in range(1, settings.attempts + 1):
        try:
            return action()
        except _HTTPError as exc:
            if not exc.retryable or attempt == settings.attempts:
                raise
            error = str(exc)
        except (OSError, http.client.HTTPException) as exc:
            if attempt == settings.attempts:
                raise PullError(f"{what}: gave up after {attempt} tries: {exc}") from None
            error = f"{type(exc).__name__}: {exc}"
        log.warning("retrying", extra={"what": what, "try": attempt, "error": error})
        time.sleep(delay)
        delay = min(30.0, delay * 2)
    raise AssertionError("unreachable")


def get(url: str, headers: Headers, settings: Settings) -> bytes:
    """The body of one GET (an API answer), retried as a download is."""

    def fetch() -> bytes:
        with _open(url, {}, headers(url), settings.timeout) as response:
            return bytes(response.read())

    return bytes(_retrying(f"GET {_redact(url)}", settings, fetch))


def _hasher(checksum: tuple[str, str] | None, size: int | None) -> Any:
    if checksum is None:
        return None
    kind = checksum[0]
    if kind == "git-sha1":
        if size is None:
            return None
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"blob {size}\0".encode())
        return digest
    if kind == "md5":
        return hashlib.md5(usedforsecurity=False)
    return hashlib.sha256()


class _Progress:
    def __init__(self, name: str, total: int | None, start_bytes: int, every: float) -> None:
        self.name, self.total, self.every = name, total, every
        self.started = self.last = time.monotonic()
        self.start_bytes = start_bytes

    def update(self, done: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.every:
            return
        self.last = now
        elapsed = max(now - self.started, 1e-6)
        fields: dict[str, Any] = {
            "file": self.name,
            "bytes": done,
            "total": self.total,
            "mib_per_s": round((done - self.start_bytes) / elapsed / (1 << 20), 1),
        }
        if self.total:
            fields["percent"] = round(100 * done / self.total, 1)
        log.info("pulled" if final else "progress", extra=fields)


def download(file: RemoteFile, target: Path, headers: Headers, settings: Settings) -> None:
    """Fetch `file` to `target`, resuming `target.part`; verify, then rename into place."""
    part = target.with_name(target.name + PARTIAL)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if file.size is not None and have > file.size:
        part.unlink()
        have = 0
    digest = _hasher(file.checksum, file.size)
    if digest is not None and have:
        with part.open("rb") as existing:
            for block in iter(lambda: existing.read(CHUNK), b""):
                digest.update(block)
    progress = _Progress(file.name, file.size, have, settings.progress_every)

    def transfer() -> None:
        nonlocal have, digest
        if file.size is not None and have == file.size:
            return
        ranged = {"Range": f"bytes={have}-"} if have else {}
        if have:
            log.info("resuming", extra={"file": file.name, "from_bytes": have})
        with _open(file.url, ranged, headers(file.url), settings.timeout) as response:
            if have and response.status != 206:
                # The server ignored the range: start over.
                have = 0
                digest = _hasher(file.checksum, file.size)
            with part.open("r+b" if have else "wb") as out:
                out.seek(have)
                out.truncate()
                while block := response.read(CHUNK):
                    out.write(block)
                    have += len(block)
                    if digest is not None:
                        digest.update(block)
                    progress.update(have)
        if file.size is not None and have < file.size:
            raise http.client.IncompleteRead(b"", file.size - have)

    _retrying(f"GET {file.name}", settings, transfer)
    if file.size is not None and have != file.size:
        part.unlink()
        raise PullError(f"{file.name}: got {have} bytes, the source lists {file.size}")
    if digest is not None and file.checksum is not None:
        got = digest.hexdigest()
        if got != file.checksum[1]:
            part.unlink()
            raise PullError(
                f"{file.name}: checksum mismatch: expected {file.checksum[0]} "
                f"{file.checksum[1]}, got {got}; the partial file was removed (pull again)"
            )
    os.replace(part, target)
    progress.update(have, final=True)
