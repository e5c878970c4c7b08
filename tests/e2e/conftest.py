import os
import shutil

import pytest

from tests.e2e import lab
from tests.e2e.fleets import cpu_router_fleet, tls_fleet  # noqa: F401 (shared fleets)


def pytest_collection_modifyitems(config, items):
    reason = None
    if os.geteuid() != 0:
        reason = "end-to-end tests boot sandbox hosts: they need root"
    elif not shutil.which("ip"):
        reason = "end-to-end tests need iproute2"
    if reason:
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def reference_host():
    """One fresh sandbox host of the reference lab scenario, removed afterwards."""
    (host,) = lab.up(hosts=1, scenario="reference-lab")
    yield host
    lab.sandbox("down", check=False)


@pytest.fixture(scope="module")
def converged_host():
    """One fresh sandbox host of the reference lab scenario, converged by a first deploy (which
    must succeed; lab.up_converged: from the suite run's image where it keeps one), removed
    afterwards."""
    yield lab.up_converged("reference-lab")
    lab.sandbox("down", check=False)
