"""The GPU capacity planner: model + accelerator + quantization + parallelism -> a memory
budget and tuned engine arguments, or a refusal that says why and what would fit. Pure: no I/O.

- `plan`: `plan()` and the `Plan` it returns (what render and `fleetllm up` run);
- `memory`: the byte arithmetic (budget, weights, overhead, KV per token, capacity);
- `resolve`: the spec's GPU, architecture, dtype, memory and node labels;
- `checks`, `parallelism`, `extra_args`: the refusals, each with what would fit;
- `suggest`: the smallest changes that make a refused replica fit;
- `engine_argv`: the command lines of the builtin engine and of vLLM;
- `placement`: where a replica runs and so where it loads the weights from;
- `settings`: the facts about the cluster no LLMDeployment states;
- `timing`: how long a download and a load may take;
- `summary`: the plan as `fleetllm plan` and `fleetllm up` print it.
"""
