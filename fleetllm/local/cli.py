"""`fleetllm up`: the whole fleet on this machine, behind one OpenAI endpoint."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fleetllm.logs import add_log_level_flag

if TYPE_CHECKING:
    from fleetllm.local.launch import LocalModel
    from fleetllm.local.status import RecentEvents

PORT_ENV = "FLEETLLM_PORT"
DEFAULT_PORT = 8000
STATUS_PERIOD_S = 1.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="run the whole fleet on this machine (engines, router, autoscaler)",
        description="Plan each LLMDeployment as the operator would, run its replicas as local "
        "processes, and serve every model through one OpenAI-compatible endpoint, scaled on "
        "KV-cache usage and queue time. Without -f: SmolLM2-135M-Instruct on the CPU, one "
        "replica, two under load. Ctrl-C or SIGTERM drains and stops everything.",
    )
    p.add_argument(
        "-f",
        "--filename",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="YAML file of LLMDeployments (repeatable; default: the built-in SmolLM2 one)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address of the endpoint (%(default)s)")
    p.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help="API keys the endpoint requires (the router's format, see docs/router.md); "
        "needed to listen on anything but loopback",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"port of the endpoint (default: ${PORT_ENV}, else {DEFAULT_PORT})",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where the replicas' and the router's logs go (default: a new folder in the "
        "user log directory)",
    )
    p.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=30.0,
        help="seconds open requests get to finish on Ctrl-C/SIGTERM (default: %(default)s)",
    )
    add_log_level_flag(p)
    p.set_defaults(func=cmd_up)


def _port(args: argparse.Namespace) -> int:
    if args.port is not None:
        port = args.port
    else:
        raw = os.environ.get(PORT_ENV, str(DEFAULT_PORT))
        if not raw.isdigit():
            raise ValueError(f"${PORT_ENV} must be a port number, got {raw!r}")
        port = int(raw)
    if not 0 < port < 65536:
        raise ValueError(f"--port must be 1..65535, got {port}")
    return port


def _log_dir(args: argparse.Namespace) -> Path:
    import platformdirs

    if args.log_dir is not None:
        return args.log_dir
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(platformdirs.user_log_dir("fleetllm")) / f"up-{stamp}-{os.getpid()}"


def _configure_logging(level: str, log_dir: Path, live: bool) -> RecentEvents | None:
    """The supervisor's JSON log on stderr; with a live view, in a file of the log folder
    instead, with the latest events shown under the table. The router logs to a file."""
    from fleetllm.local.status import RecentEvents
    from fleetllm.logs import JSONFormatter, filter_parser_errors

    log_dir.mkdir(parents=True, exist_ok=True)
    events = RecentEvents() if live else None
    main: logging.Handler = (
        logging.FileHandler(log_dir / "fleetllm-up.log") if live else logging.StreamHandler()
    )
    main.setFormatter(JSONFormatter())
    logging.basicConfig(
        level=level.upper(), handlers=[main] if events is None else [main, events], force=True
    )
    # One line per request would bury everything else; the router keeps its own log.
    router_log = logging.FileHandler(log_dir / "router.log")
    router_log.setFormatter(JSONFormatter())
    router = logging.getLogger("fleetllm.router")
    router.handlers[:] = [router_log]
    router.propagate = False
    # The router's server refuses malformed requests: one line each, never their bytes.
    filter_parser_errors()
    return events


def cmd_up(args: argparse.Namespace) -> int:
    from fleetllm.local.deployments import (
        FleetError,
        check_gpus,
        load_fleet,
        local_gpus,
        local_notes,
    )
    from fleetllm.local.vllm import find_vllm_python
    from fleetllm.planner.summary import plan_summary

    if args.shutdown_grace_period < 0:
        raise ValueError("--shutdown-grace-period must not be negative")
    if args.api_keys_file is None and not _loopback(args.host):
        # Anyone who can reach the address could use (and load) every model.
        raise ValueError(
            f"--host {args.host} serves beyond this machine: give --api-keys-file too "
            "(or listen on 127.0.0.1)"
        )
    port = _port(args)
    try:
        models = load_fleet(args.filename, vllm=find_vllm_python())
        gpus = local_gpus() if any(m.devices_per_replica for m in models) else []
        check_gpus(models, len(gpus))
    except FleetError as exc:
        print(f"fleetllm up: cannot start the fleet:\n{exc}", file=sys.stderr)
        return 1
    notes = {m.name: local_notes(m.cr, args.shutdown_grace_period) for m in models}
    for model in models:
        sys.stderr.write(f"{model.where}: {plan_summary(model.cr, model.plan)}")
        for note in notes[model.name]:
            sys.stderr.write(f"  note: {note}\n")
    log_dir = _log_dir(args)
    try:
        events = _configure_logging(args.log_level, log_dir, live=sys.stdout.isatty())
    except OSError as exc:
        raise ValueError(f"cannot write the logs to {log_dir}: {exc.strerror or exc}") from None
    for model in models:
        # The plan's own notes (what the engine does not apply here) are in its summary.
        for note in [*notes[model.name], *model.plan.notes]:
            logging.getLogger("fleetllm.local").warning(
                "not done on this machine", extra={"model": model.name, "note": note}
            )
    return asyncio.run(
        run_fleet(
            models,
            host=args.host,
            port=port,
            log_dir=log_dir,
            grace_s=args.shutdown_grace_period,
            gpus=gpus,
            events=events,
            keys_file=args.api_keys_file,
        )
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


async def run_fleet(
    models: list[LocalModel],
    *,
    host: str,
    port: int,
    log_dir: Path,
    grace_s: float,
    gpus: list[str],
    events: RecentEvents | None = None,
    keys_file: Path | None = None,
) -> int:
    from fleetllm.local.autoscaler import run_autoscaler
    from fleetllm.local.launch import CorePool, GPUPool, hold_timeout
    from fleetllm.local.status import StatusView
    from fleetllm.local.supervisor import Supervisor, SupervisorSettings
    from fleetllm.router.config import RouterSettings
    from fleetllm.router.server import Router, RouterServer

    log = logging.getLogger("fleetllm.local")
    shown_host = "localhost" if host in ("127.0.0.1", "0.0.0.0", "::") else host
    endpoint = f"http://{shown_host}:{port}/v1"
    cores = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    cpu_replicas = sum(m.max_replicas for m in models if not m.plan.gpu.is_gpu)
    settings = SupervisorSettings(
        log_dir=log_dir,
        endpoint=endpoint,
        grace_s=grace_s,
    )
    router: Router | None = None

    def in_flight(model: str, url: str) -> int:
        return router.pool.in_flight(model, url) if router is not None else 0

    supervisor = Supervisor(
        models,
        settings,
        gpus=GPUPool(gpus),
        cores=CorePool(cores, cpu_replicas),
        in_flight=in_flight,
    )
    router = Router(
        RouterSettings(host=host, port=port, hold_timeout=hold_timeout(models)),
        supervisor.discovery,
        keys_file=keys_file,
    )
    server = RouterServer(router, grace_s)
    try:
        await server.start(host, port)
    except OSError as exc:
        print(
            f"fleetllm up: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr
        )
        return 1

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            # A second signal: no more waiting. Every guard kills its tree when we are gone.
            log.warning("stopping at once", extra={"signal": sig.name})
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        log.info("stopping: draining", extra={"signal": sig.name})
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    log.info(
        "fleet starting",
        extra={"endpoint": endpoint, "models": [m.name for m in models], "logs": str(log_dir)},
    )
    title = f"fleetllm up: {endpoint}  (logs: {log_dir})"
    with StatusView(sys.stdout, live=events is not None, events=events, title=title) as view:

        async def show_status() -> None:
            while True:
                view.show(supervisor.views())
                await asyncio.sleep(STATUS_PERIOD_S)

        status = asyncio.create_task(show_status())
        await supervisor.start()
        assert supervisor.session is not None
        for fleet in supervisor.fleets.values():
            supervisor.spawn(run_autoscaler(supervisor, fleet, supervisor.session))
        ended = [asyncio.create_task(stop.wait()), asyncio.create_task(supervisor.failed.wait())]
        await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        for task in ended:
            task.cancel()
        deadline = time.monotonic() + grace_s
        # The router first: no new requests, open ones finish on the replicas still serving.
        await server.stop()
        await supervisor.shutdown(max(0.0, deadline - time.monotonic()))
        status.cancel()
        view.show(supervisor.views())
    log.info("fleet stopped", extra={"logs": str(log_dir)})
    if supervisor.failure is not None:
        print(f"fleetllm up: {supervisor.failure}", file=sys.stderr)
        return 1
    return 0
