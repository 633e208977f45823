"""A model's files on the Hugging Face hub (`HF_ENDPOINT`, default huggingface.co; `HF_TOKEN`
for gated models). The revision is resolved to its commit first, and the files are listed at
that commit, so a folder never mixes two revisions."""

from __future__ import annotations

import json
import os
import re
import urllib.parse

from fleetllm.api.source import ModelSource
from fleetllm.weights.fetch import Headers, Listing, PullError, RemoteFile, Settings, get, wanted


def check_repository(source: ModelSource) -> None:
    """The hub names repositories ORG/NAME, of word characters, dots and dashes."""
    repo = source.location
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo) or ".." in repo:
        raise PullError(f"{source.uri!r}: expected hf://ORG/NAME[@REVISION]")


def _headers() -> Headers:
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    return (lambda _url: {"Authorization": f"Bearer {token}"}) if token else (lambda _url: {})


def endpoint() -> str:
    """The hub this pull asks (recorded in the folder's marker: another hub's files under the
    same repository name are other files)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def list_hf(source: ModelSource, settings: Settings) -> Listing:
    hub = endpoint()
    headers = _headers()
    repo, rev = source.location, source.revision or "main"
    url = f"{hub}/api/models/{repo}/revision/{urllib.parse.quote(rev, safe='')}?blobs=true"
    info = json.loads(get(url, headers, settings))
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
            # The hub lists a hash of every file: one without is not the hub's answer.
            raise PullError(f"{url}: the listing gives no hash of {name}")
        file_url = f"{hub}/{repo}/resolve/{commit}/{urllib.parse.quote(name)}"
        files.append(RemoteFile(name, file_url, int(size) if size is not None else None, checksum))
    return Listing(commit, tuple(files), headers)
