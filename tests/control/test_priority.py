"""The control plane's threads ask for a higher scheduling priority (`control.priority`): the
controller's loop, a processor's I/O thread and the ZeroMQ I/O threads they start run at
`thread_nice`, the training thread keeps its own; where the kernel refuses, nothing changes
and the log says so once.

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
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
        data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; two words each
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.capget(header, data) == 0, ctypes.get_errno()
        for word in (0, 1):  # CAP_SYS_NICE is bit 23 of the first word
            data[word] &= ~(1 << 23)
        assert libc.capset(header, data) == 0, ctypes.get_errno()
    from mindspeed_tft.control import ControlConfig, Controller, Processor

    def nice(tid):
        stat = open(f"/proc/self/task/{tid}/stat").read()
        return int(stat.rsplit(")", 1)[1].split()[16])

    def zmq_io_threads():
        return [int(t) for t in os.listdir("/proc/self/task")
                if open(f"/proc/self/task/{t}/comm").read().startswith("ZMQbg/IO")]

    def probe():  # may this process lower a thread's nice value at all?
        result = []
        def run():
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -1)
                result.append(True)
            except PermissionError:
                result.append(False)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        return result[0]

    allowed = probe()
    cfg = ControlConfig(port=0, thread_nice=-5, log_path=sys.argv[1])
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


def test_control_threads_run_at_the_configured_nice(tmp_path: Path) -> None:
    found, log = _run(tmp_path, drop=False)
    assert found["main"] == 0  # the training thread keeps its priority
    assert len(found["zmq_io"]) == 2  # the controller's context and the processor's
    want = -5 if found["allowed"] else 0
    assert (found["controller"], found["processor"], found["zmq_io"]) == (want, want,
                                                                          [want, want])
    assert ("needs CAP_SYS_NICE" in log) == (not found["allowed"])


def test_where_the_kernel_refuses_nothing_changes_and_the_log_says_so_once(
        tmp_path: Path) -> None:
    found, log = _run(tmp_path, drop=True)
    assert not found["allowed"]
    assert (found["main"], found["controller"], found["processor"], found["zmq_io"]) == (
        0, 0, 0, [0, 0])
    assert log.count("control-plane threads stay at nice 0: raising them to -5 needs "
                     "CAP_SYS_NICE") == 1, log
