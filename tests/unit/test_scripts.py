"""The laptop path: the scripts the kind quickstart runs (setup.sh, kind-cluster.sh,
build-images.sh, kind-e2e.sh) hold nothing macOS's bash 3.2 or its BSD tools lack, and
build-images.sh runs (--dry-run) in POSIX mode under bash's 3.2 compatibility level. No bash 3.2
is at hand where the tests run: these are checks of the text and a run by a newer bash, not a
run by 3.2 itself. build-images.sh builds for a registry of the user's and loads into kind;
scripts/kube_tools.py uses the shipped helm and kubectl only where they run (Linux x86-64) and
the user's elsewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "scripts" / "build-images.sh"
LAPTOP_SCRIPTS = ("setup.sh", "kind-cluster.sh", "build-images.sh", "kind-e2e.sh")
sys.path.insert(0, str(ROOT / "scripts"))
import kube_tools  # noqa: E402

# What bash 3.2 (macOS's /bin/bash) does not have, or gets wrong under `set -u`.
BASH4_ONLY = {
    r"\bdeclare -A\b|\blocal -A\b": "associative arrays",
    r"\$\{\w+(,,|\^\^|,|\^)\}": "case conversion",
    r"\bmapfile\b|\breadarray\b": "mapfile",
    r"\w+=\(|\$\{\w+\[@\]\}": "arrays (an empty one is 'unbound' under set -u in bash 3.2)",
    r"\|&|&>>|;;&": "bash 4 operators",
    r"\$\{\w+@[QEPAa]\}": "parameter transformation",
    r"\b(declare|local|typeset) -[a-zA-Z]*[gn]": "declare -g / namerefs (4.2, 4.3)",
    r"\bcoproc\b|\bwait -n\b|\bshopt -s globstar\b": "coproc, wait -n, globstar",
    r"(\[\[|\[|\btest) -v\b": "test -v (4.2)",
    r"\{\w+\}[<>]": "a descriptor in a variable (4.1)",
    r"\$BASHPID|\$\{?EPOCH(SECONDS|REALTIME)": "BASHPID, EPOCHSECONDS",
}
# GNU tools' ways that macOS's BSD tools lack.
GNU_ONLY = {
    r"\b(sha\d+sum|md5sum)\b": "sha256sum and friends (macOS: shasum)",
    r"\bsed\b[^|;&]*\s-i\b": "sed -i (BSD sed wants a suffix argument)",
    r"\breadlink -f\b": "readlink -f",
    r"\bgrep\b[^|;&]*\s-[a-zA-Z]*P": "grep -P",
    r"\bdate\b[^|;&]*\s-d\b": "date -d",
    r"\bstat -c\b": "stat -c",
    r"\bxargs -[a-zA-Z]*r": "xargs -r",
}


def _build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "--posix", str(BUILD), "--dry-run", *args],
        capture_output=True, text=True, check=False, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "BASH_COMPAT": "32"},
    )  # fmt: skip


def _code(script: str) -> str:
    lines = (ROOT / "scripts" / script).read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("script", LAPTOP_SCRIPTS)
def test_the_laptop_scripts_use_nothing_bash_3_2_or_bsd_tools_lack(script: str) -> None:
    code = _code(script)
    found = {what for pattern, what in (BASH4_ONLY | GNU_ONLY).items() if re.search(pattern, code)}
    assert found == set(), script


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("declare -A seen", "associative arrays"),
        ('images=(a b); echo "${images[@]}"', "arrays"),
        ("want=$(cat f | sha256sum)", "sha256sum"),
        ("sed -i 's/a/b/' f", "sed -i"),
        ("[[ -v NAME ]] && echo set", "test -v"),
        ("mapfile -t lines < f", "mapfile"),
    ],
)
def test_the_portability_checks_catch_what_they_name(line: str, what: str) -> None:
    found = {w for pattern, w in (BASH4_ONLY | GNU_ONLY).items() if re.search(pattern, line)}
    assert any(what in w for w in found), found


def test_the_build_script_tags_for_the_users_registry_and_loads_into_docker() -> None:
    result = _build("--registry", "registry.example.com:5000/team", "--load")
    assert result.returncode == 0, result.stderr
    commands = result.stdout.splitlines()
    assert len(commands) == 4
    for command in commands:
        assert command.startswith("docker buildx build --load --file docker/")
        tag = command.split("--tag ", 1)[1].split()[0]
        assert tag.startswith("registry.example.com:5000/team/fleetllm/")
    assert any(c.endswith("/fleetllm/model-pull:1 .") for c in commands)


def test_the_build_script_builds_only_what_is_named_and_refuses_bad_use() -> None:
    only = _build(
        "--push", "--platform", "linux/amd64,linux/arm64", "ghcr.io/fleetllm/engine:0.1.0"
    )
    assert only.returncode == 0, only.stderr
    (command,) = only.stdout.splitlines()
    assert "--platform linux/amd64,linux/arm64 --push" in command
    for args, message in [
        (["--load", "--platform", "linux/amd64,linux/arm64"], "one platform"),
        (["--push", "--load"], "exclude each other"),
        (["ghcr.io/fleetllm/nothing:1"], "not built here"),
        (["--registry", "https://x"], "registry"),
        (["--bogus"], "usage"),
    ]:
        result = _build(*args)
        assert result.returncode == 2, args
        assert message in result.stderr, (args, result.stderr)


def test_the_shipped_binaries_are_only_used_where_they_run() -> None:
    assert kube_tools.shipped_binaries_run_here("Linux", "x86_64")
    for system, machine in [("Darwin", "arm64"), ("Darwin", "x86_64"), ("Linux", "aarch64")]:
        assert not kube_tools.shipped_binaries_run_here(system, machine)


def test_elsewhere_the_users_helm_and_kubectl_are_linked(tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv-bin"
    found = {"helm": "/opt/homebrew/bin/helm", "kubectl": "/usr/local/bin/kubectl"}
    chosen = kube_tools.sources(bin_dir, False, {"PATH": "x"}, lambda name, path: found[name])
    assert chosen == {name: Path(path) for name, path in found.items()}
    # $HELM wins everywhere; the shipped kubectl stays where it runs.
    chosen = kube_tools.sources(bin_dir, True, {"HELM": "/my/helm"}, lambda n, p: None)
    assert chosen == {"helm": Path("/my/helm"), "kubectl": None}
    with pytest.raises(SystemExit, match=r"kubectl: https://kubernetes\.io"):
        kube_tools.sources(
            bin_dir, False, {"PATH": "x"}, lambda n, p: found.get(n) if n == "helm" else None
        )


def test_the_venv_link_itself_is_not_taken_for_the_users_binary(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    seen: list[str] = []
    kube_tools.sources(
        bin_dir, False, {"PATH": f"{bin_dir}:/usr/bin"}, lambda n, p: seen.append(p) or "/usr/bin/x"
    )
    assert seen == ["/usr/bin", "/usr/bin"]
