"""The operator's configuration: facts about the cluster it manages that no LLMDeployment
states (`fleetllm operator run` flags; `fleetllm plan` and `render` take the same). The planner
and the renderer read them; `fleetllm up` plans with only cpu_bf16 set, from this machine's
CPU. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetllm.api.catalog import GPU_PROFILES
from fleetllm.images import DEFAULT_ENGINE_IMAGES, EngineImages
from fleetllm.planner.pod_settings import EnginePodSettings
from fleetllm.policy.model import DEFAULT_POLICY, Policy


@dataclass(frozen=True)
class ModelCache:
    """A PersistentVolumeClaim, present in every namespace that holds LLMDeployments, that
    keeps downloaded weights across restarts and replicas: each model is pulled into it once.
    It must be ReadWriteMany, or ReadOnlyMany and filled beforehand (`fleetllm model pull`)."""

    claim_name: str
    read_only: bool = False


@dataclass(frozen=True)
class OperatorConfig:
    gpu_profile: str = "auto"
    """Which node labels select a GPU type (catalog.GPU_PROFILES); an LLMDeployment's
    gpu.nodeSelectorProfile overrides it."""
    model_cache: ModelCache | None = None
    """Where hf:// and s3:// weights go; None: an emptyDir per pod, pulled on every start."""
    cpu_bf16: bool = False
    """The nodes of cpu replicas compute bfloat16 natively (AVX512-BF16 or AMX): dtype auto
    plans them in bfloat16, as the engine's auto picks there; otherwise in float32."""
    # Out of the hash (its lists are not hashable); equality still compares it.
    policy: Policy = field(default=DEFAULT_POLICY, hash=False)
    """The admin's policy (fleetllm.policy): what an LLMDeployment may ask for."""
    fleet_namespace: str = "fleetllm"
    """The namespace of the router and operator pods, the only ones the engines' NetworkPolicy
    lets in."""
    fleet_instance: str = "fleetllm"
    """Their app.kubernetes.io/instance label (the chart's release name)."""
    images: EngineImages = DEFAULT_ENGINE_IMAGES
    """The images of engine pods (a mirror's, when the cluster pulls from one)."""
    image_pull_secrets: tuple[str, ...] = ()
    """Secrets (in each model's namespace) with the credentials to pull those images."""
    pod: EnginePodSettings = field(default_factory=EnginePodSettings)
    """The cluster admin's settings of every engine pod (runtime class, /dev/shm, probes,
    rollout, extra env and volumes)."""

    def __post_init__(self) -> None:
        if self.gpu_profile not in GPU_PROFILES:
            raise ValueError(
                f"unknown GPU profile {self.gpu_profile!r}; one of {', '.join(GPU_PROFILES)}"
            )


DEFAULT_CONFIG = OperatorConfig()
