"""Where a kind's URLs live on the API server, and the kinds fleetllm reads and writes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resource:
    """One kind of object: where its URLs live."""

    api_version: str
    plural: str
    kind: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """Without a namespace, a namespaced resource's path spans all namespaces (lists and
        watches only)."""
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            prefix += f"/namespaces/{namespace}"
        elif self.namespaced and name is not None:
            raise ValueError(f"{self.kind} {name}: a namespace is needed")
        path = f"{prefix}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


CONFIGMAPS = Resource("v1", "configmaps", "ConfigMap")
SECRETS = Resource("v1", "secrets", "Secret")
SERVICES = Resource("v1", "services", "Service")
PODS = Resource("v1", "pods", "Pod")
PERSISTENTVOLUMECLAIMS = Resource("v1", "persistentvolumeclaims", "PersistentVolumeClaim")
EVENTS = Resource("v1", "events", "Event")
DEPLOYMENTS = Resource("apps/v1", "deployments", "Deployment")
JOBS = Resource("batch/v1", "jobs", "Job")
PODDISRUPTIONBUDGETS = Resource("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget")
NETWORKPOLICIES = Resource("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy")
ENDPOINTSLICES = Resource("discovery.k8s.io/v1", "endpointslices", "EndpointSlice")
HORIZONTALPODAUTOSCALERS = Resource(
    "autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler"
)
