"""Where a state worker listens and what it advertises (sparkstep.net): real worker processes,
dialled at the address of their ready line."""

from __future__ import annotations

import socket

import pytest

from sparkstep.net import advertised_host, host_port, is_wildcard
from tests.runtime.worker.fixtures import WorkerFactory


def test_by_default_a_worker_listens_on_loopback_and_advertises_it(
    worker_factory: WorkerFactory,
) -> None:
    worker = worker_factory()
    assert worker.address == f"127.0.0.1:{worker.port}"
    assert list(worker.client().versions()) == [0]


def test_a_worker_on_every_interface_advertises_the_host_it_is_told(
    worker_factory: WorkerFactory,
) -> None:
    worker = worker_factory(args=("--bind", "0.0.0.0", "--advertise", "localhost"))
    assert worker.address == f"localhost:{worker.port}"
    assert list(worker.client().versions()) == [0]


def test_a_worker_on_every_interface_without_advertise_advertises_this_hosts_name(
    worker_factory: WorkerFactory,
) -> None:
    worker = worker_factory(args=("--bind", "0.0.0.0"))
    assert worker.address == f"{socket.gethostname()}:{worker.port}"
    assert list(worker.client().versions()) == [0]


@pytest.mark.parametrize(
    ("bind", "advertise", "expected"),
    [
        ("127.0.0.1", None, "127.0.0.1"),
        ("10.1.2.3", None, "10.1.2.3"),
        ("0.0.0.0", "state-host-1", "state-host-1"),
        ("::", None, socket.gethostname()),
        ("127.0.0.1", "localhost", "localhost"),
    ],
)
def test_the_advertised_host_rule(bind: str, advertise: str | None, expected: str) -> None:
    assert advertised_host(bind, advertise) == expected


def test_addresses_are_written_with_ipv6_literals_in_brackets() -> None:
    assert host_port("::1", 80) == "[::1]:80"
    assert host_port("[::1]", 80) == "[::1]:80"
    assert host_port("state-host-1", 80) == "state-host-1:80"
    assert host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert is_wildcard("0.0.0.0") and is_wildcard("::") and not is_wildcard("127.0.0.1")
