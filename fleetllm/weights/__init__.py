"""A model's weights on their way to an engine: `fleetllm model pull` fetches an hf:// or s3://
source's files into a folder (the operator's init container into a pod's model cache, the
local fleet into its own cache), resumably and verified.

- `pull`: the pull of one source into one folder (complete-pull marker, lock, stale files);
- `hub`, `s3`: listing a source's files on the Hugging Face hub and on S3 (SigV4);
- `fetch`: the files to fetch, and HTTP transfers that resume, retry and verify;
- `cli`: the `fleetllm model pull` command.

Only the standard library (and the fleet's contract) is used, so that the control-plane image,
which has no torch, runs it.
"""
