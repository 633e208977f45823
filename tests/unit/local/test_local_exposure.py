"""`fleetllm up` listens beyond loopback only with API keys: an open endpoint on the network
would let anyone use, and load, every model of the fleet."""

from __future__ import annotations

import pytest

from fleetllm.cli import main
from fleetllm.local.cli import _loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "my-laptop.example"])
def test_up_refuses_a_network_address_without_keys(
    host: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused before anything is loaded or started.
    assert main(["up", "--host", host]) == 2
    err = capsys.readouterr().err
    assert f"--host {host} serves beyond this machine: give --api-keys-file" in err


def test_loopback_addresses_need_no_keys() -> None:
    assert all(_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com"))
