"""The cluster admin's policy over what an LLMDeployment may ask for (images, identities,
environment, Secrets, annotations, scheduling, resources). Pure logic: the operator, `fleetllm
render --policy` and the chart's ValidatingAdmissionPolicy apply the same rules."""
