"""Three hosts, one down and one refused while planning: the third converges, and the run says
per host what happened."""

import time

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUNFILE_SMI = (
    "printf '#!/bin/sh\\necho \"NVIDIA-SMI has failed because it couldn'\"'\"'t communicate with "
    "the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.\"\\n"
    "exit 9\\n' > /usr/bin/nvidia-smi && chmod 755 /usr/bin/nvidia-smi"
)


def test_one_down_one_refused_one_converges():
    good, refused, down = lab.up(hosts=3, scenario="reference-lab")
    try:
        # A runfile-style driver that no package installed: refused by default.
        refused.ssh(RUNFILE_SMI)
        down.ssh("systemctl poweroff", check=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and '"stopped"' not in lab.sandbox(
                "status", "--json").stdout:
            time.sleep(1)

        run = lab.deploy()
        assert run.returncode != 0, run.output[-6000:]
        assert f"host {refused.name}: nothing was changed, because:" in run.output
        assert "a driver no package installed is present" in run.output
        assert f"[{down.name}]" in run.output and "Could not connect" in run.output
        assert good.ssh("systemctl is-active sglang.service").strip() == "active"
        assert "glm-5" in good.http_get("http://127.0.0.1:8000/v1/models")
        assert refused.ssh("systemctl is-active sglang.service", check=False).strip() != "active"
        assert refused.ssh("test -e /etc/apt/sources.list.d/cuda-debian12-x86_64.list "
                           "&& echo present || echo absent").strip() == "absent"
    finally:
        lab.sandbox("down", check=False)
