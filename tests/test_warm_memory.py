"""A parked warm spare's host memory reserve (`launcher.warm_memory`): the pages it touches
stay resident and later allocations reuse them without page faults; its size follows the
launcher's other children; a message arriving stops it early. Each case runs in a fresh
interpreter (the reserve changes the process' malloc settings for good)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs, glibc")

MIB = 1 << 20


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


# allocates and fills 192 MiB with torch (the allocator the set-up uses), prints the minor
# page faults that took and the anonymous memory before and after
_FAULTS = """
import resource, torch
from mindspeed_tft.launcher.warm_memory import HeapReserve, anon_bytes
reserve = HeapReserve()
held = reserve.grow_to({reserve}) if {reserve} else 0
after_reserve = anon_bytes()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.empty(192 << 20, dtype=torch.uint8)
t.fill_(1)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(held, reserve.baseline, after_reserve, faults)
"""


def test_reserved_pages_stay_resident_and_are_reused_without_faults() -> None:
    pages = 192 * MIB // 4096
    *_, cold_faults = map(int, _run(_FAULTS.format(reserve=0)))
    held, baseline, after, warm_faults = map(int, _run(_FAULTS.format(reserve=256 * MIB)))
    assert held == 256 * MIB
    # freed, yet resident: the heap keeps it
    assert after - baseline >= 250 * MIB
    assert cold_faults > pages // 2, cold_faults  # first touch of fresh memory faults
    assert warm_faults < pages // 20, (warm_faults, cold_faults)


def test_size_follows_the_launchers_other_children() -> None:
    """A stand-in launcher with two children: one holding 320 MiB, one asking for its
    target: 320 MiB more than its own memory, within a few MiB."""
    code = f"""
    import subprocess, sys
    holder = subprocess.Popen([sys.executable, "-c",
        "import sys; b = bytearray({320 * MIB}); b[::4096] = b'x' * len(b[::4096]); "
        "print('ok', flush=True); sys.stdin.read()"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ok"
    asker = subprocess.run([sys.executable, "-c",
        "import os; from mindspeed_tft.launcher.warm_memory import HeapReserve; "
        "r = HeapReserve(); print(r.target(os.getppid()), r.baseline)"],
        capture_output=True, text=True, timeout=60)
    holder.stdin.close(); holder.wait(10)
    print(asker.stdout.strip() or asker.stderr)
    """
    target, baseline = map(int, _run(code))
    assert 320 * MIB - 16 * MIB <= target <= 320 * MIB + 16 * MIB, (target, baseline)


def test_an_arriving_message_stops_the_touching() -> None:
    code = """
    from mindspeed_tft.launcher.warm_memory import TOUCH_STEP, HeapReserve
    reserve = HeapReserve()
    print(reserve.grow_to(8 * TOUCH_STEP, interrupted=lambda: True), TOUCH_STEP)
    print(reserve.grow_to(reserve.held + 1))  # below the growth step: nothing more
    """
    held, step, again = map(int, _run(code))
    assert held == step and again == step
