"""Discrete-event fleet simulator: fleetllm's autoscaling law against the laws of KubeAI, the
vLLM production stack's KEDA set-up and AIBrix's KPA, and a static fleet at maxReplicas.

Every law drives the same simulated fleet through the same traces (steady, diurnal, a 4x
burst, a spike after idle), and the run prints, per trace and law, the queue-time SLO
attainment (share of requests that waited less than targetQueueTimeSeconds from arrival to
their first scheduling, router hold included) and the replica-seconds paid (from a replica's
creation, start-up included, to its removal). Its last line is the burst trace:

    burst slo ours=0.xx kubeai=0.xx keda=0.xx kpa=0.xx replica_s ours=N kubeai=N keda=N kpa=N

Ours is the real law (`fleetllm.autoscale.law.Autoscaler`), fed `EngineSample`s exactly as
the operator feeds it. Deterministic for a seed.

The parts: autoscale_sim_fleet.py (the replica and the fleet, and where the replica's figures
come from), autoscale_sim_laws.py (ours and the baselines, each as its project documents it),
autoscale_sim_traffic.py (the traces); this file runs them and prints the report.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from collections import deque
from dataclasses import dataclass

from autoscale_sim_fleet import Fleet, Law, ReplicaModel
from autoscale_sim_laws import Keda, Kpa, KubeAI, Ours, Static
from autoscale_sim_traffic import Trace, replica_capacity, traces, workload

from fleetllm.api.scaling import ScalingSpec


@dataclass
class Result:
    slo: float
    replica_seconds: float
    mean_replicas: float
    p90_queue: float


def simulate(
    trace: Trace,
    law: Law,
    model: ReplicaModel,
    start: int,
    startup: float,
    hi: int,
    target_queue: float,
    seed: int,
) -> Result:
    requests = workload(trace, seed)
    fleet = Fleet(model, law, start, startup, hi, seed)
    arrivals = deque(requests)
    t_tick = 0.0
    end = trace.duration
    t = 0.0
    while True:
        next_event = fleet.events[0][0] if fleet.events else math.inf
        next_arrival = arrivals[0].arrival if arrivals else math.inf
        t = min(next_event, next_arrival, t_tick)
        busy = fleet.in_flight > 0 or arrivals
        if t == math.inf or (t > end and not busy):
            break
        if t == next_arrival:
            fleet.advance(t)
            fleet.arrive(t, arrivals.popleft())
        elif t == next_event:
            _, _, kind, replica = heapq.heappop(fleet.events)
            if kind == "ready" and replica is not None:
                fleet.became_ready(t, replica)
        else:
            fleet.advance(t)
            fleet.tick(t)
            t_tick += law.period
        if t > 10 * trace.duration:
            raise RuntimeError(f"{trace.name}/{law.name}: the fleet never drained")
    waits = sorted((r.admitted if r.admitted is not None else t) - r.arrival for r in requests)
    slo = sum(w < target_queue for w in waits) / max(1, len(waits))
    rs = fleet.replica_seconds(trace.duration)
    p90 = waits[int(0.9 * (len(waits) - 1))] if waits else 0.0
    return Result(slo, rs, rs / trace.duration, p90)


def measure() -> None:
    """Fit the replica model to our engine: decode step time against the batch, prefill speed
    (one thread, CPU time)."""
    import time

    import torch

    from fleetllm.engine.llm import LLM
    from fleetllm.engine.sampling_params import SamplingParams

    with open("/proc/cpuinfo") as cpuinfo:
        words = set(cpuinfo.read().split())
    flags = sorted(words & {"avx2", "avx512f", "avx512_bf16"})
    print(f"CPU flags: {' '.join(flags) or 'none of avx2/avx512f/avx512_bf16'}", flush=True)
    torch.set_num_threads(1)
    llm = LLM(
        "smollm2-135m",
        dtype="bfloat16",
        num_threads=1,
        max_num_seqs=32,
        num_kv_blocks=800,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)

    def run(batch: int, prompt: int, output: int) -> float:
        prompts = [[rng.randrange(1000, 40000) for _ in range(prompt)] for _ in range(batch)]
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0)
        started = time.process_time()
        llm.generate(prompts, params)
        return time.process_time() - started

    run(2, 64, 4)
    points = []
    for batch in (1, 8, 24):
        prefill = run(batch, 512, 1)
        decode = (run(batch, 512, 65) - prefill) / 64
        points.append((batch, decode))
        print(
            f"batch {batch}: prefill {batch * 512 / prefill:.0f} tokens/s, "
            f"decode step {decode * 1000:.1f} ms",
            flush=True,
        )
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    slope = sum((b - mean_b) * (s - mean_s) for b, s in points) / sum(
        (b - mean_b) ** 2 for b, _ in points
    )
    print(f"step time = {mean_s - slope * mean_b:.4f} + {slope:.5f} x batch seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup", type=float, default=60.0, help="replica start-up seconds")
    parser.add_argument("--max-replicas", type=int, default=10)
    parser.add_argument("--target-queue", type=float, default=1.0)
    parser.add_argument("--period", type=float, default=5.0, help="our law's period (s)")
    parser.add_argument(
        "--scale-down-delay",
        type=int,
        default=ScalingSpec.model_fields["scale_down_delay_seconds"].default,
        help="our scaleDownDelaySeconds (default: the CRD's)",
    )
    parser.add_argument("--measure", action="store_true", help="measure the replica model")
    args = parser.parse_args(argv)
    if args.measure:
        measure()
        return 0

    model = ReplicaModel()
    held, unit = replica_capacity(model)
    print(
        f"replica: {model.slots} slots, {model.kv_tokens} KV tokens, decode step "
        f"{model.step_base * 1000:.1f} + {model.step_per_seq * 1000:.2f} x batch ms, prefill "
        f"{model.prefill_tokens_per_s:.0f} tokens/s; holds ~{held:.1f} requests, "
        f"~{unit:.2f} requests/s at full load; start-up {args.startup:.0f}s"
    )
    hi = args.max_replicas
    results: dict[str, dict[str, Result]] = {}
    for trace in traces(unit):
        lo = trace.lo
        spec = ScalingSpec(
            min_replicas=lo,
            max_replicas=hi,
            target_kv_cache_usage=0.8,
            target_queue_time_seconds=args.target_queue,
            scale_down_delay_seconds=args.scale_down_delay,
            scale_to_zero_after_seconds=600 if lo == 0 else None,
        )
        laws: list[Law] = [
            Ours(spec, args.period, model.slots),
            KubeAI(lo, hi, 0.8 * held),
            Keda(lo, hi),
            Kpa(lo, hi, 0.8),
            Static(hi),
        ]
        print(f"\n{trace.name} ({trace.duration:.0f}s)")
        print(f"{'law':8} {'slo':>6} {'replica_s':>10} {'mean':>6} {'p90 queue':>10}")
        results[trace.name] = {}
        for law in laws:
            start = hi if isinstance(law, Static) else 1
            r = simulate(trace, law, model, start, args.startup, hi, args.target_queue, args.seed)
            results[trace.name][law.name] = r
            print(
                f"{law.name:8} {r.slo:6.3f} {r.replica_seconds:10.0f} "
                f"{r.mean_replicas:6.2f} {r.p90_queue:9.2f}s",
                flush=True,
            )
    burst = results["burst"]
    names = ("ours", "kubeai", "keda", "kpa")
    print(
        "burst slo "
        + " ".join(f"{n}={burst[n].slo:.2f}" for n in names)
        + " replica_s "
        + " ".join(f"{n}={burst[n].replica_seconds:.0f}" for n in names)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
