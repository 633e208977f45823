"""`fleetllm model pull SOURCE DIR`: fetch a model's files into a folder the engines load.

Sources:
- `hf://org/name[@revision]`: the Hugging Face hub (`HF_ENDPOINT`, default huggingface.co;
  `HF_TOKEN` for gated models). The revision is resolved to its commit first, and the files are
  fetched from that commit, so a folder never mixes two revisions.
- `s3://bucket/prefix`: S3 or a compatible store (`AWS_ENDPOINT_URL`), requests signed with
  Signature Version 4; credentials from `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`
  [`AWS_SESSION_TOKEN`], a web identity (`AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`, as EKS
  IRSA sets them), or the container credentials endpoint (EKS Pod Identity); unsigned when none.
- `pvc://...`, `builtin://...`: already where the engine looks; nothing to do.

What is fetched: the top-level files an engine loads (config and tokenizer files,
`*.safetensors`). Each file is written to `NAME.part` and resumed with an HTTP Range request
after a cut connection or a timeout; it becomes `NAME` only once its size and checksum match
what the source lists (sha256 for hub LFS files, the git blob id for small hub files, the MD5
ETag of single-part S3 uploads; size alone for multipart ones). A checksum mismatch deletes the
file and fails. `DIR/.fleetllm-pull.json` records a complete pull: pulling the same source again
is a no-op (one metadata request, or none for a pinned commit or a read-only folder), which is
what lets many replicas share one cache volume, one pull at a time under a file lock.

Only the standard library is used, so the control-plane image (no torch) runs it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import fnmatch
import hashlib
import hmac
import http.client
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("fleetllm.pull")

MARKER = ".fleetllm-pull.json"
LOCK = ".fleetllm-pull.lock"
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
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
USER_AGENT = "fleetllm-model-pull"


class PullError(Exception):
    """A pull that cannot complete; the message says why and what to do."""


Headers = Callable[[str], dict[str, str]]
"""URL -> the authentication headers of a request to it."""


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
    source: str
    revision: str
    """The commit (hub) or listing (S3) the files are fetched from."""
    files: tuple[RemoteFile, ...]
    headers: Headers = field(default=lambda _url: {})


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


# -- sources -------------------------------------------------------------------------------


def wanted(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, pattern) for pattern in WANTED)


def is_commit(revision: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def parse_source(source: str) -> tuple[str, str, str | None]:
    """(scheme, location, revision) of a model source."""
    scheme, sep, rest = source.partition("://")
    if not sep or not rest or scheme not in ("hf", "s3", "pvc", "builtin"):
        raise PullError(f"{source!r} is not an hf://, s3://, pvc:// or builtin:// source")
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo) or ".." in repo:
            raise PullError(f"{source!r}: expected hf://ORG/NAME[@REVISION]")
        return scheme, repo, revision or None
    if scheme == "s3":
        bucket = rest.split("/", 1)[0]
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise PullError(f"{source!r}: {bucket!r} is not an S3 bucket name")
    return scheme, rest, None


def _hf_headers() -> Headers:
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    return (lambda _url: {"Authorization": f"Bearer {token}"}) if token else (lambda _url: {})


def list_hf(repo: str, revision: str | None, settings: Settings) -> Listing:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    headers = _hf_headers()
    rev = revision or "main"
    url = f"{endpoint}/api/models/{repo}/revision/{urllib.parse.quote(rev, safe='')}?blobs=true"
    info = json.loads(_get(url, headers, settings))
    commit = str(info.get("sha") or rev)
    files = []
    for sibling in info.get("siblings") or []:
        name = str(sibling.get("rfilename", ""))
        if not wanted(name):
            continue
        lfs = sibling.get("lfs") or None
        if lfs:
            size, checksum = lfs.get("size"), ("sha256", str(lfs.get("sha256") or lfs.get("oid")))
        elif sibling.get("blobId"):
            size, checksum = sibling.get("size"), ("git-sha1", str(sibling["blobId"]))
        else:
            size, checksum = sibling.get("size"), None
        file_url = f"{endpoint}/{repo}/resolve/{commit}/{urllib.parse.quote(name)}"
        files.append(RemoteFile(name, file_url, int(size) if size is not None else None, checksum))
    return Listing(f"hf://{repo}", commit, tuple(files), headers)


@dataclass(frozen=True)
class AwsCredentials:
    access_key: str
    secret_key: str
    token: str | None = None


def sigv4_headers(
    method: str,
    url: str,
    credentials: AwsCredentials,
    region: str,
    now: datetime.datetime,
    *,
    service: str = "s3",
    signed: dict[str, str] | None = None,
) -> dict[str, str]:
    """The headers that authenticate one request with AWS Signature Version 4 (empty body).
    `signed`: more headers to send and sign (Range, say)."""
    parts = urllib.parse.urlsplit(url)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = {
        "host": parts.netloc,
        "x-amz-content-sha256": EMPTY_SHA256,
        "x-amz-date": amz_date,
        **{k.lower(): v.strip() for k, v in (signed or {}).items()},
    }
    if credentials.token:
        headers["x-amz-security-token"] = credentials.token
    names = sorted(headers)
    query = sorted(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    canonical = "\n".join(
        [
            method,
            urllib.parse.quote(urllib.parse.unquote(parts.path) or "/", safe="/~"),
            "&".join(f"{_uri(k)}={_uri(v)}" for k, v in query),
            "".join(f"{name}:{headers[name]}\n" for name in names),
            ";".join(names),
            EMPTY_SHA256,
        ]
    )
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = f"AWS4{credentials.secret_key}".encode()
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope},"
        f"SignedHeaders={';'.join(names)},Signature={signature}"
    )
    del headers["host"]  # the HTTP client sends it
    return headers


def _uri(value: str) -> str:
    return urllib.parse.quote(value, safe="-_.~")


def aws_credentials(region: str, settings: Settings) -> AwsCredentials | None:
    """From the environment, a web identity (IRSA) or the container endpoint (Pod Identity)."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return AwsCredentials(
            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN")
        )
    token_file, role = env.get("AWS_WEB_IDENTITY_TOKEN_FILE"), env.get("AWS_ROLE_ARN")
    if token_file and role:
        sts = env.get("AWS_ENDPOINT_URL_STS") or f"https://sts.{region}.amazonaws.com"
        query = urllib.parse.urlencode(
            {
                "Action": "AssumeRoleWithWebIdentity",
                "Version": "2011-06-15",
                "RoleArn": role,
                "RoleSessionName": env.get("AWS_ROLE_SESSION_NAME", "fleetllm-model-pull"),
                "WebIdentityToken": Path(token_file).read_text().strip(),
            }
        )
        root = ET.fromstring(_get(f"{sts.rstrip('/')}/?{query}", lambda _u: {}, settings))
        found = {el.tag.rsplit("}", 1)[-1]: (el.text or "") for el in root.iter()}
        return AwsCredentials(found["AccessKeyId"], found["SecretAccessKey"], found["SessionToken"])
    uri = env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    if uri:
        token = env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN", "")
        if env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"):
            token = Path(env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"]).read_text().strip()
        auth = {"Authorization": token} if token else {}
        doc = json.loads(_get(uri, lambda _u: auth, settings))
        return AwsCredentials(doc["AccessKeyId"], doc["SecretAccessKey"], doc.get("Token"))
    return None


def list_s3(location: str, settings: Settings) -> Listing:
    bucket, _, prefix = location.partition("/")
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        base = f"{endpoint.rstrip('/')}/{bucket}"  # path style, as compatible stores expect
    elif "." in bucket:
        base = f"https://s3.{region}.amazonaws.com/{bucket}"
    else:
        base = f"https://{bucket}.s3.{region}.amazonaws.com"
    credentials = aws_credentials(region, settings)

    def headers(url: str) -> dict[str, str]:
        if credentials is None:
            return {}
        now = datetime.datetime.now(datetime.UTC)
        return sigv4_headers("GET", url, credentials, region, now)

    files: list[RemoteFile] = []
    token: str | None = None
    while True:
        params = {"list-type": "2", "prefix": prefix}
        if token:
            params["continuation-token"] = token
        root = ET.fromstring(_get(f"{base}/?{urllib.parse.urlencode(params)}", headers, settings))
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        for item in root.iter(f"{ns}Contents"):
            key = item.findtext(f"{ns}Key") or ""
            name = key[len(prefix) :]
            if not wanted(name):
                continue
            etag = (item.findtext(f"{ns}ETag") or "").strip('"')
            # A multipart upload's ETag is no digest of the content: size alone then.
            checksum = ("md5", etag) if re.fullmatch(r"[0-9a-f]{32}", etag) else None
            size = int(item.findtext(f"{ns}Size") or 0)
            url = f"{base}/{urllib.parse.quote(key, safe='/~')}"
            files.append(RemoteFile(name, url, size, checksum))
        token = root.findtext(f"{ns}NextContinuationToken")
        if root.findtext(f"{ns}IsTruncated") != "true" or not token:
            break
    return Listing(f"s3://{location}", "", tuple(files), headers)


# -- transfers ------------------------------------------------------------------------------


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


_OPENER = urllib.request.build_opener()


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


def _get(url: str, headers: Headers, settings: Settings) -> bytes:
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


# -- the pull -------------------------------------------------------------------------------


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return None
    for name, entry in marker["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != entry.get("size", -1):
            return None
    return marker


def _complete(marker: dict[str, Any] | None, source: str) -> bool:
    return marker is not None and marker.get("source") == source


def _entry(file: RemoteFile, size: int) -> dict[str, Any]:
    return {"size": size, "checksum": list(file.checksum) if file.checksum else None}


def pull(source: str, folder: Path, settings: Settings | None = None) -> Path:
    """Make `folder` hold the model of `source`; returns the folder."""
    settings = settings or Settings()
    scheme, location, revision = parse_source(source)
    if scheme in ("pvc", "builtin"):
        log.info("nothing to pull", extra={"source": source})
        return folder
    canonical = f"hf://{location}" if scheme == "hf" else f"s3://{location}"
    marker = _read_marker(folder)
    pinned = scheme == "s3" or (revision is not None and is_commit(revision))
    if _complete(marker, canonical) and (
        (pinned and (scheme == "s3" or marker.get("commit") == revision))  # type: ignore[union-attr]
        or settings.read_only
    ):
        log.info("already pulled", extra={"source": source, "folder": str(folder)})
        return folder
    if settings.read_only:
        raise PullError(
            f"{folder} is read-only and does not hold {source}: fill the cache beforehand "
            f"(`fleetllm model pull {source} {folder}` where it is writable)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LOCK).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another pull of this folder", extra={"folder": str(folder)})
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _pull_locked(source, scheme, location, revision, canonical, folder, settings)


def _list(scheme: str, location: str, revision: str | None, settings: Settings) -> Listing:
    try:
        if scheme == "hf":
            return list_hf(location, revision, settings)
        return list_s3(location, settings)
    except PullError:
        raise
    except (ValueError, KeyError, TypeError, ET.ParseError, OSError) as exc:
        # An answer that is not the JSON or XML the API documents, or unreadable credentials.
        raise PullError(
            f"{scheme}://{location}: unusable answer: {type(exc).__name__}: {exc}"
        ) from None


def _pull_locked(
    source: str,
    scheme: str,
    location: str,
    revision: str | None,
    canonical: str,
    folder: Path,
    settings: Settings,
) -> Path:
    marker = _read_marker(folder)  # another pod may have finished while we waited
    started = time.monotonic()
    try:
        listing = _list(scheme, location, revision, settings)
    except PullError as exc:
        if _complete(marker, canonical):
            log.warning(
                "cannot reach the source; using the folder's complete earlier pull",
                extra={"source": source, "error": str(exc)},
            )
            return folder
        raise
    if not any(f.name.endswith(".safetensors") for f in listing.files):
        raise PullError(
            f"{source} has no *.safetensors weights at its top level (listed: "
            f"{', '.join(f.name for f in listing.files) or 'nothing'}); the engines load "
            "safetensors checkpoints"
        )
    old = (marker or {}).get("files") or {}
    same_source = _complete(marker, canonical)
    total = sum(f.size or 0 for f in listing.files)
    log.info(
        "pulling",
        extra={
            "source": source,
            "revision": listing.revision,
            "files": len(listing.files),
            "bytes": total,
            "folder": str(folder),
        },
    )
    done: dict[str, Any] = {}
    for file in listing.files:
        target = folder / file.name
        known = old.get(file.name) if same_source else None
        if (
            known is not None
            and target.is_file()
            and target.stat().st_size == file.size
            and known.get("checksum") == (list(file.checksum) if file.checksum else None)
        ):
            done[file.name] = known
            continue
        download(file, target, listing.headers, settings)
        done[file.name] = _entry(file, target.stat().st_size)
    # Files of an earlier revision that this one lacks (stale shards would confuse a loader).
    for name in set(old) - set(done):
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    tmp = folder / f"{MARKER}.tmp"
    tmp.write_text(
        json.dumps(
            {
                "source": canonical,
                "revision": revision or ("main" if scheme == "hf" else ""),
                "commit": listing.revision,
                "files": done,
            },
            indent=2,
            sort_keys=True,
        )
    )
    os.replace(tmp, folder / MARKER)
    log.info(
        "pull complete",
        extra={
            "source": source,
            "bytes": total,
            "seconds": round(time.monotonic() - started, 1),
            "folder": str(folder),
        },
    )
    return folder
