"""One gloo transport device per process (`mindspeed_tft.platform.gloo_device`, the ``cpu``
patch moment), in real 2-rank jobs against torch's own one device per group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.jobs import run_rank_programs

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "tests" / "programs" / "gloo_shared_device.py"


def _run(mode: str, ifname: str | None = None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return run_rank_programs(PROGRAM, mode, env=env)


EXACT = {"timeouts_s": [77.0, 55.0], "sums_exact": True, "isinstance": True}


@pytest.mark.parametrize(("mode", "ifname", "devices", "threads"), [
    ("own", None, 1, 3.0),      # torch: a device (one loop thread) and 2 workers per group
    ("shared", None, 1, 2.0),   # the shared device: the 2 workers only
    ("shared", "lo,lo", 2, 4.0),  # one shared device per interface, 2 workers per device
])
def test_groups_share_one_device_per_interface(mode, ifname, devices, threads):
    """With the cpu moment every later group runs on the process's one device (per
    GLOO_SOCKET_IFNAME interface): a new group adds its worker threads and no loop thread,
    keeps its own timeout, reduces exactly, and torch's isinstance checks still hold."""
    expected = {**EXACT, "threads_per_group": threads, "devices": devices,
                "shared": mode == "shared"}
    assert _run(mode, ifname) == [expected] * 2
