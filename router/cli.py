"""`fleetllm router serve`: the OpenAI-compatible front door for the whole fleet."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

from fleetllm.api.contract import ENGINE_KEY_ROOT_ENV
from fleetllm.logs import add_log_level_flag, configure_logging
from fleetllm.router.config import STRATEGIES, RouterSettings

if TYPE_CHECKING:
    from fleetllm.router.server import Router

ADMIN_KEY_ENV = "FLEETLLM_ROUTER_ADMIN_KEY"
UPSTREAM_KEY_ENV = "FLEETLLM_UPSTREAM_API_KEY"
CACHE_SALT_ENV = "FLEETLLM_ROUTER_CACHE_SALT_SECRET"
"""The key of the per-tenant cache salts; router replicas that share it share caches."""

_DEFAULTS = RouterSettings()
_TYPES = get_type_hints(RouterSettings)


def _setting(group: argparse._ActionsContainer, flag: str, help: str | None = None) -> None:
    """The flag of the RouterSettings field of its name: the field's type and default are
    the flag's, so each default has one owner."""
    name = flag.removeprefix("--").replace("-", "_")
    group.add_argument(flag, type=_TYPES[name], default=getattr(_DEFAULTS, name), help=help)


def register(sub: argparse._SubParsersAction) -> None:
    router = sub.add_parser("router", help="the OpenAI-compatible router in front of the fleet")
    router_sub = router.add_subparsers(dest="router_command", required=True, metavar="COMMAND")
    p = router_sub.add_parser(
        "serve",
        help="serve the router",
        description="One OpenAI endpoint for every model of the fleet: routes by model, load "
        "and shared prompt prefix, fails over, and holds requests while a model scales up.",
    )
    _setting(p, "--host")
    _setting(p, "--port")

    g = p.add_argument_group("discovery")
    g.add_argument(
        "--discovery",
        choices=("static", "kubernetes"),
        default="static",
        help="static: a fleet file; kubernetes: watch LLMDeployments, their Services and "
        "EndpointSlices (default: %(default)s)",
    )
    g.add_argument(
        "--fleet-file",
        type=Path,
        help="static: YAML/JSON `models: {NAME: [URL, ...]}`, reloaded on change",
    )
    g.add_argument(
        "--namespace",
        action="append",
        help="kubernetes: namespace to watch, repeatable (default: the pod's own, else all; "
        "with several, model ids become NAMESPACE/MODEL)",
    )
    g.add_argument(
        "--all-namespaces",
        action="store_true",
        help="kubernetes: watch them all; model ids become NAMESPACE/MODEL",
    )
    g.add_argument(
        "--demand-webhook",
        help='static: POST {"model": NAME} here when a model without replicas gets requests',
    )
    g.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"enables GET/PUT /admin/fleet with this bearer key (env {ADMIN_KEY_ENV})",
    )

    g = p.add_argument_group("routing (defaults for models that do not set their own)")
    g.add_argument("--strategy", choices=STRATEGIES, default=_DEFAULTS.strategy)
    _setting(g, "--load-factor", "prefix: no replica above this x mean load (default: %(default)s)")
    _setting(g, "--session-header")
    _setting(
        g,
        "--prefix-chars",
        "prefix: characters of the rendered prompt that key the hash (default: %(default)s)",
    )
    g.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=DIR",
        help="kv-aware: the directory of MODEL's tokenizer files (tokenizer.json, "
        "tokenizer_config.json, chat_template.jinja), for a model whose discovery names none; "
        "repeatable",
    )
    _setting(
        g, "--kv-index-max-blocks", "kv-aware: block keys kept per replica (default: %(default)s)"
    )
    _setting(
        g,
        "--kv-events-stale-after",
        "kv-aware: seconds after which a replica whose event stream cannot be checked is "
        "routed by prefix hash (default: %(default)s)",
    )

    g = p.add_argument_group("upstream")
    _setting(g, "--connect-timeout")
    _setting(g, "--first-byte-timeout", "streams: seconds until the replica's first event")
    _setting(g, "--request-timeout", "seconds for a whole request, holding and retries included")
    _setting(g, "--max-attempts")
    _setting(g, "--retry-window", "no retry starts later than this after arrival")
    _setting(g, "--backoff-max", "longest pause of a failing replica (default: %(default)s s)")
    _setting(g, "--scrape-interval")
    _setting(
        g,
        "--max-metrics-bytes",
        "a replica's /metrics past this is refused and the replica backed off",
    )
    _setting(
        g,
        "--max-answer-bytes",
        "a non-streamed answer past this is refused (502) and the replica backed off",
    )
    _setting(
        g,
        "--max-event-bytes",
        "one stream event past this is refused (502) and the replica backed off",
    )
    g.add_argument(
        "--upstream-api-key",
        default=os.environ.get(UPSTREAM_KEY_ENV),
        help=f"bearer key for the replicas (env {UPSTREAM_KEY_ENV}); with {ENGINE_KEY_ROOT_ENV} "
        "set, a discovered LLMDeployment's replicas get its own derived key instead",
    )

    g = p.add_argument_group("scale from zero")
    _setting(g, "--hold-queue-size", "requests held per model while it has no ready replica")
    _setting(g, "--hold-timeout")
    _setting(
        g, "--hold-queue-bytes", "request bytes held per model, together (default: %(default)s)"
    )

    g = p.add_argument_group("security")
    g.add_argument(
        "--api-keys-file",
        type=Path,
        help="one key per line, or YAML `keys: [{name, key, requestsPerMinute, "
        "tokensPerMinute, maxConcurrentRequests, models, namespaces, tenant}]`; reloaded on "
        "change",
    )
    g.add_argument(
        "--api-keys-secret",
        metavar="[NAMESPACE/]NAME",
        help="a Kubernetes Secret whose every data entry is a key (an entry named *.yaml: "
        "the YAML form)",
    )
    g.add_argument("--rate-limit-rpm", type=int, help="default requests per minute per key")
    g.add_argument("--rate-limit-tpm", type=int, help="default tokens per minute per key")
    g.add_argument(
        "--max-concurrent-per-key",
        type=int,
        help="default requests one key may have open at once",
    )
    g.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without a key even when keys are on (it names every model, "
        "namespace and replica address: keep it off the Ingress)",
    )
    _setting(g, "--max-body-bytes")
    _setting(
        g,
        "--max-inflight-requests",
        "requests open at once, all keys together; past it 503 (default: %(default)s)",
    )
    _setting(
        g,
        "--max-inflight-bytes",
        "request bodies held at once, all keys together; past it 503 (default: %(default)s)",
    )
    _setting(
        g,
        "--client-header-timeout",
        "seconds a connection gets to send a request's headers (also the idle keep-alive "
        "time; default: %(default)s)",
    )
    _setting(
        g, "--client-body-timeout", "seconds a request's body gets to arrive (default: %(default)s)"
    )

    g = p.add_argument_group("process")
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    add_log_level_flag(g)
    g.add_argument(
        "--no-request-log",
        action="store_true",
        help="no log line per request (they never hold prompts or keys)",
    )
    p.set_defaults(func=_serve)


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    # Each flag named after a RouterSettings field (_setting's, --strategy) sets that field;
    # the others are derived here.
    flagged = {f.name: getattr(args, f.name) for f in fields(RouterSettings) if f.name in args}
    derived = {
        "tokenizers": tuple(_model_dir(value) for value in args.tokenizer),
        "upstream_api_key": args.upstream_api_key or None,
        "cache_salt_secret": os.environ.get(CACHE_SALT_ENV, "").encode(),
        # The env only (the chart's `<release>-engine-keys` Secret): never a flag, seen in `ps`.
        "engine_key_root": os.environ.get(ENGINE_KEY_ROOT_ENV, "").encode(),
    }
    return RouterSettings(**(flagged | derived))


def _model_dir(value: str) -> tuple[str, str]:
    model, sep, directory = value.partition("=")
    if not sep or not model or not directory:
        raise ValueError(f"--tokenizer takes MODEL=DIR, got {value!r}")
    return model, directory


def _serve(args: argparse.Namespace) -> int:
    from fleetllm.kube.client import KubeClient
    from fleetllm.kube.login import load_credentials
    from fleetllm.kube.resources import SECRETS
    from fleetllm.router.auth import keys_from_secret
    from fleetllm.router.discovery import Discovery, KubernetesDiscovery, StaticDiscovery
    from fleetllm.router.server import Router

    configure_logging(args.log_level)

    settings = settings_from_args(args)
    for flag in ("rate_limit_rpm", "rate_limit_tpm", "max_concurrent_per_key"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.api_keys_file and args.api_keys_secret:
        raise ValueError("give --api-keys-file or --api-keys-secret, not both")

    kube: KubeClient | None = None
    own_namespace: str | None = None
    if args.discovery == "kubernetes" or args.api_keys_secret:
        # Fail fast, with a clear message, when there are no credentials at all.
        credentials = load_credentials()
        own_namespace = credentials.namespace if credentials.in_cluster else None
        kube = KubeClient(
            load_credentials, user_agent="fleetllm-router", field_manager="fleetllm-router"
        )
    discovery: Discovery
    if args.discovery == "kubernetes":
        assert kube is not None
        namespaces = args.namespace or ([own_namespace] if own_namespace else [])
        if args.all_namespaces:
            if args.namespace:
                raise ValueError(
                    "--all-namespaces takes no --namespace: plain model names reach a model "
                    "only where one namespace in the key's scope serves it"
                )
            discovery = KubernetesDiscovery(kube, None)
        else:
            discovery = KubernetesDiscovery(kube, namespaces or None)
    else:
        if args.fleet_file is None and not args.admin_key:
            raise ValueError("static discovery needs --fleet-file or --admin-key (or both)")
        discovery = StaticDiscovery(args.fleet_file, demand_webhook=args.demand_webhook)
        # A broken file is an error now, not a router that silently serves nothing.
        discovery.load()

    keys_loader = None
    if args.api_keys_secret:
        assert kube is not None
        namespace, _, name = args.api_keys_secret.rpartition("/")
        namespace = namespace or own_namespace or "default"
        client = kube

        async def keys_loader() -> Any:
            secret = await client.get(SECRETS, name, namespace)
            if secret is None:
                raise ValueError(f"Secret {namespace}/{name} does not exist")
            return keys_from_secret(
                secret, args.rate_limit_rpm, args.rate_limit_tpm, args.max_concurrent_per_key
            )

    router = Router(
        settings,
        discovery,
        keys_file=args.api_keys_file,
        keys_loader=keys_loader,
        default_rpm=args.rate_limit_rpm,
        default_tpm=args.rate_limit_tpm,
        default_concurrency=args.max_concurrent_per_key,
        admin_key=args.admin_key or None,
        log_requests=not args.no_request_log,
        public_metrics=args.public_metrics,
    )
    run = asyncio.run
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        pass
    run(serve(router, settings.host, settings.port, args.shutdown_timeout))
    return 0


async def serve(router: Router, host: str, port: int, shutdown_timeout: float = 30.0) -> None:
    """Serve until SIGTERM or SIGINT; then stop accepting, let requests in flight finish (up
    to `shutdown_timeout`), and return."""
    from fleetllm.router.server import RouterServer

    server = RouterServer(router, shutdown_timeout)
    await server.start(host, port, backlog=1024)
    logging.getLogger("fleetllm.router").info(
        "router listening", extra={"host": host, "port": port}
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        router.stopping = True
        await server.stop()
