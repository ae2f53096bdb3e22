"""A stranger with the job's rendezvous store: bad values in the keys the job reads, and
thousands of idle connections. Every value read from the store is parsed with a type and
bounds (a refusal is a `store_value_refused` event, never an exception), and the launcher
and ranks raise their open-files limit to the hard limit.

The multi-process test runs a 4-rank job under `tft-run` with a soft open-files limit of
1,024 (the hard one above it) while another user (`nobody`, where this runs as root)
holds 3,000 idle connections to its store and rewrites every key the job reads with bad
values every 0.1 s; rank 3 (the logging rank) is killed in its update of step 7. The job is
repaired as without them: exit 0, every loss of the fault-free run, every iteration logged.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mindspeed_tft import events
from mindspeed_tft.control.wire.transport import FdReserve, raise_fd_limit
from mindspeed_tft.launcher.agent import parse_node_record
from tests.jobs import (
    HA_ARGS,
    REPO,
    STANDARD,
    TINY_SCRIPT,
    JobResult,
    start_tiny_job,
    tiny_job_env,
)


@pytest.fixture
def emitted(monkeypatch):
    seen = []
    monkeypatch.setattr(events, "emit", lambda event, rank, **f: seen.append((event, f)) or {})
    monkeypatch.setattr(events, "_refused", set())
    return seen


class OneKeyStore:
    def __init__(self, value: bytes) -> None:
        self.value = value

    def check(self, keys):
        return True

    def get(self, key):
        return self.value


@pytest.mark.parametrize("value", [b"abc", b"999999", b"15", b"-1", b"", b"9" * 5000,
                                   b"\xff\x00", b"1e3", b" 7"])
def test_a_bad_logged_iteration_is_refused_not_raised(value, emitted):
    log = events.IterationLog(OneKeyStore(value))
    log.limit = 14
    assert log.highest_logged() == 0
    ((event, fields),) = emitted
    assert event == "store_value_refused" and fields["key"] == events.LOGGED_KEY
    assert fields["allowed"] == "a whole number from 0 to 14"
    assert len(fields["value"]) < 80  # a long value is cut


def test_a_good_logged_iteration_is_taken(emitted):
    log = events.IterationLog(OneKeyStore(b"14"))
    log.limit = 14
    assert log.highest_logged() == 14 and emitted == []


class DictStore:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value


def test_with_the_job_token_a_forged_value_in_bounds_is_refused(emitted, monkeypatch):
    """With the job's token the logged iteration carries its HMAC: a replacement logging rank
    takes its predecessor's value, and refuses a plausible forgery (13 of 14 would silence
    its log lines up to 13)."""
    monkeypatch.setattr(events, "_rank", lambda: 0)
    store = DictStore()
    old = events.IterationLog(store)
    old.key, old.limit = b"the job's token", 14
    old.record(1, logger=True, loss=1.0)
    old.record(2, logger=True, loss=1.0)
    assert store.values[events.LOGGED_KEY].startswith(b"2:")
    new = events.IterationLog(store)
    new.key, new.limit = b"the job's token", 14
    assert new.highest_logged() == 2
    store.set(events.LOGGED_KEY, "13")  # a stranger, in bounds
    assert new.highest_logged(refresh=True) == 2
    stranger = events.IterationLog(store)  # another key: another job's, or a guess
    stranger.key, stranger.limit = b"a guess", 14
    store.set(events.LOGGED_KEY, stranger._stored(13))
    assert new.highest_logged(refresh=True) == 2
    refused = [f for e, f in emitted if e == "store_value_refused"]
    assert len(refused) == 2 and "with the job's HMAC" in refused[0]["allowed"]


GOOD_RECORD = {"local_world_size": 2, "master_addr": "10.0.0.1", "master_port": 29500,
               "restart_count": 0, "workers": [[0, 2, 2, 4, 4], [1, 3, 3, 4, 4]]}


@pytest.mark.parametrize("change", [
    {"workers": []}, {"workers": [[0, 1, 2]]}, {"workers": [[0, -1, 2, 4, 4]]},
    {"workers": [[0, "1", 2, 4, 4]]}, {"local_world_size": True}, {"master_port": 2**40},
    {"master_addr": 7}, {"master_addr": ""}, "not json", None])
def test_a_bad_node_record_is_refused(change, emitted):
    if isinstance(change, dict):
        raw = json.dumps({**GOOD_RECORD, **change}).encode()
    else:
        raw = b"{" if change is None else change.encode()
    assert parse_node_record(raw, "mindspeed_tft/launcher/node/1") is None
    assert [e for e, _ in emitted] == ["store_value_refused"]
    assert parse_node_record(json.dumps(GOOD_RECORD).encode(), "k") == GOOD_RECORD


def test_open_files_raised_to_the_hard_limit_and_a_reserve_given_back():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        assert raise_fd_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard != resource.RLIM_INFINITY:
            assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    reserve = FdReserve(8)
    fds = len(os.listdir("/proc/self/fd"))
    assert reserve.release() == 8 and len(os.listdir("/proc/self/fd")) == fds - 8
    assert reserve.refill() == 8 and reserve.releases == 1
    reserve.close()


def _as_nobody():
    """preexec_fn: become `nobody` (a different user from the job's)."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def stranger(cwd) -> dict:
    """How to start a process of another user: as root, `nobody` running the system's Python
    of this version with this venv's packages on its path (the venv's own interpreter lies
    under root's home); otherwise this user (the test then says so)."""
    import sysconfig

    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "PYTHONPATH": f"{sysconfig.get_paths()['purelib']}{os.pathsep}{REPO}"}
    if os.getuid() == 0 and os.access(system, os.X_OK):
        probe = subprocess.run([system, "-c", "import torch.distributed"], env=env, cwd=cwd,
                               preexec_fn=_as_nobody, capture_output=True, timeout=60)
        if probe.returncode == 0:
            return {"python": system, "env": env, "preexec_fn": _as_nobody, "user": "nobody"}
    return {"python": sys.executable, "env": env, "preexec_fn": None, "user": "this user"}


@pytest.mark.multiproc
def test_bad_store_values_and_3000_store_connections_change_nothing(reference_job, tmp_path):
    config = {"layout": "dp4", **STANDARD}
    reference = reference_job(ha_args=HA_ARGS, **config)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    wrapper = tmp_path / "low_limit.sh"  # the soft limit many hosts start with
    wrapper.write_text(f'ulimit -Sn 1024\nexec bash "{TINY_SCRIPT}" "$@"\n')
    job_env = tiny_job_env(run_dir, inject="kill:rank=3,step=7,phase=optimizer",
                           ha_args=f"{HA_ARGS} --enable-worker-reboot", launcher="tft-run",
                           **config)
    # a folder the stranger can write (pytest's own are its user's alone)
    shared = Path(tempfile.mkdtemp(prefix="tft-hostile-store-"))
    shared.chmod(0o777)
    figures = shared / "figures.json"
    other = stranger(shared)
    job = start_tiny_job(job_env, script=wrapper)
    print(f"the stranger runs as {other['user']}")
    hostile = subprocess.Popen(
        [other["python"], "-m", "tests.hostile_store", job_env["MASTER_PORT"], "300",
         str(figures), "--connections", "3000", "--write"],
        cwd=shared, env=other["env"], preexec_fn=other["preexec_fn"])
    try:
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
        hostile.terminate()  # it writes its figures on the way out
        hostile.wait(30)
        report_text = figures.read_text() if figures.exists() else "{}"
        shutil.rmtree(shared, ignore_errors=True)
    (run_dir / "output.log").write_text(output)
    result = JobResult(job.returncode, output, run_dir,
                       events.read_events_if_any(run_dir / "events.jsonl"))
    assert job.returncode == 0, result.describe()
    report = json.loads(report_text)
    assert report["held"] == 3000 and report["writes"] > 100, report
    (killed,) = result.named("fault_injected")
    (repaired,) = result.named("repaired")
    around = [n for t, n in report["samples"] if killed["time"] - 1 <= t <= repaired["time"]]
    assert around and min(around) >= 3000, around
    # repaired as without them: every loss, every iteration logged (a refused store value
    # may make the new logging rank log again an iteration its predecessor logged: never
    # one less)
    assert result.losses() == reference.losses()
    logged = [e["iteration"] for e in result.named("iteration")]
    assert sorted(set(logged)) == list(range(1, config["train_iters"] + 1)), logged
    refused = {e["key"] for e in result.named("store_value_refused")}
    assert events.LOGGED_KEY in refused, result.describe()
    assert "Traceback" not in output, result.describe()


def test_the_controller_gives_its_reserve_back_when_out_of_files_and_backs_off():
    """libzmq reports EMFILE on an accept (and retries at once): the controller closes its
    reserved files so that the accept succeeds, once, and takes them back after a back-off
    that doubles while the process keeps running out."""
    import errno
    import struct

    import zmq

    from mindspeed_tft.control.controller.admission import Admission
    from mindspeed_tft.control.controller.sockets import (
        OUT_OF_FILES_BACKOFF,
        ControllerSockets,
    )
    from mindspeed_tft.control.wire.config import ControlConfig

    def event(kind: int, value: int) -> list[bytes]:
        return [struct.pack("<HI", kind, value), b"tcp://127.0.0.1:1"]

    sockets = ControllerSockets(ControlConfig(), Admission(8, 8, 1.0))
    sockets.reserve = reserve = FdReserve(4)
    try:
        files = len(os.listdir("/proc/self/fd"))
        sockets.now = 100.0
        for _ in range(1000):  # libzmq's retries: one release, no more
            sockets.on_monitor(event(zmq.EVENT_ACCEPT_FAILED, errno.EMFILE))
        assert len(os.listdir("/proc/self/fd")) == files - 4 and reserve.releases == 1
        assert sockets.connections["accept_failed"] == 1000
        sockets.now = 100.0 + OUT_OF_FILES_BACKOFF / 2  # too early: still given back
        sockets.on_monitor(event(zmq.EVENT_DISCONNECTED, 999_999))
        assert len(os.listdir("/proc/self/fd")) == files - 4
        sockets.now = 100.0 + OUT_OF_FILES_BACKOFF
        sockets.on_monitor(event(zmq.EVENT_DISCONNECTED, 999_999))
        assert len(os.listdir("/proc/self/fd")) == files  # taken back
        sockets.on_monitor(event(zmq.EVENT_ACCEPT_FAILED, errno.ENFILE))  # again: released
        assert reserve.releases == 2
    finally:
        reserve.close()
        sockets.term()
