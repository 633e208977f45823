"""The operator a rendered chart runs: its OperatorConfig, from the operator container's
command line, with the policy file it reads taken from the chart's policy ConfigMap."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from helmchart import by_kind

from fleetllm.cli import build_parser
from fleetllm.operator.cli import config_from_args
from fleetllm.planner.settings import OperatorConfig


def operator_config(objects: list[dict[str, Any]]) -> OperatorConfig:
    (deployment,) = [
        d
        for d in by_kind(objects, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    if args.policy:
        (policy,) = [
            c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-policy")
        ]
        path = Path(tempfile.mkdtemp(prefix="chart-policy-")) / "policy.yaml"
        path.write_text(policy["data"]["policy.yaml"])
        args.policy = str(path)
    return config_from_args(args)
