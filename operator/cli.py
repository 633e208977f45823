"""`fleetllm plan | render | crds | operator run`."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

import yaml

from fleetllm.api.catalog import GPU_PROFILES
from fleetllm.api.contract import ENGINE_KEY_ROOT_ENV
from fleetllm.api.deployment import NAME_PATTERN, LLMDeployment
from fleetllm.api.manifests import load_llmdeployments
from fleetllm.operator.admission import new_key_secret, review
from fleetllm.operator.cluster_args import add_image_arguments, cluster_settings_from_args
from fleetllm.operator.crd import crd_yaml, reference_markdown
from fleetllm.operator.render import render
from fleetllm.planner.errors import PlanError
from fleetllm.planner.plan import Plan, plan
from fleetllm.planner.settings import ModelCache, OperatorConfig
from fleetllm.planner.summary import plan_summary
from fleetllm.policy.model import DEFAULT_POLICY, load_policy


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings (ConfigMap contents) as readable `|` blocks."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _str_representer)


def dump_yaml_documents(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_LiteralDumper, sort_keys=False, width=100)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's configuration (config.OperatorConfig), the same for plan, render and
    operator run."""
    g = parser.add_argument_group("cluster")
    g.add_argument(
        "--gpu-profile",
        choices=GPU_PROFILES,
        default="auto",
        help="node labels that select a GPU type: auto (the default: no selector, but a node "
        "labelled with another GPU type is avoided), none (only nvidia.com/gpu requests), "
        "gfd (nvidia.com/gpu.product), gke (cloud.google.com/gke-accelerator), "
        "karpenter (karpenter.k8s.aws/instance-gpu-name)",
    )
    g.add_argument(
        "--cpu-bf16",
        action="store_true",
        help="the nodes of cpu replicas compute bfloat16 natively (AVX512-BF16 or AMX): "
        "plan dtype auto in bfloat16 there (default: float32)",
    )
    g.add_argument(
        "--model-cache-claim",
        metavar="CLAIM",
        help="a ReadWriteMany PVC (in each model's namespace) that keeps downloaded weights: "
        "each model is pulled into it once; default: an emptyDir per pod",
    )
    g.add_argument(
        "--model-cache-read-only",
        action="store_true",
        help="the cache claim is ReadOnlyMany, filled beforehand with `fleetllm model pull`",
    )
    g.add_argument(
        "--policy",
        metavar="FILE",
        help="the admin's policy (YAML; docs/security.md lists its fields); default: the "
        "built-in safe defaults",
    )
    g.add_argument(
        "--fleet-namespace",
        default="fleetllm",
        help="namespace of the router and operator pods, the only ones the engines' "
        "NetworkPolicy lets in (default: %(default)s)",
    )
    g.add_argument(
        "--fleet-instance",
        default="fleetllm",
        help="their app.kubernetes.io/instance label, the chart's release name "
        "(default: %(default)s)",
    )
    add_image_arguments(parser)


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    claim = args.model_cache_claim
    cache = None
    if claim is None:
        if args.model_cache_read_only:
            raise ValueError("--model-cache-read-only needs --model-cache-claim")
    elif not re.match(NAME_PATTERN, claim) or len(claim) > 253:
        raise ValueError(f"--model-cache-claim {claim!r} is not a valid claim name")
    else:
        cache = ModelCache(claim, read_only=args.model_cache_read_only)
    fleet = {"--fleet-namespace": args.fleet_namespace, "--fleet-instance": args.fleet_instance}
    for flag, value in fleet.items():
        if not re.match(NAME_PATTERN, value) or len(value) > 63:
            raise ValueError(f"{flag} {value!r} is not a valid name")
    return OperatorConfig(
        gpu_profile=args.gpu_profile,
        cpu_bf16=args.cpu_bf16,
        model_cache=cache,
        policy=load_policy(args.policy) if args.policy else DEFAULT_POLICY,
        fleet_namespace=args.fleet_namespace,
        fleet_instance=args.fleet_instance,
        **cluster_settings_from_args(args),
    )


def register(sub: argparse._SubParsersAction) -> None:
    p_plan = sub.add_parser(
        "plan",
        help="plan GPU memory and engine settings of LLMDeployments",
        description="Size weights and KV cache of each LLMDeployment in FILE on its GPUs and "
        "print the tuned engine settings, or why it does not fit. Exit 1 if any is refused.",
    )
    p_plan.add_argument("-f", "--filename", required=True, help="YAML file of LLMDeployments")
    p_plan.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")
    add_config_arguments(p_plan)
    p_plan.set_defaults(func=cmd_plan)

    p_render = sub.add_parser(
        "render",
        help="print the Kubernetes objects of LLMDeployments",
        description="Print, as multi-document YAML, the objects the operator would apply for "
        "each LLMDeployment in FILE. No cluster is needed.",
    )
    p_render.add_argument("-f", "--filename", required=True, help="YAML file of LLMDeployments")
    add_config_arguments(p_render)
    p_render.set_defaults(func=cmd_render)

    p_crds = sub.add_parser("crds", help="print the LLMDeployment CustomResourceDefinition")
    p_crds.add_argument(
        "--reference", action="store_true", help="print the field reference (Markdown) instead"
    )
    p_crds.set_defaults(func=cmd_crds)

    p_op = sub.add_parser("operator", help="the Kubernetes operator")
    op_sub = p_op.add_subparsers(dest="operator_command", required=True, metavar="COMMAND")
    p_run = op_sub.add_parser(
        "run",
        help="reconcile LLMDeployments in a cluster",
        description="Watch LLMDeployments and keep their engine Deployments, Services, "
        "ConfigMaps and PodDisruptionBudgets in line with the plan. Credentials come from "
        "$KUBECONFIG, else the pod's service account, else ~/.kube/config (exec credential "
        "plugins included).",
    )
    scope = p_run.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        help="namespace to serve (repeatable; globs allowed)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve every namespace")
    p_run.add_argument(
        "--standalone",
        action="store_true",
        help="run without peering (only safe with a single operator replica)",
    )
    p_run.add_argument(
        "--peering",
        default="fleetllm",
        help="peering object for leader election (default: %(default)s)",
    )
    p_run.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; the highest live one acts (default: random)",
    )
    p_run.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    p_run.add_argument(
        "--autoscale-interval",
        type=_positive_seconds,
        default=5.0,
        metavar="SECONDS",
        help="how often the autoscaler steps each LLMDeployment with spec.scaling.mode builtin "
        "(default: %(default)s)",
    )
    p_run.add_argument(
        "--resync-interval",
        type=_positive_seconds,
        default=300.0,
        metavar="SECONDS",
        help="how often every LLMDeployment is reconciled whatever happened, so that nothing "
        "missed (an update during an API outage) stays unapplied (default: %(default)s)",
    )
    add_config_arguments(p_run)
    p_run.add_argument("--log-format", choices=["json", "plain"], default="json")
    p_run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p_run.set_defaults(func=cmd_operator_run)


def _plan_all(path: str, config: OperatorConfig) -> list[tuple[LLMDeployment, Plan | PlanError]]:
    results: list[tuple[LLMDeployment, Plan | PlanError]] = []
    for cr in load_llmdeployments(path):
        try:
            results.append((cr, plan(cr.spec, config)))
        except PlanError as exc:
            results.append((cr, exc))
    return results


def _plan_record(cr: LLMDeployment, result: Plan | PlanError) -> dict[str, Any]:
    record: dict[str, Any] = {"name": cr.metadata.name, "model": cr.spec.model.name}
    if isinstance(result, PlanError):
        record |= {
            "planned": False,
            "reason": result.reason,
            "message": result.message,
            "suggestions": list(result.suggestions),
        }
    else:
        record |= {
            "planned": True,
            "architecture": result.arch.name,
            "plan": result.status.model_dump(by_alias=True),
            "command": list(result.command),
        }
    return record


def cmd_plan(args: argparse.Namespace) -> int:
    results = _plan_all(args.filename, config_from_args(args))
    if args.output == "table":
        sys.stdout.write("\n".join(plan_summary(cr, result) for cr, result in results))
    else:
        records = [_plan_record(cr, result) for cr, result in results]
        if args.output == "json":
            sys.stdout.write(json.dumps(records, indent=2) + "\n")
        else:
            sys.stdout.write(yaml.safe_dump(records, sort_keys=False, width=100))
    return 1 if any(isinstance(result, PlanError) for _, result in results) else 0


def _admitted(path: str, cr: LLMDeployment, result: Plan, config: OperatorConfig) -> bool:
    """Whether the policy admits it; each refused field on stderr, and what only the cluster
    can tell (a Secret's labels) as a warning."""
    report = review(cr, result, config)
    where = f"fleetllm: {path}: {cr.metadata.name}"
    for violation in report.violations:
        print(f"{where}: refused by policy: {violation}", file=sys.stderr)
    label = config.policy.secret_label
    for ref in report.secrets:
        print(
            f"{where}: warning: {ref.field}: Secret {ref.name} must carry the label {label} "
            "(not checked offline; the operator checks it)",
            file=sys.stderr,
        )
    return not report.violations


def cmd_render(args: argparse.Namespace) -> int:
    objects: list[dict[str, Any]] = []
    refused = False
    config = config_from_args(args)
    for cr, result in _plan_all(args.filename, config):
        if isinstance(result, PlanError):
            print(
                f"fleetllm: {args.filename}: {cr.metadata.name}: not rendered, plan refused "
                f"({result.reason}): {result.message}",
                file=sys.stderr,
            )
            refused = True
        elif not _admitted(args.filename, cr, result, config):
            refused = True
        else:
            # The operator makes the key Secret once; applied by hand, it comes with the rest.
            objects.extend([*render(cr, result, config), new_key_secret(cr)])
    if objects:
        sys.stdout.write(dump_yaml_documents(objects))
    return 1 if refused else 0


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0.1 or value > 3600:
        raise argparse.ArgumentTypeError(f"{text}: must be between 0.1 and 3600 seconds")
    return value


def cmd_crds(args: argparse.Namespace) -> int:
    sys.stdout.write(reference_markdown() if args.reference else crd_yaml())
    return 0


def cmd_operator_run(args: argparse.Namespace) -> int:
    from fleetllm.operator import handlers

    return handlers.run(
        namespaces=args.namespaces or [],
        clusterwide=args.all_namespaces,
        standalone=args.standalone,
        peering=args.peering,
        priority=args.priority,
        liveness=args.liveness,
        log_json=args.log_format == "json",
        verbose=args.verbose,
        config=config_from_args(args),
        autoscale_interval=args.autoscale_interval,
        resync_interval=args.resync_interval,
        # From the env only: a flag's value shows in the pod spec and in `ps`.
        engine_key_root=os.environ.get(ENGINE_KEY_ROOT_ENV, ""),
    )
