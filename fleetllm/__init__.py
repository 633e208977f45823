"""fleetllm: a Kubernetes operator, engine and router for multi-model LLM serving fleets."""

__version__ = "0.1.0"
