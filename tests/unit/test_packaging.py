"""A regular install ships the whole package. The images run `pip install --no-deps .` on the
folders their Dockerfiles copy; the editable install of development finds any module in the
checkout, so a package missing from pyproject.toml's list only breaks the images (every engine
and control-plane container then dies at its first import)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What docker/*.Dockerfile copy into the build stage before `pip install .`.
COPIED = ("pyproject.toml", "README.md", "fleetllm", "engine", "operator", "router")


def _tracked(folder: str) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


def test_the_wheel_the_images_install_holds_every_module_and_data_file(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in COPIED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "--wheel-dir", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("fleetllm-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())

    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    expected = set()
    for package, folder in settings["package-dir"].items():
        for file in _tracked(folder):
            relative = Path(file).relative_to(folder).as_posix()
            expected.add(f"{package.replace('.', '/')}/{relative}")
    assert any(name.startswith("fleetllm/policy/") for name in expected)
    missing = sorted(expected - shipped)
    assert missing == [], f"not installed by `pip install .` (pyproject.toml packages): {missing}"
