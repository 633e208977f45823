"""A rendered vLLM pod starts as Kubernetes runs it: the real vLLM process, as a uid with no
passwd entry (vLLM's image has none for the pod's uid 1000), with exactly the environment the
rendered pod spec gives its container, on a read-only root filesystem where only the pod's
writable volumes (its emptyDirs) can be written; it answers /health and a completion.

The pod is imitated with a private mount namespace (we are root): every filesystem is made
read-only, the engine container's volume mounts are bound at their mount paths (emptyDirs as
fresh writable folders, the model and the ConfigMap read-only), and the process drops to the
uid. The planned arguments are the rendered ones, with a free port, --enforce-eager (this
machine's CPU, not the pod's GPU, runs it; compiling would triple the start), a memory
fraction for a CPU shared with others and the CPU's block size.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from local_services import free_port
from tinymodels import write_tiny_chat_model
from vllm_tier import PROMISED

from fleetllm.api.deployment import LLMDeployment
from fleetllm.local.vllm import vllm_executable
from fleetllm.operator.render import render
from fleetllm.planner.plan import plan

START_SECONDS = 420
TINY = {
    "apiVersion": "fleetllm.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "tiny", "namespace": "default"},
    "spec": {
        # Sized as SmolLM2-135M (the tiny model speaks its tokenizer): the plan is a real one.
        "model": {
            "name": "tiny-chat",
            "source": "hf://fleetllm-tests/tiny-chat",
            "architecture": "SmolLM2-135M",
        },
        "gpu": {"type": "L4"},
        "engine": {"backend": "vllm", "drainSeconds": 5},
        "maxModelLen": 1024,
    },
}


def unnamed_uid() -> int:
    """The pod's uid where it has no name here, else the first one above it with none."""
    uid = 1000
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def rendered_pod() -> tuple[dict[str, Any], dict[str, Any]]:
    cr = LLMDeployment.model_validate(TINY)
    objects = render(cr, plan(cr.spec))
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    return deployment["spec"]["template"]["spec"], configmap


def python_exposure(python: Path, stash: Path) -> list[str]:
    """Bash that lets any user run `python` where a private folder holds it (a pyenv under
    /root): the folder is hidden under an empty tmpfs and only the way to Python bound back,
    as an image's Python is readable by everyone."""
    real = Path(os.path.realpath(python))
    closed = [p for p in reversed(real.parents) if not os.stat(p).st_mode & stat.S_IXOTH]
    if not closed:
        return []
    blocked = closed[0]
    child = blocked / real.relative_to(blocked).parts[0]
    b, c, s = (shlex.quote(str(p)) for p in (blocked, child, stash))
    return [
        f"mount --bind {c} {s}",
        f"mount -t tmpfs -o mode=755 tmpfs {b}",
        f"mkdir {c}",
        f"mount --bind {s} {c}",
    ]


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def sandbox_script(
    binds: list[tuple[Path, str, bool]],
    uid: int,
    command: list[str],
    exposure: list[str],
    image: Path,
) -> str:
    """Bash, run as root in a private mount namespace: bind each (source, mount path,
    writable), make every other filesystem read-only, then run `command` as `uid`. `image`
    (vLLM's environment, the image's own files) stays where it is, read-only, even under a
    mount path (a checkout under /tmp, where the pod mounts an emptyDir)."""
    lines = ["set -euo pipefail", *exposure]
    targets = [target for _, target, _ in binds]
    sources = [str(source) for source, _, _ in binds]
    # A mount path above other sources (/tmp, above pytest's folders) is bound last.
    hides = {t for t in targets if any(_under(s, t) for s in sources)}
    for source, target, writable in sorted(binds, key=lambda bind: bind[1] in hides):
        bind = "--bind"
        if _under(str(image), target):
            # Bound into the volume's folder first, where the bind below carries it along.
            inside = shlex.quote(str(source / Path(image).relative_to(target)))
            lines += [f"mkdir -p {inside}", f"mount --bind {shlex.quote(str(image))} {inside}"]
            bind = "--rbind"
        lines.append(f"mount {bind} {shlex.quote(str(source))} {shlex.quote(target)}")
        if not writable:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
    keep = " ".join(shlex.quote(t) for t in targets)
    lines.append(
        "awk '{print $2}' /proc/self/mounts | sort -u | while read -r mp; do "
        'case "$mp" in /proc*|/sys*|/dev*) continue;; esac; '
        f'for k in {keep}; do [ "$mp" = "$k" ] && continue 2; done; '
        'mount -o remount,bind,ro "$mp" || true; done'
    )
    lines.append(
        f"exec setpriv --reuid {uid} --regid {uid} --clear-groups "
        + " ".join(shlex.quote(part) for part in command)
    )
    return "\n".join(lines)


class Pod:
    """The engine container of the rendered pod, imitated; `run` starts a command in it."""

    def __init__(self, root: Path, python: Path) -> None:
        self.spec, configmap = rendered_pod()
        (self.container,) = self.spec["containers"]
        self.uid = unnamed_uid()
        self.python = python
        self.image = python.parent.parent  # vLLM's environment: what its image holds
        # What the kubelet gives the container: values as rendered, and the engine key read
        # from its Secret (a fresh one here, as the operator makes).
        self.key = secrets.token_urlsafe(32)
        self.env = {var["name"]: var.get("value", self.key) for var in self.container["env"]}
        assert [v["name"] for v in self.container["env"] if "value" not in v] == ["VLLM_API_KEY"]
        self.binds: list[tuple[Path, str, bool]] = []
        (root / "stash").mkdir()
        self.exposure = python_exposure(python, root / "stash")
        self.created: list[Path] = []
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        model = Path(self.container["args"][0])
        for mount in self.container["volumeMounts"]:
            volume = volumes[mount["name"]]
            source = root / mount["name"]
            source.mkdir()
            if "configMap" in volume:
                for key, text in configmap["data"].items():
                    (source / key).write_text(text)
            elif mount["name"] == "models":
                relative = model.relative_to(mount["mountPath"])
                # Heads of 64: vLLM's CPU attention has no kernel for the default tiny 16.
                write_tiny_chat_model(source / relative, hidden_size=128, num_attention_heads=2)
                # The pod's model-pull container, running as the same uid, wrote it.
                for path in [source, *source.rglob("*")]:
                    os.chown(path, self.uid, self.uid)
            else:
                assert "emptyDir" in volume, volume
                source.chmod(0o777)  # an emptyDir: writable by the pod's user
            self.binds.append(
                (source, mount["mountPath"], "emptyDir" in volume and not mount.get("readOnly"))
            )
            self._mount_point(Path(mount["mountPath"]))

    def _mount_point(self, path: Path) -> None:
        """Create the mount point (and the folders above it) where missing; `close` removes them."""
        missing = [p for p in [path, *path.parents] if not p.exists()]
        for folder in reversed(missing):
            folder.mkdir()
            self.created.append(folder)

    @property
    def writable(self) -> list[str]:
        return [target for _, target, writable in self.binds if writable]

    def run(self, command: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
        # The image gives PATH; the rendered env is everything else the process gets.
        wrapped = [
            "env",
            "-i",
            f"PATH={os.environ['PATH']}",
            *(f"{k}={v}" for k, v in env.items()),
            *command,
        ]
        script = sandbox_script(self.binds, self.uid, wrapped, self.exposure, self.image)
        return subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "bash", "-c", script],
            text=True,
            start_new_session=True,
            **kwargs,
        )

    def check(self, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        process = self.run(
            [str(self.python), "-c", code], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = process.communicate(timeout=120)
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def close(self) -> None:
        for folder in reversed(self.created):
            folder.rmdir()


@pytest.fixture(scope="module")
def pod(requires_vllm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        reason = "imitating the pod needs root, unshare and setpriv"
        if os.environ.get(PROMISED) == "1":
            pytest.fail(f"{PROMISED}=1 but {reason}")
        pytest.skip(reason)
    pod = Pod(tmp_path_factory.mktemp("pod"), requires_vllm)
    yield pod
    pod.close()


def test_the_uid_has_no_name_and_vllm_needs_the_rendered_user(pod: Pod) -> None:
    """The premise: as this uid, Python cannot name the user unless the env does."""
    code = "import getpass; print(getpass.getuser())"
    bare = pod.check(code, {})
    assert bare.returncode != 0 and "getpwuid(): uid not found" in bare.stderr
    named = pod.check(code, pod.env)
    assert named.returncode == 0, named.stderr
    assert named.stdout.strip() == pod.env["USER"]


def test_only_the_writable_volumes_can_be_written(pod: Pod) -> None:
    probes = [
        *pod.writable,
        "/",
        "/etc",
        "/var/tmp",
        str(Path.cwd()),
        str(pod.python.parent),
        "/var/cache",
    ]
    code = (
        "import json, os, sys, tempfile\n"
        "ok = {}\n"
        "for d in sys.argv[1:]:\n"
        "    try:\n"
        "        tempfile.NamedTemporaryFile(dir=d).close(); ok[d] = True\n"
        "    except OSError:\n"
        "        ok[d] = False\n"
        "print(json.dumps(ok))\n"
    )
    process = pod.run(
        [str(pod.python), "-c", code, *probes],
        pod.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert json.loads(out) == {d: d in pod.writable for d in probes}


def test_vllm_starts_and_answers_as_the_rendered_pod(pod: Pod, tmp_path: Path) -> None:
    port = free_port()
    assert pod.container["command"] == ["vllm", "serve"]
    model, *args = pod.container["args"]
    # On this machine's CPU: the planned GPU fraction would be of its memory (vLLM's CPU backend
    # reads it so; a tenth holds the tiny model), and vLLM's CPU attention takes blocks of 32
    # tokens only (the GPU plan's are 16).
    args += ["--port", str(port), "--enforce-eager", "--gpu-memory-utilization", "0.1"]
    args += ["--block-size", "32"]
    served = args[args.index("--served-model-name") + 1]
    # The rendered `vllm serve MODEL ...`, through vLLM's own CLI (the CPU build's console
    # script cannot find its distribution: see fleetllm.local.vllm).
    command = [*vllm_executable(pod.python), "serve", model, *args]
    log = tmp_path / "vllm.log"
    with log.open("w") as sink:
        process = pod.run(command, pod.env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_SECONDS
        while True:
            assert process.poll() is None, f"vLLM exited {process.returncode}: {excerpt(log)}"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"no /health: {excerpt(log)}"
            time.sleep(2)
        body = {"model": served, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        url = f"{base}/v1/completions"
        # The engine requires its key: the router's, never anyone else's.
        assert httpx.post(url, json=body, timeout=120).status_code == 401
        auth = {"Authorization": f"Bearer {pod.key}"}
        reply = httpx.post(url, json=body, headers=auth, timeout=120)
        assert reply.status_code == 200, reply.text
        (choice,) = reply.json()["choices"]
        assert choice["finish_reason"] in ("length", "stop")
        assert "getpwuid" not in log.read_text()
    finally:
        stop(process)


def excerpt(log: Path) -> str:
    """vLLM's errors (its workers' come first, far above the last lines) and its last lines."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [line for line in lines if " ERROR " in line or "Error:" in line]
    return "\n".join([*errors[:60], "...", *lines[-30:]])


def stop(process: subprocess.Popen[str]) -> None:
    """SIGTERM to the process group the test started (vLLM drains and exits), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
