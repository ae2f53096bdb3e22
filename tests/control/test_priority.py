"""The control plane's threads ask for a higher scheduling priority (`control.wire.priority`): the
controller's loop, a processor's I/O thread and the ZeroMQ I/O threads they start run at
`thread_nice` under SCHED_RR at `thread_rtprio`, the training thread keeps its own, and an
order lane's worker started from such a thread keeps the nice value under the normal policy;
where the kernel refuses, nothing changes and the log says so once.

Each case runs in a fresh interpreter: a nice value belongs to a thread, and the ZeroMQ I/O
threads of other tests' contexts would be counted too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent("""
    import ctypes, json, logging, os, resource, sys, threading
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")

    if sys.argv[2] == "drop":  # no CAP_SYS_NICE and no RLIMIT_NICE, for this thread and the
        # threads it starts (capabilities belong to a thread; new threads copy them)
        resource.setrlimit(resource.RLIMIT_NICE, (0, resource.getrlimit(resource.RLIMIT_NICE)[1]))
        resource.setrlimit(resource.RLIMIT_RTPRIO,
                           (0, resource.getrlimit(resource.RLIMIT_RTPRIO)[1]))
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
        data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; two words each
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.capget(header, data) == 0, ctypes.get_errno()
        for word in (0, 1):  # CAP_SYS_NICE is bit 23 of the first word
            data[word] &= ~(1 << 23)
        assert libc.capset(header, data) == 0, ctypes.get_errno()
    from mindspeed_tft.control import ControlConfig, Controller, Processor
    from mindspeed_tft.control.processor.core import Received
    from mindspeed_tft.control.processor.orders import Lane
    from mindspeed_tft.control.wire.priority import raise_priority

    def nice(tid):  # with the policy: "rr" (SCHED_RR at its priority) or "other"
        stat = open(f"/proc/self/task/{tid}/stat").read()
        value = int(stat.rsplit(")", 1)[1].split()[16])
        if os.sched_getscheduler(tid) == os.SCHED_RR:
            return [value, "rr", os.sched_getparam(tid).sched_priority]
        return [value, "other", 0]

    def lane_worker(cfg):  # what an order lane's worker runs at, started from a control thread
        found, done = [], threading.Event()
        def run(order):
            found.append(nice(threading.get_native_id()))
            done.set()
        def control_thread():
            raise_priority(cfg.thread_nice, cfg.thread_rtprio)
            Lane("lane", run).submit(Received(1, "probe", 1e18, None), 0.0)
        t = threading.Thread(target=control_thread)
        t.start()
        t.join()
        done.wait(10)
        return found[0]

    def zmq_io_threads():
        return [int(t) for t in os.listdir("/proc/self/task")
                if open(f"/proc/self/task/{t}/comm").read().startswith("ZMQbg/IO")]

    def probe():  # may this process lower a thread's nice value and make it real-time?
        result = []
        def run():
            tid = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, tid, -1)
                os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(2))
                result.append(True)
            except PermissionError:
                result.append(False)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return result[0]

    allowed = probe()
    cfg = ControlConfig(port=0, thread_nice=-5, thread_rtprio=2, log_path=sys.argv[1])
    ctrl = Controller(1, cfg)
    ctrl.start()
    proc = Processor(0, 1, cfg.replace(port=ctrl.port), hard_exit=False, host="localhost")
    proc.start(timeout=10)
    print(json.dumps({
        "allowed": allowed,
        "main": nice(threading.get_native_id()),
        "controller": nice(ctrl._thread.native_id),
        "processor": nice(proc._channel._thread.native_id),
        "zmq_io": sorted(nice(t) for t in zmq_io_threads()),
        "lane_worker": lane_worker(cfg),
    }), flush=True)
    proc.stop()
    ctrl.stop()
""")


def _run(tmp_path: Path, *, drop: bool) -> tuple[dict, str]:
    """The program's findings and its log; `drop`: without the right to raise a priority."""
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path), "drop" if drop else "keep"], cwd=REPO,
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_control_threads_run_at_the_configured_nice_and_rtprio(tmp_path: Path) -> None:
    found, log = _run(tmp_path, drop=False)
    assert found["main"] == [0, "other", 0]  # the training thread keeps its priority
    assert len(found["zmq_io"]) == 2  # the controller's context and the processor's
    want = [-5, "rr", 2] if found["allowed"] else [0, "other", 0]
    assert (found["controller"], found["processor"], found["zmq_io"]) == (want, want,
                                                                          [want, want])
    # a lane's worker keeps the nice value, not the real-time policy
    assert found["lane_worker"] == [want[0], "other", 0]
    assert ("needs CAP_SYS_NICE" in log) == (not found["allowed"])


def test_where_the_kernel_refuses_nothing_changes_and_the_log_says_so_once(
        tmp_path: Path) -> None:
    found, log = _run(tmp_path, drop=True)
    assert not found["allowed"]
    normal = [0, "other", 0]
    assert (found["main"], found["controller"], found["processor"], found["zmq_io"],
            found["lane_worker"]) == (normal, normal, normal, [normal, normal], normal)
    assert log.count("control-plane threads stay at nice 0: raising them to -5 needs "
                     "CAP_SYS_NICE") == 1, log
    assert log.count("control-plane threads stay under the normal scheduling policy: "
                     "SCHED_RR priority 2 needs CAP_SYS_NICE or RLIMIT_RTPRIO >= 2") == 1, log
