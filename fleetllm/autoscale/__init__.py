"""The autoscaling control law, on its own: engine samples over time -> desired replicas and a
reason. Pure: no I/O and no clock of its own, so the operator (`fleetllm.operator.scaler`), the
local fleet (`fleetllm.local.autoscaler`) and the simulator in benchmarks/ run the same law.

- `law`: `Autoscaler`, the law with its history for one LLMDeployment;
- `step`: what one step sees (`Observation`) and gives (`Load`, `Decision`);
- `settings`: `LawSettings`, the constants that are the same for every LLMDeployment;
- `histograms`: Prometheus histogram arithmetic (deltas between scrapes, sums, quantiles);
- `window`: the fleet's counter deltas over the queue-time window.
"""
