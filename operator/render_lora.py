"""The pull Job of an hf:// or s3:// LoRA adapter: the engine pods' own model-pull container,
run once into the shared model cache, so that an adapter added while the replicas run reaches
them without a change to their pods (an init container runs only when a pod starts). Pure.

A Job is named after its LLMDeployment and a digest of what it pulls (source, revision,
folder): a new revision is a new Job, and an unchanged adapter keeps its finished one (a pull
of a complete folder is a no-op anyway). Its pod carries its own component label, never the
engine's selector, so it is no endpoint of the model's Service.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from fleetllm.api.contract import LABEL_COMPONENT, child_labels
from fleetllm.api.deployment import LLMDeployment
from fleetllm.api.lora import AdapterSpec
from fleetllm.operator.engine_pod import add_cluster_extras
from fleetllm.operator.render import POD_SECURITY, child_metadata, pull_container
from fleetllm.planner.placement import MODEL_CACHE_MOUNT
from fleetllm.planner.settings import OperatorConfig

COMPONENT = "adapter-pull"
LABEL_ADAPTER = "fleetllm.io/adapter"
PULL_DEADLINE_SECONDS = 3600
PULL_ATTEMPTS = 3


def pull_job_name(name: str, adapter: AdapterSpec, path: str) -> str:
    """At most 63 characters (a Job's name goes into its pods' labels)."""
    what = f"{adapter.model_source().uri}\n{path}".encode()
    return f"{name[:40]}-lora-{hashlib.sha256(what).hexdigest()[:12]}"


def pull_job_labels(cr: LLMDeployment, adapter: str) -> dict[str, str]:
    return {**child_labels(cr), LABEL_COMPONENT: COMPONENT, LABEL_ADAPTER: adapter}


def render_pull_job(
    cr: LLMDeployment, adapter: AdapterSpec, path: str, config: OperatorConfig
) -> dict[str, Any]:
    """The Job that pulls `adapter` into `path`, a folder of the model cache claim."""
    assert config.model_cache is not None, "adapters are pulled into the shared model cache"
    meta = child_metadata(cr, pull_job_name(cr.metadata.name, adapter, path))
    meta["labels"] = pull_job_labels(cr, adapter.name)
    container = pull_container(
        cr, config, image=config.images.model_pull, source=adapter.model_source().uri, dest=path
    )
    # The pull's last words (the reason it failed) become the pod's termination message.
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    claim: dict[str, Any] = {"claimName": config.model_cache.claim_name}
    if config.model_cache.read_only:
        claim["readOnly"] = True
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY),
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "containers": [container],
        "volumes": [
            {"name": "models", "persistentVolumeClaim": claim},
            {"name": "cache", "emptyDir": {"sizeLimit": "2Gi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }
    add_cluster_extras(pod, config)
    assert path.startswith(MODEL_CACHE_MOUNT + "/")
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": PULL_ATTEMPTS - 1,
            "activeDeadlineSeconds": PULL_DEADLINE_SECONDS,
            "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod},
        },
    }
