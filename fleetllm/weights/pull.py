"""`fleetllm model pull SOURCE DIR`: fetch a model's files into a folder the engines load.

Sources: `hf://org/name[@revision]` (`hub`) and `s3://bucket/prefix` (`s3`); `builtin://NAME`
is converted from its GGUF file (shipped in fleetllm's engine image) into the Hugging Face folder
vLLM loads (`builtin`); `pvc://...` is already where the engine looks, so there is nothing to do.

What is fetched: the top-level files an engine loads (config and tokenizer files,
`*.safetensors`), each verified as it arrives (`fetch`). `DIR/.fleetllm-pull.json` records a
complete pull: pulling the same source again is a no-op (one metadata request, or none for a
pinned commit or a read-only folder), which is what lets many replicas share one cache volume,
one pull at a time under a file lock. The marker names the source, its commit AND the endpoint
(hub or bucket URL) the files came from: a pull of the same name from another endpoint (a
tenant's HF_ENDPOINT, say) never counts the folder as its own, and fetches and checks every file
again instead. A sharded checkpoint's index may name only files of the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fleetllm.api.source import ModelSource
from fleetllm.weights import builtin
from fleetllm.weights.fetch import (
    Listing,
    PullError,
    RemoteFile,
    Settings,
    download,
    log,
    wanted,
)
from fleetllm.weights.hub import check_repository, endpoint, list_hf
from fleetllm.weights.s3 import bucket_url, check_bucket, list_s3

MARKER = ".fleetllm-pull.json"
LOCK = ".fleetllm-pull.lock"


def is_commit(revision: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def _parse(source: str) -> ModelSource:
    """`source` as a pull reads it: the fleet's model source, of a scheme a pod pulls or finds
    in place (a file:// path exists on one machine only), named as its store names things."""
    try:
        parsed = ModelSource.parse(source)
    except ValueError:
        parsed = None
    if parsed is None or parsed.scheme == "file":
        raise PullError(
            f"{source!r} is not an hf://ORG/NAME[@REVISION], s3://BUCKET[/PREFIX], pvc:// or "
            "builtin:// source"
        )
    if parsed.scheme == "hf":
        check_repository(parsed)
    elif parsed.scheme == "s3":
        check_bucket(parsed)
    return parsed


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


def _endpoint(source: ModelSource) -> str:
    return endpoint() if source.scheme == "hf" else bucket_url(source)


def _complete(marker: dict[str, Any] | None, canonical: str, where: str) -> bool:
    """Whether the marker records a complete pull of this source from this endpoint (a marker
    of an older release, without an endpoint, counts as another endpoint's)."""
    return (
        marker is not None and marker.get("source") == canonical and marker.get("endpoint") == where
    )


def check_index(folder: Path, names: set[str]) -> None:
    """A sharded checkpoint's index may name only top-level files of this pull: a name with a
    folder in it (`../`) would make the loader read outside the model."""
    for index in sorted(n for n in names if n.endswith(".index.json")):
        try:
            weight_map = json.loads((folder / index).read_text()).get("weight_map") or {}
            shards = {str(v) for v in weight_map.values()}
        except (OSError, ValueError, AttributeError) as exc:
            raise PullError(f"{index}: not a checkpoint index: {exc}") from None
        bad = sorted(s for s in shards if not wanted(s) or s not in names)
        if bad:
            raise PullError(f"{index} names files that are not among this pull's: {bad[:5]}")


def _entry(file: RemoteFile, size: int) -> dict[str, Any]:
    return {"size": size, "checksum": list(file.checksum) if file.checksum else None}


def pull(source: str, folder: Path, settings: Settings | None = None) -> Path:
    """Make `folder` hold the model of `source`; returns the folder."""
    settings = settings or Settings()
    parsed = _parse(source)
    if parsed.scheme == "builtin":
        return _pull_builtin(parsed, folder, settings)
    if not parsed.downloaded:
        log.info("nothing to pull", extra={"source": source})
        return folder
    # The marker names the repository or prefix; its revision and commit are recorded apart.
    canonical = parsed.model_copy(update={"revision": None}).uri
    revision = parsed.revision
    marker = _read_marker(folder)
    pinned = parsed.scheme == "s3" or (revision is not None and is_commit(revision))
    if _complete(marker, canonical, _endpoint(parsed)) and (
        (pinned and (parsed.scheme == "s3" or marker.get("commit") == revision))  # type: ignore[union-attr]
        or settings.read_only
    ):
        log.info("already pulled", extra={"source": source, "folder": str(folder)})
        return folder
    _check_writable(source, folder, settings)
    with _locked(folder):
        return _pull_locked(source, parsed, canonical, folder, settings)


def _check_writable(source: str, folder: Path, settings: Settings) -> None:
    if settings.read_only:
        raise PullError(
            f"{folder} is read-only and does not hold {source}: fill the cache beforehand "
            f"(`fleetllm model pull {source} {folder}` where it is writable)"
        )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One pull of `folder` at a time (replicas share the cache volume)."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / LOCK).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another pull of this folder", extra={"folder": str(folder)})
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write_marker(folder: Path, marker: dict[str, Any]) -> None:
    """Record a complete pull, last and atomically: a folder without it is never used."""
    tmp = folder / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(marker, indent=2, sort_keys=True))
    os.replace(tmp, folder / MARKER)


def _pull_builtin(parsed: ModelSource, folder: Path, settings: Settings) -> Path:
    """Convert a built-in model into `folder` unless it already holds this conversion."""
    source, made_of = parsed.uri, builtin.identity(parsed.location)

    def done() -> bool:
        marker = _read_marker(folder)
        return _complete(marker, source, builtin.ENDPOINT) and marker.get("commit") == made_of  # type: ignore[union-attr]

    if done():
        log.info("already pulled", extra={"source": source, "folder": str(folder)})
        return folder
    _check_writable(source, folder, settings)
    with _locked(folder):
        if done():  # another pod converted it while we waited
            return folder
        started = time.monotonic()
        log.info("converting", extra={"source": source, "folder": str(folder)})
        files = builtin.convert(parsed.location, folder)
        _write_marker(
            folder,
            {
                "source": source,
                "endpoint": builtin.ENDPOINT,
                "revision": "",
                "commit": made_of,
                "files": {name: {"size": size, "checksum": None} for name, size in files.items()},
            },
        )
        log.info(
            "pull complete",
            extra={
                "source": source,
                "bytes": sum(files.values()),
                "seconds": round(time.monotonic() - started, 1),
                "folder": str(folder),
            },
        )
    return folder


def _list(source: ModelSource, settings: Settings) -> Listing:
    try:
        if source.scheme == "hf":
            return list_hf(source, settings)
        return list_s3(source, settings)
    except PullError:
        raise
    except (ValueError, KeyError, TypeError, ET.ParseError, OSError) as exc:
        # An answer that is not the JSON or XML the API documents, or unreadable credentials.
        raise PullError(f"{source.uri}: unusable answer: {type(exc).__name__}: {exc}") from None


def _pull_locked(
    source: str, parsed: ModelSource, canonical: str, folder: Path, settings: Settings
) -> Path:
    marker = _read_marker(folder)  # another pod may have finished while we waited
    where = _endpoint(parsed)
    started = time.monotonic()
    try:
        listing = _list(parsed, settings)
    except PullError as exc:
        if _complete(marker, canonical, where):
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
    # Files of another endpoint's pull are never trusted, whatever their names and sizes.
    same_source = _complete(marker, canonical, where)
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
    check_index(folder, set(done))
    # Files of an earlier revision that this one lacks (stale shards would confuse a loader).
    for name in set(old) - set(done):
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    _write_marker(
        folder,
        {
            "source": canonical,
            "endpoint": where,
            "revision": parsed.revision or ("main" if parsed.scheme == "hf" else ""),
            "commit": listing.revision,
            "files": done,
        },
    )
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
