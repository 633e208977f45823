"""The LLMDeployments `fleetllm up` runs: read from manifests (or the built-in default),
checked for what one machine can serve, and planned as the operator plans them, placed on this
machine.

Every problem of every manifest is collected before anything starts, so that one run of
`fleetllm up` shows all of them; a refused plan reads exactly as `fleetllm plan` prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fleetllm.api.deployment import LLMDeployment, ModelConfig, PodSpec
from fleetllm.api.lora import AdapterSpec
from fleetllm.api.manifests import (
    format_validation_error,
    load_llmdeployments,
    parse_llmdeployment,
)
from fleetllm.api.source import ModelSource
from fleetllm.engine import cpu_features
from fleetllm.local.launch import LocalModel
from fleetllm.local.vllm import INSTALL_HINT, vllm_executable
from fleetllm.planner.errors import PlanError
from fleetllm.planner.placement import LocalPlacement
from fleetllm.planner.plan import plan
from fleetllm.planner.settings import OperatorConfig
from fleetllm.planner.summary import plan_summary

DEFAULT_MANIFEST: dict[str, Any] = {
    "apiVersion": "fleetllm.io/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "smollm2"},
    "spec": {
        "model": {"name": "smollm2-135m", "source": "builtin://smollm2-135m"},
        "gpu": {"type": "cpu"},
        "scaling": {"minReplicas": 1, "maxReplicas": 2},
    },
}
DEFAULT_WHERE = "the built-in default"

# The sources both backends load on this machine: hf:// and s3:// weights are pulled into the
# local cache first, as the operator's init container pulls them into a pod's, and a built-in
# model is converted there for vLLM; a pvc:// claim exists only in a cluster.
LOCAL_SOURCES = ("builtin", "file", "hf", "s3")
PULLED = "pulled"
"""The folder of the local cache that pulled weights go to."""


class FleetError(ValueError):
    """A fleet that cannot start; the message lists every reason."""


def default_deployment() -> LLMDeployment:
    """SmolLM2-135M-Instruct on the CPU, one replica, two under load."""
    return parse_llmdeployment(DEFAULT_MANIFEST, DEFAULT_WHERE)


def converted_folders(cache: Path) -> dict[str, str]:
    """Built-in name -> the Hugging Face folder its GGUF file is converted into in `cache`
    (what vLLM loads; the folder is made before the replicas start). Built-in models whose
    package is missing are left out: the planner then says so."""
    from fleetllm.engine.model_files import (
        BUILTIN_MODELS,
        ModelResolutionError,
        builtin_gguf,
        converted_dir_for,
    )

    folders = {}
    for name in BUILTIN_MODELS:
        try:
            folders[name] = str(converted_dir_for(builtin_gguf(name), cache))
        except ModelResolutionError:
            continue
    return folders


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """The planner's view of a Hugging Face `config.json`."""
    return ModelConfig(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"),
        vocab_size=config["vocab_size"],
        max_position_embeddings=config["max_position_embeddings"],
        intermediate_size=config.get("intermediate_size"),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _local_path(source: str, base: Path, field: str) -> Path:
    """A file:// source's path, absolute (a relative one is read from `base`)."""
    path = (base / Path(ModelSource.parse(source).location).expanduser()).resolve()
    if not path.exists():
        raise FleetError(f"{field} {source!r}: {path} does not exist")
    return path


def _localized(adapter: AdapterSpec, base: Path) -> AdapterSpec:
    if not adapter.source.startswith("file://"):
        return adapter
    path = _local_path(adapter.source, base, f"adapter {adapter.name}")
    return adapter.model_copy(update={"source": f"file://{path}"})


def localize(cr: LLMDeployment, base: Path) -> LLMDeployment:
    """file:// sources (the model's, the adapters') as absolute paths (relative ones are read
    from `base`, the manifest's folder); a local Hugging Face folder sizes the model by its
    config.json when the manifest names no architecture."""
    adapters = [_localized(adapter, base) for adapter in cr.spec.adapters]
    cr = cr.model_copy(update={"spec": cr.spec.model_copy(update={"adapters": adapters})})
    source = ModelSource.parse(cr.spec.model.source)
    if source.scheme != "file":
        return cr
    path = _local_path(cr.spec.model.source, base, "model.source")
    model = cr.spec.model.model_copy(update={"source": f"file://{path}"})
    config_file = path / "config.json"
    if model.config is None and model.architecture is None and config_file.is_file():
        try:
            model = model.model_copy(
                update={"config": model_config_from_hf(json.loads(config_file.read_text()))}
            )
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            detail = format_validation_error(exc) if isinstance(exc, ValidationError) else exc
            raise FleetError(
                f"{config_file}: cannot size the model from it ({detail}); give "
                "model.architecture or model.config"
            ) from None
    spec = cr.spec.model_copy(update={"model": model})
    return cr.model_copy(update={"spec": spec})


def _local_problems(cr: LLMDeployment, vllm: Path | None) -> list[str]:
    spec = cr.spec
    problems = []
    source = ModelSource.parse(spec.model.source)
    if source.scheme not in LOCAL_SOURCES:
        usable = ", ".join(f"{s}://" for s in LOCAL_SOURCES)
        problems.append(
            f"model.source {spec.model.source!r}: the {spec.engine.backend} engine cannot load "
            f"a {source.scheme}:// source on this machine (it loads {usable})"
        )
    if spec.engine.backend == "vllm" and vllm is None:
        problems.append(
            "engine.backend vllm runs vLLM's OpenAI server, which is not installed here: "
            f"{INSTALL_HINT}; or use engine.backend: builtin"
        )
    for adapter in spec.adapters:
        if adapter.source.startswith("pvc://"):
            problems.append(
                f"adapter {adapter.name}: {adapter.source} is a claim of a cluster; on this "
                "machine give a file:// path (or an hf:// or s3:// source, pulled here)"
            )
    for index, var in enumerate(spec.engine.env):
        if var.value_from is not None:
            problems.append(
                f"engine.env[{index}] ({var.name}): valueFrom reads a cluster's Secrets or "
                "ConfigMaps; give a value"
            )
    return problems


def local_notes(cr: LLMDeployment, grace_s: float) -> list[str]:
    """What of the spec only a cluster honours, each with what happens here instead: shown and
    logged when the fleet starts, never dropped in silence."""
    spec = cr.spec
    engine = spec.engine
    notes = []
    runs = "`fleetllm engine serve`" if engine.backend == "builtin" else "vLLM's `vllm serve`"
    for name, value in (
        ("engine.image", engine.image),
        ("engine.imagePullPolicy", engine.image_pull_policy),
    ):
        if value is not None:
            notes.append(f"{name} is for pods; the replicas run this environment's {runs}")
    if spec.gpu.node_selector_profile is not None:
        notes.append(
            "gpu.nodeSelectorProfile picks cluster nodes; the replicas run on this machine"
        )
    cpu = spec.gpu.type == "cpu"
    for name, value in spec.pod:
        alias = PodSpec.model_fields[name].alias or name
        if name == "resources" and value is not None:
            for part, quantities in (("requests", value.requests), ("limits", value.limits)):
                for key in quantities:
                    if (part, key, cpu) == ("limits", "memory", True):
                        notes.append(
                            "pod.resources.limits.memory sizes the KV cache as in a pod, but "
                            "nothing enforces it here"
                        )
                    else:
                        notes.append(f"pod.resources.{part}.{key} applies to pods only")
        elif value:
            notes.append(f"pod.{alias} applies to pods only")
    scaling = spec.scaling
    if scaling is not None and scaling.mode != "builtin":
        kind = "an HPA" if scaling.mode == "hpa" else "a KEDA ScaledObject"
        notes.append(
            f"scaling.mode {scaling.mode} makes {kind} in a cluster; here the builtin "
            "autoscaler scales between the same bounds on the same targets"
        )
    if "drain_seconds" in engine.model_fields_set and engine.drain_seconds > grace_s:
        notes.append(
            f"engine.drainSeconds {engine.drain_seconds} is longer than "
            f"--shutdown-grace-period {grace_s:g}: a scale-down drains a replica for up to "
            f"{engine.drain_seconds}s, but at shutdown open requests get {grace_s:g}s"
        )
    return notes


def load_fleet(
    paths: Sequence[Path],
    *,
    vllm: Path | None = None,
    cache: Path | None = None,
    cpu_bf16: bool | None = None,
) -> list[LocalModel]:
    """The planned models of the manifests in `paths` (the built-in default when empty).
    `vllm`: vLLM's Python (`find_vllm_python()`), None when it is not installed; `cache`: the
    model cache (default: the engine's); `cpu_bf16`: whether this machine's CPU computes
    bfloat16 natively, so that `dtype: auto` is planned as the engine's auto picks here
    (default: read from the CPU). Raises FleetError with every problem, and
    ValueError/FileNotFoundError for unreadable manifests."""
    from fleetllm.engine.model_files import cache_root

    cache = cache_root() if cache is None else cache
    config = OperatorConfig(cpu_bf16=cpu_features.native_bf16() if cpu_bf16 is None else cpu_bf16)
    placement = LocalPlacement(cache / PULLED, converted_folders(cache))
    found: list[tuple[LLMDeployment, str, Path]] = []
    if not paths:
        found.append((default_deployment(), DEFAULT_WHERE, Path.cwd()))
    for path in paths:
        for cr in load_llmdeployments(path):
            found.append((cr, str(path), path.resolve().parent))

    problems: list[str] = []
    seen_names: dict[str, str] = {}
    seen_models: dict[str, str] = {}
    models: list[LocalModel] = []
    for given, where, base in found:
        name, served = given.metadata.name, given.spec.model.name
        title = f"{where}: {name} (model {served})"
        if name in seen_names:
            problems.append(f"{title}: a second LLMDeployment named {name}")
            continue
        if served in seen_models:
            problems.append(
                f"{title}: model {served} is already served by {seen_models[served]}; give "
                "each LLMDeployment its own model.name"
            )
            continue
        seen_names[name] = where
        seen_models[served] = name
        try:
            cr = localize(given, base)
        except FleetError as exc:
            problems.append(f"{title}: {exc}")
            continue
        local = _local_problems(cr, vllm)
        problems += [f"{title}: {problem}" for problem in local]
        try:
            planned = plan(cr.spec, config, placement=placement)
        except PlanError as exc:
            problems.append(f"{where}: {plan_summary(cr, exc).rstrip()}")
            continue
        if not local:
            executable = (
                vllm_executable(vllm) if vllm is not None and cr.spec.engine.backend == "vllm"
                else (sys.executable, "-m", "fleetllm.cli")
            )  # fmt: skip
            adapters = {a.name: placement.adapter_path(a.model_source()) for a in cr.spec.adapters}
            models.append(LocalModel(cr, planned, where, executable, adapters))
    if problems:
        raise FleetError("\n".join(problems))
    return models


def local_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES entries: that variable's own list when it
    is set, else what nvidia-smi lists (none without it)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # CUDA stops at the first invalid entry; -1 is the usual way to hide every GPU.
        entries = [d.strip() for d in visible.split(",")]
        return entries[: entries.index("-1")] if "-1" in entries else [d for d in entries if d]
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listed.stdout.splitlines() if line.strip()]


def check_gpus(models: Sequence[LocalModel], gpus: int) -> None:
    """Refuse a fleet whose first replicas need more GPUs than the machine has (more
    replicas later wait for free GPUs)."""
    wanted = [(m, m.initial_replicas * m.devices_per_replica) for m in models]
    need = sum(count for _, count in wanted)
    if need > gpus:
        detail = ", ".join(
            f"{m.cr.metadata.name}: {m.initial_replicas} x {m.devices_per_replica} "
            f"{m.plan.gpu.name}"
            for m, count in wanted
            if count
        )
        raise FleetError(
            f"the first replicas need {need} GPUs ({detail}); this machine has {gpus} "
            "(CUDA_VISIBLE_DEVICES, else nvidia-smi)"
        )
