"""fleetllm.kube logins that fail say why; which source wins."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubelogin import ExecPlugin, kubeconfig_for

from fleetllm.kube.login import LoginError, load_credentials


def test_login_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(LoginError, match="no kubeconfig at"):
        load_credentials(environ={"KUBECONFIG": str(tmp_path / "missing")})
    with pytest.raises(LoginError, match="Service token file does not exist"):
        load_credentials(
            service_account_dir=tmp_path,
            environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"},
        )
    broken = ExecPlugin(tmp_path / "plugin")  # no token issued: the plugin fails
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kubeconfig_for("https://10.0.0.1", broken.user))
    with pytest.raises(LoginError, match="exec credential plugin"):
        load_credentials(kubeconfig=kubeconfig)
    # $KUBECONFIG wins over a service account, as in controller-runtime.
    kubeconfig.write_text(kubeconfig_for("https://10.0.0.2"))
    env = {"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert load_credentials(service_account_dir=tmp_path, environ=env).server == (
        "https://10.0.0.2"
    )
