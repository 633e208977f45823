"""Logins to the emulated API server: kubeconfigs, and an exec credential plugin that issues
the tokens a test sets, as cloud providers' plugins do."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any


def kubeconfig_for(server: str, user: dict[str, Any] | None = None) -> str:
    """A kubeconfig (YAML) with one context for `server` and the given user section."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emu", "cluster": {"server": server}}],
        "users": [{"name": "user", "user": user or {}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "user"}}],
        "current-context": "emu",
    }
    return json.dumps(doc)


EXEC_API_VERSION = "client.authentication.k8s.io/v1beta1"
_PLUGIN = """\
import json, pathlib, sys

token, runs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with runs.open("a") as f:
    f.write("run\\n")
status = {"token": token.read_text().strip()}
expiry = token.with_suffix(".expiry")
if expiry.exists():
    status["expirationTimestamp"] = expiry.read_text().strip()
print(json.dumps({"apiVersion": "%s", "kind": "ExecCredential", "status": status}))
"""


class ExecPlugin:
    """An exec credential plugin, as EKS's `aws eks get-token` or GKE's
    `gke-gcloud-auth-plugin`: a program that prints an ExecCredential with the token of the
    moment (`issue` sets it) and counts its runs."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.script = directory / "credential-plugin.py"
        self.script.write_text(_PLUGIN % EXEC_API_VERSION)
        self.token_file = directory / "token"
        self.runs_file = directory / "runs"
        self.runs_file.write_text("")

    def issue(self, token: str, expires: datetime.datetime | None = None) -> None:
        self.token_file.write_text(token)
        expiry = self.token_file.with_suffix(".expiry")
        if expires is None:
            expiry.unlink(missing_ok=True)
        else:
            expiry.write_text(expires.strftime("%Y-%m-%dT%H:%M:%SZ"))

    @property
    def runs(self) -> int:
        return len(self.runs_file.read_text().splitlines())

    @property
    def user(self) -> dict[str, Any]:
        """The kubeconfig user section that runs it."""
        return {
            "exec": {
                "apiVersion": EXEC_API_VERSION,
                "command": sys.executable,
                "args": [str(self.script), str(self.token_file), str(self.runs_file)],
                "interactiveMode": "Never",
            }
        }
