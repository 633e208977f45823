"""The fleet's contract: what the operator, the router, the local fleet, the engine and the
weights room all read, so that none of them imports another's internals.

- `deployment`: the LLMDeployment custom resource as pydantic models (the CRD is generated
  from them), with `scaling` and `status` beside it;
- `source`: a model source (`hf://`, `s3://`, `pvc://`, `builtin://`, `file://`), parsed once;
- `catalog`: the GPU types and model architectures the planner sizes against;
- `contract`: labels, child names, selectors and ports of the objects the operator renders;
- `manifests`: reading LLMDeployments from YAML with errors that name the field.
"""
