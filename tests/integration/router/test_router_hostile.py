"""What one hostile replica, or one hostile client, can take from the router and the scraper
that read it, measured on real processes: a fake engine on loopback (`hostile_engine.py`) sends
a 400 MiB /metrics, a 300 MiB answer, a 100 MiB stream event without its blank line, or
nothing at all; the router's peak memory (psutil, sampled) stays within a generous margin of
where it started, the client gets 502 in the error envelope, and the replica is backed off.
Clients sending many 15 MiB bodies at once get 429 (their key's cap) or 503 (everyone's) with
Retry-After before the router reads those bodies, and its memory stays bounded by the caps."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from local_services import free_port
from router_testkit import Process, async_wait_until, metric_sum, wait_until, write_fleet

HERE = Path(__file__).parent
MiB = 1 << 20
GUARD = 120.0  # hang guard only
# Far below what an unbounded read takes (the payloads are 100 to 400 MiB, read whole and
# then copied), far above the caps' own cost.
MARGIN = 160 * MiB


class PeakRss:
    """Samples a process's resident memory in a thread, keeping the highest seen."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.start = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def growth(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


@pytest.fixture()
def hostile() -> Iterator[Callable[[str], str]]:
    """Starts a hostile engine in MODE; its base URL once it answers /health."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(mode: str) -> str:
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(HERE / "hostile_engine.py"), str(port), mode])
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, f"hostile engine {mode}", GUARD)
        return url

    yield start
    for proc in procs:  # a test double with nothing to save; one that hangs ignores SIGTERM
        proc.kill()
        proc.wait()


def _router(start_router: Callable[..., Process], tmp_path: Path, *urls: str) -> Process:
    fleet = tmp_path / "fleet.json"
    write_fleet(fleet, {"m": list(urls)})
    return start_router("--fleet-file", str(fleet), "--scrape-interval", "0.2")


def _router_with(
    start_router: Callable[..., Process], tmp_path: Path, url: str, *args: str
) -> Process:
    fleet = tmp_path / "fleet.json"
    write_fleet(fleet, {"m": [url]})
    return start_router("--fleet-file", str(fleet), *args)


def _complete(router: Process, stream: bool = False) -> httpx.Response:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": stream}
    return httpx.post(f"{router.url}/v1/completions", json=body, timeout=GUARD)


def _measured(router: Process, stream: bool = False) -> tuple[httpx.Response, int]:
    """One completion through the router, and how much the router's memory grew meanwhile."""
    peak = PeakRss(router.proc.pid)
    response = _complete(router, stream)
    return response, peak.growth()


def _up(router: Process, replica: str) -> float:
    return metric_sum(router.metrics_text(), "fleetllm:router_replica_up", replica=replica)


def test_a_huge_metrics_backs_the_replica_off_and_the_scrape_stays_small(
    hostile: Callable[[str], str], start_router: Callable[..., Process], tmp_path: Path
) -> None:
    url = hostile("metrics")
    router = _router(start_router, tmp_path, url)
    peak = PeakRss(router.proc.pid)
    # Several scrapes in a row each meet the 400 MiB; the replica is taken out of service.
    wait_until(lambda: _up(router, url) == 0, "the replica backed off", GUARD)
    for _ in range(3):
        wait_until(lambda: "exceeds the limit" in router.log_text(), "the warning", GUARD)
        assert _up(router, url) == 0
    assert peak.growth() < MARGIN
    assert "backed off" in router.log_text()


def test_the_shared_scraper_refuses_a_huge_metrics_in_bounded_memory(
    hostile: Callable[[str], str],
) -> None:
    url = hostile("metrics")
    script = (
        "import asyncio, aiohttp\n"
        "from fleetllm.scrape import fetch_metrics, MetricsTooLarge, scrape_all\n"
        "async def main():\n"
        "    async with aiohttp.ClientSession() as s:\n"
        "        try:\n"
        f"            await fetch_metrics(s, {url!r}, 60)\n"
        "            print('read')\n"
        "        except MetricsTooLarge:\n"
        "            print('too large')\n"
        f"        print(await scrape_all(s, [{url!r}], 60))\n"
        "asyncio.run(main())\n"
        # The peak of this process's own memory (ru_maxrss would carry pytest's over the exec).
        "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, check=True, timeout=GUARD
    )
    verdict, scraped, peak = out.stdout.decode().split("\n")[:3]
    assert verdict == "too large"
    assert scraped == f"{{{url!r}: None}}"
    # The interpreter with aiohttp takes some tens of MiB; reading the 400 MiB took 1.2 GiB.
    assert int(peak) * 1024 < 100 * MiB + MARGIN


def test_a_huge_answer_is_a_502_and_the_router_stays_small(
    hostile: Callable[[str], str], start_router: Callable[..., Process], tmp_path: Path
) -> None:
    url = hostile("answer")
    router = _router(start_router, tmp_path, url)
    response, growth = _measured(router)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == 502 and "exceeds the limit" in error["message"]
    assert growth < MARGIN
    assert _up(router, url) == 0


def test_a_huge_first_event_is_a_502_and_the_router_stays_small(
    hostile: Callable[[str], str], start_router: Callable[..., Process], tmp_path: Path
) -> None:
    url = hostile("event")
    router = _router(start_router, tmp_path, url)
    cpu = psutil.Process(router.proc.pid).cpu_times()
    response, growth = _measured(router, stream=True)
    spent = psutil.Process(router.proc.pid).cpu_times()
    assert response.status_code == 502
    assert "exceeds the limit" in response.json()["error"]["message"]
    assert growth < MARGIN
    # The event is read once, up to the cap: the CPU it costs the router is that of one
    # MiB, not the seconds a quadratic search spent on 100 MiB (a generous bound: work, not
    # wall time), and the router still answers its health check.
    assert (spent.user + spent.system) - (cpu.user + cpu.system) < 2.0
    assert httpx.get(f"{router.url}/health", timeout=GUARD).status_code == 200
    assert _up(router, url) == 0


def test_a_huge_event_after_a_token_ends_the_stream_with_the_routers_error_event(
    hostile: Callable[[str], str], start_router: Callable[..., Process], tmp_path: Path
) -> None:
    url = hostile("late-event")
    router = _router(start_router, tmp_path, url)
    response, growth = _measured(router, stream=True)
    assert response.status_code == 200
    events = [e for e in response.text.split("\n\n") if e]
    assert json.loads(events[0][6:])["choices"][0]["text"] == "hi"
    assert json.loads(events[1][6:])["error"]["code"] == 502
    assert "exceeds the limit" in events[1]
    assert events[2] == "data: [DONE]"
    assert growth < MARGIN
    assert _up(router, url) == 0


def test_a_replica_that_never_answers_a_plain_request_is_left_for_another(
    hostile: Callable[[str], str], start_router: Callable[..., Process], tmp_path: Path
) -> None:
    hung, good = hostile("hang"), hostile("plain")
    fleet = tmp_path / "fleet.json"
    write_fleet(fleet, {"m": [hung, good]})
    router = start_router(
        "--fleet-file", str(fleet), "--first-byte-timeout", "1", "--strategy", "round-robin"
    )
    for _ in range(2):  # round robin: one of the two meets the hung replica first
        response = _complete(router)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "ok"
    assert _up(router, hung) == 0


def test_a_replica_that_dribbles_its_answer_is_cut_off_at_the_requests_deadline(
    hostile: Callable[[str], str], start_router: Callable[..., Process], tmp_path: Path
) -> None:
    url = hostile("dribble")
    router = _router_with(start_router, tmp_path, url, "--request-timeout", "3")
    response = _complete(router)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == 504
    assert _up(router, url) == 0


BODY_MIB = 15
# What one admitted request may cost the router at most: its body as read, as parsed, and as
# sent on (with its cache salt), with room to spare; the rest is the interpreter's noise.
PER_REQUEST = 4 * 16 * MiB
NOISE = 100 * MiB


def _flood(router: Process, count: int, admitted: int, key: str | None) -> list[httpx.Response]:
    """`count` requests of BODY_MIB MiB at once, to a replica that never answers: the answers
    of those refused (all but `admitted`, which are then held at the replica). The router's
    peak memory over the flood is checked against what `admitted` requests may cost."""
    body = json.dumps({"model": "m", "prompt": "x" * (BODY_MIB * MiB), "max_tokens": 1})
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def in_flight() -> float:
        text = httpx.get(f"{router.url}/metrics", headers=headers, timeout=GUARD).text
        return metric_sum(text, "fleetllm:router_inflight")

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=GUARD) as client:
            posts = [
                asyncio.create_task(
                    client.post(f"{router.url}/v1/completions", content=body, headers=headers)
                )
                for _ in range(count)
            ]
            await async_wait_until(
                lambda: sum(p.done() for p in posts) == count - admitted, "the refusals", GUARD
            )
            await async_wait_until(lambda: in_flight() == admitted, "the held ones", GUARD)
            refused = [p.result() for p in posts if p.done()]
            for post in posts:
                post.cancel()  # the held ones: their client leaves
            await asyncio.gather(*posts, return_exceptions=True)
            return refused

    peak = PeakRss(router.proc.pid)
    refused = asyncio.run(flood())
    assert peak.growth() < admitted * PER_REQUEST + NOISE
    wait_until(lambda: in_flight() == 0, "the held requests closed", GUARD)
    return refused


def test_one_keys_flood_of_big_bodies_is_capped_before_they_are_read(
    hostile: Callable[[str], str], start_router: Callable[..., Process], tmp_path: Path
) -> None:
    # The chart's default cap per key (a key of the Secret with none of its own).
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-flood-0123456789\n")
    router = _router_with(start_router, tmp_path, hostile("hang"), "--api-keys-file", str(keys),
                          "--max-concurrent-per-key", "2")  # fmt: skip
    refused = _flood(router, 16, 2, "sk-flood-0123456789")
    assert {r.status_code for r in refused} == {429}
    assert all(r.headers["Retry-After"] == "1" for r in refused)
    assert refused[0].json()["error"]["type"] == "RateLimitError"


def test_many_clients_big_bodies_are_capped_for_all_together(
    hostile: Callable[[str], str], start_router: Callable[..., Process], tmp_path: Path
) -> None:
    # 48 MiB of bodies in flight: three of 15 MiB.
    router = _router_with(start_router, tmp_path, hostile("hang"),
                          "--max-inflight-bytes", str(48 * MiB))  # fmt: skip
    refused = _flood(router, 16, 3, None)
    assert {r.status_code for r in refused} == {503}
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert refused[0].json()["error"]["code"] == 503
