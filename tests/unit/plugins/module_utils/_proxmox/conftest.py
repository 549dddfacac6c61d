"""Fixtures for the unit tests that talk to a real fakepve server over HTTPS (no containers needed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._proxmox.client import (
    ProxmoxClient,
    ProxmoxConnection,
    RetryPolicy,
)
from tests.harness.fakepve_lxc import FakePveServer, Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def pve_time_scale() -> float:
    """How long fakepve's tasks take, as a fraction of PVE's; a test module may override it."""
    return 0.01


@pytest.fixture
def server(pki: Pki, pve_time_scale: float) -> Iterator[FakePveServer]:
    """A fakepve server with CT 200 (gpu-train-01) running on node pve1."""
    served = FakePveServer(pki, time_scale=pve_time_scale)
    served.call(served.pve.add_ct, 200, "gpu-train-01", status="running")
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture
def pve_retry() -> RetryPolicy:
    """How `api` retries: quickly, so that a failure shows at once; a test module may override it."""
    return RetryPolicy(attempts=3, first_delay=0.01, max_delay=0.05)


@pytest.fixture
def api(server: FakePveServer, pve_retry: RetryPolicy) -> ProxmoxClient:
    """A client of `server` that logs in with a ticket and checks its certificate."""
    conn = ProxmoxConnection(host=server.host, port=server.port, user="root@pam", password=server.password,
                             ca_path=server.pki.ca_path, timeout=2)
    return ProxmoxClient(conn, retry=pve_retry)
