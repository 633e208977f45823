"""Credentials for the API server, through the configuration loaders of the `kubernetes`
package, so every way kubectl logs in works here too: the pod's service account in a cluster,
else a kubeconfig (tokens, client certificates, exec credential plugins as on EKS and GKE, auth
providers).

Credentials say when they are to be loaded again: shortly before they expire (the exec
plugin's `expirationTimestamp`), every minute in a cluster (the kubelet rotates the
service-account token file); `session` also loads them again whenever the server answers 401.
kopf gets the same credentials from `Credentials.connection_info()`.
"""

from __future__ import annotations

import datetime
import os
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import kopf

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# client-go reads the service-account token file again after a minute; so do we.
TOKEN_FILE_RELOAD_SECONDS = 60.0
# Credentials with an expiry are renewed this long before it.
EXPIRY_MARGIN_SECONDS = 30.0


class LoginError(ValueError):
    """No usable credentials: not in a cluster and no kubeconfig, or a broken one."""


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to authenticate to it, as loaded at one moment."""

    server: str
    scheme: str | None = None
    """Of the Authorization header: `Bearer` or `Basic`; None without one."""
    token: str | None = None
    ca_path: str | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None
    insecure: bool = False
    namespace: str | None = None
    """The service account's namespace in a cluster, else the kubeconfig context's."""
    in_cluster: bool = False
    expires_at: datetime.datetime | None = None
    """When the token stops working, where the login says so (exec plugins, auth providers)."""
    reload_at: float | None = None
    """Unix time after which the credentials are loaded again; None: only after a 401."""
    source: str = ""

    def authorization(self) -> str | None:
        if self.scheme and self.token:
            return f"{self.scheme} {self.token}"
        return None

    def stale(self, now: float | None = None) -> bool:
        return self.reload_at is not None and (now or time.time()) >= self.reload_at

    @cached_property
    def ssl_context(self) -> ssl.SSLContext | bool:
        """For aiohttp's `ssl=`: False skips verification (insecure-skip-tls-verify)."""
        if self.insecure:
            return False
        context = ssl.create_default_context(cafile=self.ca_path)
        if self.client_cert_path and self.client_key_path:
            context.load_cert_chain(self.client_cert_path, self.client_key_path)
        return context

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same credentials for kopf (its `@kopf.on.login` handler returns this)."""
        import kopf

        return kopf.ConnectionInfo(
            server=self.server,
            ca_path=self.ca_path,
            insecure=self.insecure or None,
            scheme=self.scheme,
            token=self.token,
            certificate_path=self.client_cert_path,
            private_key_path=self.client_key_path,
            default_namespace=self.namespace,
            expiration=self.expires_at,
        )


def load_credentials(
    *,
    kubeconfig: str | os.PathLike[str] | None = None,
    context: str | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    environ: Mapping[str, str] = os.environ,
) -> Credentials:
    """Credentials, looked for as controller-runtime does: the `kubeconfig` given, else
    $KUBECONFIG, else the pod's service account in a cluster, else ~/.kube/config.
    Blocking: an exec plugin may run."""
    from kubernetes.config import ConfigException

    try:
        path = kubeconfig or environ.get("KUBECONFIG")
        if not path and environ.get("KUBERNETES_SERVICE_HOST"):
            return _load_in_cluster(service_account_dir, environ)
        return _load_kubeconfig(os.fspath(path or "~/.kube/config"), context)
    except ConfigException as exc:
        raise LoginError(f"cannot log in to Kubernetes: {exc}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, LoginError):
            raise
        raise LoginError(f"cannot log in to Kubernetes: {type(exc).__name__}: {exc}") from None


def _load_in_cluster(directory: Path, environ: Mapping[str, str]) -> Credentials:
    from kubernetes.client import Configuration
    from kubernetes.config.incluster_config import InClusterConfigLoader

    config = Configuration()
    InClusterConfigLoader(
        token_filename=str(directory / "token"),
        cert_filename=str(directory / "ca.crt"),
        try_refresh_token=False,  # we load again ourselves, on our one session
        environ=dict(environ),
    ).load_and_set(config)
    try:
        namespace = (directory / "namespace").read_text().strip() or None
    except OSError:
        namespace = None
    return _from_configuration(
        config,
        namespace=namespace,
        in_cluster=True,
        expires_at=None,
        reload_at=time.time() + TOKEN_FILE_RELOAD_SECONDS,
        source=f"service account {directory}",
    )


def _load_kubeconfig(path: str, context: str | None) -> Credentials:
    from kubernetes.client import Configuration
    from kubernetes.config.kube_config import KubeConfigLoader, KubeConfigMerger

    merged = KubeConfigMerger(path)
    if merged.config is None:
        raise LoginError(
            f"cannot log in to Kubernetes: not in a cluster and no kubeconfig at {path} "
            "(set KUBECONFIG or run in a pod with a service account)"
        )
    loader = KubeConfigLoader(config_dict=merged.config, active_context=context)
    config = Configuration()
    loader.load_and_set(config)
    current = loader.current_context
    user = _kubeconfig_user(merged.config.value, current["context"].get("user"))
    if "exec" in user and not (config.api_key.get("BearerToken") or config.cert_file):
        # The loader logs the plugin's failure and carries on without credentials.
        raise LoginError(
            f"the exec credential plugin of kubeconfig user {current['context'].get('user')!r} "
            f"({user['exec'].get('command')}) gave no credentials; its error is logged above"
        )
    expiry: datetime.datetime | None = getattr(loader, "expiry", None)
    reload_at = None
    if expiry is not None:
        if expiry.tzinfo is None:
            expiry = expiry.replace(tzinfo=datetime.UTC)
        reload_at = expiry.timestamp() - EXPIRY_MARGIN_SECONDS
    return _from_configuration(
        config,
        namespace=current["context"].get("namespace"),
        in_cluster=False,
        expires_at=expiry,
        reload_at=reload_at,
        source=f"kubeconfig {path} context {current.get('name')!r}",
    )


def _kubeconfig_user(config: Mapping[str, Any], name: str | None) -> Mapping[str, Any]:
    for entry in config.get("users") or []:
        value = getattr(entry, "value", entry)  # the merger wraps entries in ConfigNodes
        if value.get("name") == name:
            return value.get("user") or {}
    return {}


def _from_configuration(
    config: Any,
    *,
    namespace: str | None,
    in_cluster: bool,
    expires_at: datetime.datetime | None,
    reload_at: float | None,
    source: str,
) -> Credentials:
    header = config.api_key.get("BearerToken") or ""
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer":
        scheme = "Bearer"
    return Credentials(
        server=str(config.host).rstrip("/"),
        scheme=scheme or None,
        token=token.strip() or None,
        ca_path=config.ssl_ca_cert or None,
        client_cert_path=config.cert_file or None,
        client_key_path=config.key_file or None,
        insecure=not config.verify_ssl,
        namespace=namespace,
        in_cluster=in_cluster,
        expires_at=expires_at,
        reload_at=reload_at,
        source=source,
    )
