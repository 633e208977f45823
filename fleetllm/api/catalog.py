"""What the planner sizes against: accelerator types and the architectures of common models.

Pure data and arithmetic, no I/O. Memory sizes are the totals the NVIDIA driver reports
(`nvidia-smi --query-gpu=memory.total`), because engines budget a fraction of exactly that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GKE_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
KARPENTER_GPU_NAME_LABEL = "karpenter.k8s.aws/instance-gpu-name"
KARPENTER_GPU_MEMORY_LABEL = "karpenter.k8s.aws/instance-gpu-memory"

# Which node labels say what GPU a node has, per kind of cluster:
# - none: no GPU label at all; pods ask for `nvidia.com/gpu` and land on any GPU node (the
#   default: it never keeps an autoscaler from bringing a node);
# - gfd: NVIDIA GPU Feature Discovery's `nvidia.com/gpu.product`, set only once a node runs;
# - gke: GKE's `cloud.google.com/gke-accelerator`, known before the node exists (Autopilot
#   and node auto-provisioning need it);
# - karpenter: EKS with Karpenter's `karpenter.k8s.aws/instance-gpu-name` (plus the GPU memory
#   where one name covers two cards), known before the node exists;
# - auto: no node selector, but a node that carries any of those labels must carry the
#   planned type's value (or no other catalog type's): a pod planned for an H100 never lands
#   on a labelled L4, while unlabelled nodes (and autoscalers' templates) stay eligible.
GPU_PROFILES = ("none", "gfd", "gke", "karpenter", "auto")


@dataclass(frozen=True)
class GPUType:
    """One accelerator type of the catalog (or `cpu`, for replicas without one)."""

    name: str
    memory_mib: int
    """Device memory; for `cpu` the default memory limit of a replica."""
    architecture: str
    compute_capability: tuple[int, int] | None
    product_label: str | None
    """The value GPU feature discovery puts in the `nvidia.com/gpu.product` node label."""
    gpu_class: str
    """The tuning class: engine settings are chosen per class, not per product."""
    gke_accelerator: str | None = None
    """The `cloud.google.com/gke-accelerator` value; None where GKE does not offer it."""
    karpenter_name: str | None = None
    """The `karpenter.k8s.aws/instance-gpu-name` value; None where EC2 does not offer it."""
    karpenter_memory: bool = False
    """Whether Karpenter needs the GPU memory label too (two cards share the name)."""

    @property
    def is_gpu(self) -> bool:
        return self.compute_capability is not None

    @property
    def supports_fp8(self) -> bool:
        # FP8 tensor cores arrived with Ada (8.9) and Hopper (9.0).
        return self.compute_capability is not None and self.compute_capability >= (8, 9)

    @property
    def supports_bf16(self) -> bool:
        # bfloat16 arrived with Ampere (8.0); Turing (T4) has float16 only.
        return self.compute_capability is not None and self.compute_capability >= (8, 0)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    def node_labels(self, profile: str) -> dict[str, str] | None:
        """The node selector that picks this GPU under `profile`: empty for `none` and for
        CPU replicas, None when the profile has no label for this type."""
        if profile not in GPU_PROFILES:
            raise ValueError(f"unknown GPU profile {profile!r}; one of {', '.join(GPU_PROFILES)}")
        if not self.is_gpu or profile in ("none", "auto"):
            return {}
        if profile == "gfd":
            return {GPU_PRODUCT_LABEL: self.product_label} if self.product_label else None
        if profile == "gke":
            return {GKE_ACCELERATOR_LABEL: self.gke_accelerator} if self.gke_accelerator else None
        if self.karpenter_name is None:
            return None
        labels = {KARPENTER_GPU_NAME_LABEL: self.karpenter_name}
        if self.karpenter_memory:
            labels[KARPENTER_GPU_MEMORY_LABEL] = str(self.memory_mib)
        return labels


GPU_TYPES: dict[str, GPUType] = {
    gpu.name: gpu
    for gpu in (
        GPUType("T4", 15109, "Turing", (7, 5), "Tesla-T4", "16g", "nvidia-tesla-t4", "t4"),
        GPUType("L4", 23034, "Ada", (8, 9), "NVIDIA-L4", "24g", "nvidia-l4", "l4"),
        GPUType("A10G", 23028, "Ampere", (8, 6), "NVIDIA-A10G", "24g", None, "a10g"),
        GPUType("RTX4090", 24564, "Ada", (8, 9), "NVIDIA-GeForce-RTX-4090", "24g"),
        GPUType(
            "A100-40GB",
            40960,
            "Ampere",
            (8, 0),
            "NVIDIA-A100-SXM4-40GB",
            "40g",
            "nvidia-tesla-a100",
            "a100",
            karpenter_memory=True,
        ),
        GPUType("L40S", 46068, "Ada", (8, 9), "NVIDIA-L40S", "48g", None, "l40s"),
        GPUType(
            "A100-80GB",
            81920,
            "Ampere",
            (8, 0),
            "NVIDIA-A100-SXM4-80GB",
            "80g",
            "nvidia-a100-80gb",
            "a100",
            karpenter_memory=True,
        ),
        GPUType(
            "H100-80GB",
            81559,
            "Hopper",
            (9, 0),
            "NVIDIA-H100-80GB-HBM3",
            "80g",
            "nvidia-h100-80gb",
            "h100",
        ),
        GPUType("H100-NVL", 95830, "Hopper", (9, 0), "NVIDIA-H100-NVL", "80g"),
        # Grace Hopper: the node is arm64 (images must be built for linux/arm64).
        GPUType("GH200", 97871, "Hopper", (9, 0), "NVIDIA-GH200-480GB", "80g"),
        GPUType(
            "H200", 143771, "Hopper", (9, 0), "NVIDIA-H200", "141g", "nvidia-h200-141gb", "h200"
        ),
        GPUType("B200", 183359, "Blackwell", (10, 0), "NVIDIA-B200", "180g", "nvidia-b200", "b200"),
        GPUType("cpu", 4096, "cpu", None, None, "cpu"),
    )
}


@dataclass(frozen=True)
class ModelArch:
    """The numbers of a decoder-only transformer that decide its memory footprint."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    intermediate_size: int | None = None
    tied_embeddings: bool = False
    qkv_bias: bool = False
    parameters: int | None = None
    """Total parameters when the architecture alone cannot tell (no intermediate size)."""
    aliases: tuple[str, ...] = ()
    """Lower-case name fragments that identify the model in a repository or file name."""

    def embedding_parameters(self) -> int:
        """Input embeddings plus an untied output head: weight-only quantizers keep these 16-bit."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def parameter_count(self) -> int:
        if self.intermediate_size is None:
            if self.parameters is None:
                raise ValueError(f"{self.name}: needs intermediate size or a parameter count")
            return self.parameters
        return self.linear_parameters() + self._other_parameters()

    def linear_parameters(self) -> int:
        """Parameters of the projection matrices (what awq/gptq/int8/fp8 quantize)."""
        if self.intermediate_size is None:
            return max(0, self.parameter_count() - self.embedding_parameters())
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp)

    def _other_parameters(self) -> int:
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        bias = (
            self.num_layers * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            if self.qkv_bias
            else 0
        )
        return self.embedding_parameters() + norms + bias


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    inter: int,
    *,
    head_dim: int = 128,
    vocab: int = 128256,
    max_pos: int = 131072,
    tied: bool = False,
    qkv_bias: bool = False,
    aliases: tuple[str, ...] = (),
) -> ModelArch:
    return ModelArch(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position=max_pos,
        intermediate_size=inter,
        tied_embeddings=tied,
        qkv_bias=qkv_bias,
        aliases=aliases or (name.lower(),),
    )


MODELS: dict[str, ModelArch] = {
    arch.name: arch
    for arch in (
        _llama("Llama-3.1-8B", 32, 4096, 32, 8, 14336),
        _llama("Llama-3.1-70B", 80, 8192, 64, 8, 28672),
        _llama("Llama-3.2-1B", 16, 2048, 32, 8, 8192, head_dim=64, tied=True),
        _llama("Llama-3.2-3B", 28, 3072, 24, 8, 8192, tied=True),
        # Qwen2.5's native context is 32K; longer needs YaRN scaling set by hand.
        _llama("Qwen2.5-7B", 28, 3584, 28, 4, 18944, vocab=152064, max_pos=32768, qkv_bias=True),
        _llama("Qwen2.5-14B", 48, 5120, 40, 8, 13824, vocab=152064, max_pos=32768, qkv_bias=True),
        _llama("Qwen2.5-72B", 80, 8192, 64, 8, 29568, vocab=152064, max_pos=32768, qkv_bias=True),
        _llama("Mistral-7B", 32, 4096, 32, 8, 14336, vocab=32768, max_pos=32768),
        _llama(
            "SmolLM2-135M", 30, 576, 9, 3, 1536, head_dim=64, vocab=49152, max_pos=8192, tied=True
        ),
        _llama(
            "SmolLM2-360M", 32, 960, 15, 5, 2560, head_dim=64, vocab=49152, max_pos=8192, tied=True
        ),
        _llama(
            "SmolLM2-1.7B",
            24,
            2048,
            32,
            32,
            8192,
            head_dim=64,
            vocab=49152,
            max_pos=8192,
            tied=True,
        ),
    )
}

BUILTIN_MODELS: dict[str, str] = {"smollm2-135m": "SmolLM2-135M"}
"""Models shipped with the engine image, by `builtin://` name -> catalog entry."""


def find_model(reference: str) -> ModelArch | None:
    """The catalog entry whose name appears in `reference` (a repository or path) as a whole
    word, so that `Qwen2.5-7B` never matches `Qwen2.5-72B-Instruct`."""
    text = reference.lower()
    for arch in MODELS.values():
        for alias in arch.aliases:
            if re.search(rf"(?<![a-z0-9.]){re.escape(alias)}(?![a-z0-9.])", text):
                return arch
    return None
