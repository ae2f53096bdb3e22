"""Bounded lifetimes: no process of a job outlives what it depends on.

- a worker (and a warm spare) dies with its launcher (`tft-run` killed by SIGKILL; a plain
  torchrun's worker ties itself to its launcher as the plugin does);
- a rank with no active controller for `controller_lost_timeout` exits with code 77;
- `abandon()` shuts down the connections of the job's process groups and leaves a user's
  own TCP connection alone.

Real launchers, real processes, real signals and sockets; every wait has a deadline.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.control.ctl_harness import Job as ControlJob
from tests.jobs import wait_for
from tests.test_launcher import ARF, Job, alive

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path / "job")
    try:
        yield j
    finally:
        j.cleanup()


def _gone_within(pids: list[int], timeout: float) -> float:
    """Seconds until none of `pids` is alive (AssertionError after `timeout`)."""
    start = time.monotonic()
    wait_for(lambda: not any(alive(p) for p in pids), timeout,
             f"processes {[p for p in pids if alive(p)]} gone")
    return time.monotonic() - start


def test_workers_and_spares_die_with_a_killed_tft_run(job: Job) -> None:
    launch = job.launch(worker_args=ARF, extra=["--tft-spares-per-node", "1"])
    first = job.wait_starts({0: 1, 1: 1}, timeout=120)
    spare = wait_for(lambda: re.findall(r"warm spare pid (\d+) is ready", launch.text()), 120,
                     "a ready spare")
    pids = [first[0][0]["pid"], first[1][0]["pid"], int(spare[0])]
    assert all(alive(p) for p in pids)
    assert all(first[r][0]["env"]["TFT_LAUNCHER_PID"] == str(launch.proc.pid) for r in (0, 1))
    os.kill(launch.proc.pid, signal.SIGKILL)  # the launcher alone: workers are in own sessions
    seconds = _gone_within(pids, 30)
    print(f"\ntft-run SIGKILLed: its 2 workers and 1 spare gone after {seconds:.2f}s")
    assert seconds < 30


def test_plain_torchrun_workers_tie_themselves_to_it(job: Job) -> None:
    launch = job.launch(launcher="torchrun", worker_args=["--tie"])
    first = job.wait_starts({0: 1, 1: 1}, timeout=120)
    pids = [first[0][0]["pid"], first[1][0]["pid"]]
    assert "TFT_LAUNCHER_PID" not in first[0][0]["env"]
    os.kill(launch.proc.pid, signal.SIGKILL)
    seconds = _gone_within(pids, 30)
    print(f"\ntorchrun SIGKILLed: its 2 workers gone after {seconds:.2f}s")
    assert seconds < 30


def test_ranks_exit_77_when_the_controller_is_gone_for_good(tmp_path: Path) -> None:
    lost_timeout = 5.0
    job = ControlJob(tmp_path, 2, interval=0.15, misses=4)
    try:
        job.start_controller()
        for r in range(2):
            job.start_worker(r, steps=100000, step_time=0.01, lost_timeout=lost_timeout)
        job.wait_state("NORMAL", 20)
        killed = time.monotonic()
        job.controllers[0].send_signal(signal.SIGKILL)  # no backup: nobody takes charge
        codes = {r: job.workers[r].wait(lost_timeout + 15) for r in range(2)}
        seconds = time.monotonic() - killed
        assert codes == {0: 77, 1: 77}
        for r in range(2):  # said why (a training thread stuck in its fake all-reduce is
            # ended by the exit grace, as for an exit order)
            assert "no active controller for" in (tmp_path / f"worker-{r}-0.err").read_text()
        print(f"\ncontroller SIGKILLed: both ranks exited 77 after {seconds:.2f}s "
              f"(TTP_CONTROLLER_LOST_TIMEOUT={lost_timeout:g})")
        assert lost_timeout <= seconds < lost_timeout + 5
    finally:
        job.cleanup()


_ABANDON_WORKER = textwrap.dedent("""
    import os, socket, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from mindspeed_tft.recovery import collectives

    rank, echo_port = int(sys.argv[1]), int(sys.argv[2])
    collectives.install_connection_tracking()
    collectives.install_abandonable_waits()
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    group = dist.new_group([0, 1])
    user = socket.create_connection(("127.0.0.1", echo_port), timeout=10)  # the user's own
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [2.0] * 4
    tracked = collectives.group_connections()
    assert tracked, "no process-group connection recorded"
    if rank == 0:
        closed = collectives.abandon("test", [int(os.environ["MASTER_PORT"])])
        try:
            dist.all_reduce(t, group=group)
            print("all_reduce after abandon did not fail", flush=True)
            sys.exit(3)
        except collectives.CollectivesAbandoned:
            pass
        user.sendall(b"still here")
        reply = user.recv(100)
        print(f"closed={closed} tracked={len(tracked)} reply={reply.decode()}", flush=True)
        user.close()
        os._exit(0)
    try:  # rank 1: its peer's connections went down under it
        dist.all_reduce(t, group=group)
    except Exception as error:
        print(f"rank 1 collective failed: {type(error).__name__}", flush=True)
    user.close()
    os._exit(0)
""")


def test_abandon_leaves_a_users_own_connection_alone(tmp_path: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    echo_port = server.getsockname()[1]
    script = tmp_path / "abandon_worker.py"
    script.write_text(_ABANDON_WORKER)
    from tests.jobs import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(echo_port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        conns = [server.accept()[0] for _ in range(2)]
        # echo whatever comes, until both users close their connection
        import selectors

        sel = selectors.DefaultSelector()
        for c in conns:
            sel.register(c, selectors.EVENT_READ)
        open_conns = len(conns)
        deadline = time.monotonic() + 60
        while open_conns and time.monotonic() < deadline:
            for key, _ in sel.select(0.5):
                data = key.fileobj.recv(100)
                if data:
                    key.fileobj.sendall(data)
                else:
                    sel.unregister(key.fileobj)
                    open_conns -= 1
        outputs = [p.communicate(timeout=30)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()
    assert [p.returncode for p in procs] == [0, 0], outputs
    found = re.search(r"closed=(\d+) tracked=(\d+) reply=(.*)", outputs[0])
    assert found, outputs[0]
    assert found.group(3) == "still here"  # the user's connection survived the abandon
    assert int(found.group(1)) >= 1


def test_controller_lost_timeout_is_checked_against_a_failover() -> None:
    from mindspeed_tft.control.wire.config import ControlConfig, ControlConfigError

    assert ControlConfig.from_env({}).controller_lost_timeout == 120
    assert ControlConfig.from_env({"TTP_CONTROLLER_LOST_TIMEOUT": "30"}).controller_lost_timeout == 30
    # slow heartbeats: the default grows to a failover's time instead of cutting it short
    slow = {"TTP_HEARTBEAT_INTERVAL": "10", "TTP_HEARTBEAT_MISSES": "5"}
    assert ControlConfig.from_env(slow).controller_lost_timeout == 3 * 10 * 5 + 2 * 10
    for value, words in (("10", "shorter than a failover to a backup controller (22s"),
                         ("abc", "is not a number in [5, 3600]"),
                         ("4000", "is not a number in [5, 3600]")):
        with pytest.raises(ControlConfigError, match=re.escape(
                f"TTP_CONTROLLER_LOST_TIMEOUT={value!r}")) as error:
            ControlConfig.from_env({"TTP_CONTROLLER_LOST_TIMEOUT": value})
        assert words in str(error.value)
