"""The launcher (`tft-run`, the torchrun hook): real launchers, real worker processes.

The workers are `tests/programs/launcher_worker.py`: they record their environment and pid,
then obey orders given through files (exit with a code, stop). Every wait has a deadline and
every process a test starts is ended by the fixture that started it. The real trainer under
`tft-run`, with the controller in the launcher: test_worker_reboot.py (tests/README.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import free_port, wait_for

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "programs" / "launcher_worker.py"
BIN = Path(sys.executable).parent
#: the dump's folder the launcher checks (the test workers write nothing there)
SAVE = ["--save", str(Path(tempfile.gettempdir()) / "tft-launcher-tests")]
ARF = ["--enable-high-availability", "--enable-worker-reboot", *SAVE]
#: variables that differ between two launches of the same job by design
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID", "TFT_LAUNCHER_PID"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Launch:
    """One launcher process (tft-run or torchrun) and the files its workers write."""

    def __init__(self, out: Path, launcher: list[str], launcher_args: list[str],
                 worker_args: list[str], env: dict[str, str], log_name: str = "launcher.log"):
        self.out = out
        self.log = out / log_name
        self.argv = [*launcher, *launcher_args, str(WORKER), "--out", str(out), *worker_args]
        self._log_file = open(self.log, "a")  # noqa: SIM115 (closed in finish)
        self.proc = subprocess.Popen(self.argv, cwd=out, env=env, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher did not end within {timeout}s; log:\n"
                                 + self.text()[-4000:]) from None

    def finish(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log_file.close()


class Job:
    """The launches of one test in one folder, and everything they started."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.launches: list[Launch] = []
        self.master_port = free_port()
        self.env = base_env(out)

    def launch(self, *, nproc: int = 2, worker_args: list[str] | None = None,
               launcher: str = "tft-run", extra: list[str] | None = None,
               env: dict[str, str] | None = None, log_name: str = "launcher.log") -> Launch:
        cmd = [str(BIN / launcher)] if launcher in ("tft-run", "torchrun") else [launcher]
        args = ["--nproc-per-node", str(nproc), "--master-port", str(self.master_port),
                "--monitor-interval", "0.05", *(extra or [])]
        launch = Launch(self.out, cmd, args, worker_args or [], {**self.env, **(env or {})},
                        log_name)
        self.launches.append(launch)
        return launch

    def starts(self) -> list[dict[str, Any]]:
        found = []
        for path in self.out.glob("start.*.json"):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda r: r["t_ready"])

    def by_rank(self) -> dict[int, list[dict[str, Any]]]:
        ranks: dict[int, list[dict[str, Any]]] = {}
        for record in self.starts():
            ranks.setdefault(record["rank"], []).append(record)
        return ranks

    def wait_starts(self, counts: dict[int, int], timeout: float = 60.0) -> dict[int, list]:
        """Wait until each rank has been started `counts[rank]` times."""
        def ready() -> dict[int, list] | None:
            ranks = self.by_rank()
            ok = all(len(ranks.get(r, [])) >= n for r, n in counts.items())
            return ranks if ok else None
        return wait_for(ready, timeout, f"worker starts {counts} (log: {self.launches[-1].log})")

    def order(self, rank: int, code: int) -> None:
        tmp = self.out / f".exit.{rank}.tmp"
        tmp.write_text(str(code))
        os.replace(tmp, self.out / f"exit.{rank}")

    def stop(self) -> None:
        (self.out / "stop").touch()

    def cleanup(self) -> None:
        for launch in self.launches:
            launch.finish()
        marker = str(self.out)
        for entry in Path("/proc").iterdir():  # workers and spares live in their own sessions
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and int(entry.name) != os.getpid():
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def base_env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TFT_", "TTP_", "TORCHELASTIC_", "HIGH_AVAILABILITY"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "TORCHRUN")}
    env.update({
        "PATH": str(BIN) + os.pathsep + env.get("PATH", ""),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "TTP_PORT": str(free_port()),
        "TTP_LOG_PATH": str(out / "ttp_logs"),
    })
    return env


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path / "job")
    try:
        yield j
    finally:
        j.cleanup()


def launcher_env(record: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in record["env"].items() if k not in PER_LAUNCH}


# -- without high availability: torchrun ------------------------------------------------------
def test_without_high_availability_tft_run_is_torchrun(tmp_path: Path) -> None:
    jobs = {name: Job(tmp_path / name) for name in
            ("torchrun_ok", "tft_ok", "torchrun_fail", "tft_fail")}
    try:
        for name, j in jobs.items():
            if name.endswith("ok"):
                j.stop()  # every worker exits 0 right after recording itself
            j.launch(launcher="torchrun" if name.startswith("torchrun") else "tft-run",
                     worker_args=["--max-seconds", "60"])
        for name in ("torchrun_fail", "tft_fail"):
            jobs[name].wait_starts({0: 1, 1: 1})
            jobs[name].order(1, 3)  # rank 1 fails; the launcher stops rank 0
        codes = {name: j.launches[0].wait() for name, j in jobs.items()}
        assert codes["torchrun_ok"] == codes["tft_ok"] == 0, codes
        assert codes["torchrun_fail"] == codes["tft_fail"] == 1, codes
        ok = {name: {r: launcher_env(recs[0]) for r, recs in jobs[name].by_rank().items()}
              for name in ("torchrun_ok", "tft_ok")}
        assert sorted(ok["tft_ok"]) == [0, 1]
        assert ok["tft_ok"] == ok["torchrun_ok"]
        assert not any(k.startswith("TFT_") for env in ok["tft_ok"].values() for k in env)
        for name in ("torchrun_fail", "tft_fail"):
            j = jobs[name]
            text = j.launches[0].text()
            assert "exitcode  : 3" in text and "ChildFailedError" in text, text[-3000:]
            (rank0,) = j.by_rank()[0]
            assert not alive(rank0["pid"])  # stopped by the launcher, not by an order
            assert "[tft-run]" not in text
    finally:
        for j in jobs.values():
            j.cleanup()


def test_bad_launcher_settings_are_refused_clearly(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from mindspeed_tft.launcher.run import launch, parse_args

    monkeypatch.delenv("HIGH_AVAILABILITY", raising=False)
    script = [str(WORKER), "--out", "/nonexistent"]

    def refused(argv: list[str], env: dict[str, str] | None = None) -> str:
        with monkeypatch.context() as m:
            for key, value in (env or {}).items():
                m.setenv(key, value)
            assert launch(parse_args(argv)) == 2  # before anything is started
        return capsys.readouterr().err

    assert "TFT_MAX_WORKER_RESTARTS='lots' is not a whole number >= 0" in refused(
        [*script, *ARF], {"TFT_MAX_WORKER_RESTARTS": "lots"})
    assert ("--max-restarts 1 contradicts TFT_MAX_WORKER_RESTARTS=2: both set how many times "
            "this node's launcher restarts failed workers" in refused(
                ["--max-restarts", "1", *script, *ARF], {"TFT_MAX_WORKER_RESTARTS": "2"}))
    assert "--tft-spares-per-node 1 needs worker reboot" in refused(
        ["--tft-spares-per-node", "1", *script, "--enable-high-availability", *SAVE])
    assert "HIGH_AVAILABILITY='reboot': unknown mode 'reboot'" in refused(
        script, {"HIGH_AVAILABILITY": "reboot"})
    assert "TTP_ADDR='nowhere' is not an IPv4 or IPv6 address" in refused(
        [*script, *ARF], {"TTP_ADDR": "nowhere"})
    with pytest.raises(SystemExit):
        parse_args(["--tft-spares-per-node", "-1", *script])
    assert "'-1' is not a whole number >= 0" in capsys.readouterr().err


def test_max_restarts_means_what_torchrun_users_expect(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--max-restarts N` is the number of restarts of failed workers (with worker reboot each
    of the failed worker only; default 8 there, or TFT_MAX_WORKER_RESTARTS), and `--help`
    says so; torch's whole-group restarts are off under worker reboot."""
    from mindspeed_tft.launcher.options import get_args_parser, launch_options
    from mindspeed_tft.launcher.run import parse_args

    monkeypatch.delenv("HIGH_AVAILABILITY", raising=False)
    monkeypatch.delenv("TFT_MAX_WORKER_RESTARTS", raising=False)
    monkeypatch.delenv("PET_MAX_RESTARTS", raising=False)
    script = [str(WORKER), "--out", "/nonexistent", *SAVE]

    def budget(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
        options = launch_options(parse_args([*argv, *script]), env)
        return options.max_restarts, options.torch_max_restarts

    # without worker reboot: torchrun's own restarts of the whole group, its default 0
    assert budget([], {}) == (0, 0)
    assert budget(["--max-restarts", "3"], {}) == (3, 3)
    assert budget(["--max-restarts", "3"], {"HIGH_AVAILABILITY": "dump"}) == (3, 3)
    # with it: restarts of the failed workers only, torch's off
    assert budget(["--max-restarts", "0"], {"HIGH_AVAILABILITY": "recover"}) == (0, 0)
    assert budget(["--max-restarts", "3"], {"HIGH_AVAILABILITY": "recover"}) == (3, 0)
    assert budget([], {"HIGH_AVAILABILITY": "recover"}) == (8, 0)
    assert budget([], {"HIGH_AVAILABILITY": "recover", "TFT_MAX_WORKER_RESTARTS": "2"}) == (2, 0)
    assert budget(["--max-restarts", "2"], {"HIGH_AVAILABILITY": "recover",
                                            "TFT_MAX_WORKER_RESTARTS": "2"}) == (2, 0)
    help_text = " ".join(get_args_parser().format_help().split())
    assert ("Maximum number of restarts of failed workers this node's launcher makes before "
            "the job fails (torchrun's meaning). mindspeed-tft: with worker reboot" in help_text)


# -- worker reboot ----------------------------------------------------------------------------
def test_worker_reboot_restarts_only_the_failed_worker(job: Job) -> None:
    """torchrun's `--max-restarts N` is the budget: N restarts of failed workers, each of the
    failed worker only."""
    launch = job.launch(nproc=3, worker_args=ARF, extra=["--max-restarts", "2"])
    first = job.wait_starts({0: 1, 1: 1, 2: 1})
    pid0, pid1, pid2 = (first[r][0]["pid"] for r in (0, 1, 2))

    killed = time.time()
    os.kill(pid1, signal.SIGKILL)
    ranks = job.wait_starts({1: 2})
    again = ranks[1][1]
    assert again["pid"] != pid1
    env_before, env_after = first[1][0]["env"], again["env"]
    assert env_after.pop("TFT_WORKER_RESTART_COUNT") == "1"
    assert env_after.pop("TFT_PREDECESSOR_PID") == str(pid1)
    assert "TFT_WORKER_RESTART_COUNT" not in env_before
    assert env_after == env_before  # same RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*, TORCHELASTIC_*
    assert env_after["RANK"] == "1" and env_after["LOCAL_RANK"] == "1"
    assert env_after["WORLD_SIZE"] == "3"
    assert alive(pid0) and alive(pid2)  # the others were not stopped
    assert f"rank 1 (pid {pid1}) died (signal 9, SIGKILL); restarting it as rank 1 " \
           "(restart 1/2)" in launch.text()
    print(f"\ncold restart: death -> restarted worker ready {again['t_ready'] - killed:.2f}s")

    job.order(1, 76)  # the reboot exit code (a hung rank ordered to restart)
    ranks = job.wait_starts({1: 3})
    assert ranks[1][2]["env"]["TFT_WORKER_RESTART_COUNT"] == "2"
    assert "exited with code 76; restarting it as rank 1 (restart 2/2)" in launch.text()

    os.kill(pid2, signal.SIGKILL)  # the budget is spent
    wait_for(lambda: "are used up" in launch.text(), 20, "the budget message")
    assert (f"rank 2 (pid {pid2}) died (signal 9, SIGKILL); not restarting it: the 2 "
            "restart(s) allowed on this node (--max-restarts 2) are used up" in launch.text())
    job.order(1, 1)  # a failure: not restarted
    job.order(0, 0)  # done: not restarted
    assert launch.wait() == 1  # torchrun's failure
    text = launch.text()
    assert "exited with code 1; not restarting it" in text
    assert "ChildFailedError" in text and "exitcode  : -9" in text
    counts = {r: len(recs) for r, recs in job.by_rank().items()}
    assert counts == {0: 1, 1: 3, 2: 1}
    assert alive(pid0) is False


def test_dump_exit_code_ends_the_job_with_75(job: Job) -> None:
    job.order(0, 75)  # the dying-gasp checkpoint was saved
    job.order(1, 0)
    launch = job.launch(env={"HIGH_AVAILABILITY": "recover"},  # ARF from the environment
                        worker_args=SAVE)
    assert launch.wait() == 75
    text = launch.text()
    assert "exited with code 75 (dying-gasp checkpoint saved); not restarting it" in text
    assert "the job ended with a dying-gasp checkpoint" in text
    assert {r: len(recs) for r, recs in job.by_rank().items()} == {0: 1, 1: 1}


def test_controller_runs_in_node_0_launcher(job: Job) -> None:
    events = job.out / "events.jsonl"
    launch = job.launch(
        worker_args=[*ARF, "--processor", "--tft-events-file", str(events)],
        env={"TTP_HEARTBEAT_INTERVAL": "5", "TFT_MAX_WORKER_RESTARTS": "0"})

    def read() -> list[dict[str, Any]]:
        if not events.exists():
            return []
        return [json.loads(line) for line in events.read_text().splitlines() if line]

    wait_for(lambda: any(e["event"] == "state" and e["state"] == "NORMAL" for e in read()),
             60, "all ranks registered with the launcher's controller")
    ranks = job.by_rank()
    assert all(recs[0]["env"]["TFT_CONTROLLER_IN_LAUNCHER"] == "1" for recs in ranks.values())
    assert "controller for 2 ranks listening on 127.0.0.1:" in launch.text()
    killed = time.time()
    os.kill(ranks[1][0]["pid"], signal.SIGKILL)
    lost = wait_for(lambda: [e for e in read() if e["event"] == "fault_detected"], 10,
                    "fault_detected")[0]
    assert lost["kind"] == "lost" and lost["ranks"] == [1], lost
    assert "reported by its launcher" in lost["message"]
    # the launcher's report (the message), not heartbeats: these would take 15 s, and the
    # wait above ends after 10
    print(f"\nlauncher report: death -> fault_detected {lost['time'] - killed:.2f}s")
    job.stop()
    launch.wait()
    assert any(e["event"] == "state" and e["state"] == "FINAL" for e in read())


def test_report_process_exit_declares_the_rank_lost_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A launcher's report of a killed worker makes the rank lost at once (the incident comes
    within 5 s; heartbeats, every 5 s with 3 misses, would take 15 s); a clean exit, a rank
    that is not in the job and a second report of the same death add nothing."""
    from mindspeed_tft.control import ControlConfig, Controller, Features, Processor

    monkeypatch.setenv("TTP_LOG_PATH", str(tmp_path / "logs"))
    config = ControlConfig(port=free_port(), heartbeat_interval=5.0, log_path=str(tmp_path))
    ctrl = Controller(2, config, features=Features.from_names("dump,recover"))
    ctrl.start()
    processors = [Processor(r, 2, config, hard_exit=False) for r in (0, 1)]
    try:
        for p in processors:
            p.start(timeout=20)
        wait_for(lambda: ctrl.snapshot()["state"] == "NORMAL", 10, "NORMAL")
        ctrl.report_process_exit(1, 0)  # a clean exit is no fault
        ctrl.report_process_exit(5, -9)  # no such rank: ignored
        assert ctrl.snapshot()["incident"] is None
        ctrl.report_process_exit(1, -9)
        snap = wait_for(lambda: (s := ctrl.snapshot())["incident"] and s, 5, "an incident")
        assert snap["incident"]["faults"] == {"1": "lost"}
        assert snap["ranks"]["1"]["health"] == "lost"
        ctrl.report_process_exit(1, -9)  # already lost: nothing more
        # no update was done (lock step 0): the incident ends the job
        wait_for(lambda: ctrl.snapshot()["state"] == "FINAL", 10, "FINAL")
        faults = [r.getMessage() for r in caplog.records
                  if r.getMessage().startswith("fault on rank")]
        assert faults == ["fault on rank 1: lost (process killed by signal 9 (reported by its "
                          "launcher))"], faults
    finally:
        for p in processors:
            p.close()
        ctrl.stop()


def test_another_nodes_launcher_reports_an_exit_over_the_network(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A launcher without the controller (node 1's and above) reports a worker's end with
    one `exited` frame (`ExitReporter`): the rank is lost at once, as with node 0's
    in-process report (heartbeats, every 5 s with 3 misses, would take 15 s). A report
    about another process than the one registered for the rank changes nothing; without
    the job's token (or CURVE) nothing is sent (the controller would drop it), and keys it
    cannot read make a report fail, not the launcher."""
    from mindspeed_tft.control import ControlConfig, Controller, Features, Processor
    from mindspeed_tft.launcher.exit_report import ExitReporter

    monkeypatch.setenv("TTP_LOG_PATH", str(tmp_path / "logs"))
    config = ControlConfig(port=free_port(), heartbeat_interval=5.0, log_path=str(tmp_path),
                           job_token="t" * 32)
    ctrl = Controller(2, config, features=Features.from_names("dump,recover"))
    ctrl.start()
    processors = [Processor(r, 2, config, hard_exit=False) for r in (0, 1)]
    reporter = ExitReporter(config)
    try:
        for p in processors:
            p.start(timeout=20)
        wait_for(lambda: ctrl.snapshot()["state"] == "NORMAL", 10, "NORMAL")
        assert not ExitReporter(config.replace(job_token=None)).report(1, os.getpid(), -9)
        unreadable = config.replace(curve_server_key=str(tmp_path / "no.key"),
                                    curve_client_key=str(tmp_path / "no.key_secret"))
        assert not ExitReporter(unreadable).report(1, os.getpid(), -9)  # logged, not raised
        assert reporter.report(1, os.getpid() + 1, -9)  # not its registered process
        time.sleep(1.0)
        assert ctrl.snapshot()["incident"] is None
        reported = time.monotonic()
        assert reporter.report(1, os.getpid(), -9)
        snap = wait_for(lambda: (s := ctrl.snapshot())["incidents"] and s, 5, "an incident")
        print(f"\nreport over the network: report -> incident "
              f"{time.monotonic() - reported:.2f}s")
        assert snap["ranks"]["1"]["health"] == "lost" and snap["dropped"] == {}
        assert [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("fault on rank")] == [
            "fault on rank 1: lost (process killed by signal 9 (reported by its launcher))"]
    finally:
        reporter.close()
        for p in processors:
            p.close()
        ctrl.stop()


# -- the torchrun route -------------------------------------------------------------------------
def test_patch_torchrun_script(job: Job, tmp_path: Path) -> None:
    original = Path(shutil.which("torchrun", path=str(BIN)) or "")
    assert original.is_file()
    copy = tmp_path / "torchrun"
    shutil.copy2(original, copy)
    script = REPO / "scripts" / "patch_torchrun.sh"

    def run(action: str) -> str:
        done = subprocess.run(["bash", str(script), action], env={**job.env, "TORCHRUN": str(copy)},
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run("apply") == f"patched: {copy}"
    assert run("apply") == f"already patched: {copy}"
    patched = copy.read_text()
    assert patched.count("import mindspeed_tft.torchrun_adaptor") == 1
    assert patched.index("import mindspeed_tft.torchrun_adaptor") < patched.index(
        "from torch.distributed.run import main")
    assert run("status") == f"patched: {copy}"

    launch = job.launch(launcher=str(copy), worker_args=ARF)
    first = job.wait_starts({0: 1, 1: 1})
    os.kill(first[1][0]["pid"], signal.SIGKILL)
    ranks = job.wait_starts({1: 2})
    assert ranks[1][1]["env"]["RANK"] == "1"
    assert ranks[1][1]["env"]["TFT_WORKER_RESTART_COUNT"] == "1"
    assert alive(first[0][0]["pid"])
    assert "restarting it as rank 1 (restart 1/8)" in launch.text()
    job.stop()
    assert launch.wait() == 0

    assert run("revert") == f"reverted: {copy}"
    assert run("revert") == f"not patched: {copy}"
    assert copy.read_bytes() == original.read_bytes()


# -- a worker killed by a signal is dead before it is reaped ----------------------------------
def test_procfs_sees_a_killed_process_before_its_reap(monkeypatch: pytest.MonkeyPatch) -> None:
    from mindspeed_tft import procfs
    from mindspeed_tft.launcher import spare

    def child(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code])

    def zombie(proc: subprocess.Popen) -> None:  # ended, not reaped (no poll, no wait)
        wait_for(lambda: (s := procfs.read_stat(proc.pid)) is not None and s.ended, 10,
                 f"pid {proc.pid} a zombie")

    running = child("import time; time.sleep(60)")
    exited = child("raise SystemExit(3)")
    try:
        stat = procfs.read_stat(running.pid)
        assert stat is not None and not stat.exiting and not stat.ended
        assert procfs.killed_returncode(running.pid) is None
        assert not procfs.has_ended(running.pid)
        # what the controller watches (plain torchrun): the process of that start time
        start = stat.start
        assert procfs.process_state(running.pid, start) == (True, None)
        assert procfs.process_state(running.pid, start + 1) == (False, None)  # another one
        zombie(exited)  # an exit code is no signal: the launcher waits for the reap
        assert procfs.killed_returncode(exited.pid) is None and procfs.has_ended(exited.pid)
        exited_start = procfs.read_stat(exited.pid).start
        assert procfs.process_state(exited.pid, exited_start) == (False, None)

        # the replacement of a dead worker waits for it only on an accelerator
        monkeypatch.setenv(spare.PREDECESSOR_PID_ENV, str(running.pid))
        assert spare.wait_for_assignment() is None  # CPU: at once,
        assert running.poll() is None  # with its predecessor still there
        os.kill(running.pid, signal.SIGKILL)
        zombie(running)
        assert procfs.killed_returncode(running.pid) == -signal.SIGKILL
        assert procfs.process_state(running.pid, start) == (False, -signal.SIGKILL)
        assert running.returncode is None  # what the launcher saw before Popen could
    finally:
        for proc in (running, exited):
            proc.kill()
            proc.wait(10)
    assert running.returncode == -signal.SIGKILL and exited.returncode == 3
    assert procfs.killed_returncode(running.pid) is None and procfs.has_ended(running.pid)
    assert procfs.process_state(running.pid, start) == (False, None)  # reaped: gone


def test_a_registration_says_where_its_process_runs() -> None:
    """`procfs.identity()` (a REGISTER's `proc`) lets a controller in the same pid namespace
    watch that pid; any other namespace, pid or a malformed value is not watched."""
    from mindspeed_tft import procfs

    here, me = procfs.namespace(), os.getpid()
    proc = procfs.identity()
    assert here is not None and proc == f"{here}:{me}:{procfs.read_stat(me).start}"
    assert procfs.local_start(proc, me, here) == procfs.read_stat(me).start
    assert procfs.local_start(proc, me + 1, here) is None  # a claim for another pid
    assert procfs.local_start(proc, me, here + "0") is None  # another namespace
    assert procfs.local_start(proc, me, None) is None  # a controller that does not watch
    for bad in (None, "", "x", f"{here}:{me}:", f"{here}:{me}:12a", f"{here}:{me}"):
        assert procfs.local_start(bad, me, here) is None, bad


# -- warm spares --------------------------------------------------------------------------------
def test_spare_takes_over_a_failed_worker(job: Job) -> None:
    launch = job.launch(worker_args=ARF, extra=["--tft-spares-per-node", "1"])
    first = job.wait_starts({0: 1, 1: 1}, timeout=120)
    def ready_spares() -> list[int]:
        return [int(pid) for pid in re.findall(r"warm spare pid (\d+) is ready", launch.text())]

    (spare_pid,) = wait_for(ready_spares, 120, "a ready spare")
    assert spare_pid not in (first[0][0]["pid"], first[1][0]["pid"])

    killed = time.time()
    os.kill(first[0][0]["pid"], signal.SIGKILL)
    ranks = job.wait_starts({0: 2})
    taken = ranks[0][1]
    spare_seconds = taken["t_ready"] - killed
    assert taken["pid"] == spare_pid and taken["spare"] is True
    assert taken["t_start"] < killed  # it was started (and imported everything) before
    env = taken["env"]
    assert env.pop("TFT_WORKER_RESTART_COUNT") == "1"
    assert env.pop("TFT_PREDECESSOR_PID") == str(first[0][0]["pid"])
    assert not any(k.startswith("TFT_SPARE") for k in env)
    assert env == first[0][0]["env"]
    assert f"handing rank 0 to warm spare pid {spare_pid}" in launch.text()

    # the next failure comes before the new spare is ready: a cold restart
    killed = time.time()
    os.kill(first[1][0]["pid"], signal.SIGKILL)
    ranks = job.wait_starts({1: 2}, timeout=120)
    cold = ranks[1][1]
    cold_seconds = cold["t_ready"] - killed
    assert cold["spare"] is False
    print(f"\ndeath -> replacement ready (a worker that imports torch): "
          f"warm spare {spare_seconds:.2f}s, cold restart {cold_seconds:.2f}s")
    assert spare_seconds < cold_seconds

    (second,) = wait_for(lambda: [p for p in ready_spares() if p != spare_pid], 120,
                         "a new spare, ready")
    job.stop()
    assert launch.wait() == 0
    assert not alive(second)  # ended with the launcher


# -- a replaced node ----------------------------------------------------------------------------
def test_replacement_launcher_rejoins_a_running_job(job: Job) -> None:
    def node(rank: int, log: str) -> Launch:
        return job.launch(worker_args=[*ARF, "--store"], log_name=log, extra=[
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"])

    node0, node1 = node(0, "node0.log"), node(1, "node1.log")
    first = job.wait_starts({r: 1 for r in range(4)})
    assert [first[r][0]["env"]["GROUP_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    # one controller, in node 0's launcher; every worker on every node knows it is there
    assert "controller for 4 ranks" in node0.text() and "controller for" not in node1.text()
    assert all(first[r][0]["env"]["TFT_CONTROLLER_IN_LAUNCHER"] == "1" for r in range(4))
    os.killpg(node1.proc.pid, signal.SIGKILL)  # the node goes: its launcher and its workers
    node1.proc.wait(10)
    for r in (2, 3):
        os.kill(first[r][0]["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(first[2][0]["pid"]) and not alive(first[3][0]["pid"]), 10,
             "node 1's workers gone")

    replacement = node(1, "node1-replacement.log")
    ranks = job.wait_starts({2: 2, 3: 2})
    for r in (2, 3):
        before, after = first[r][0]["env"], ranks[r][1]["env"]
        assert after.pop("TFT_WORKER_RESTART_COUNT") == "1"
        assert after.pop("TFT_LAUNCHER_PID") == str(replacement.proc.pid)
        per_process = ("TORCHELASTIC_ERROR_FILE", "TFT_LAUNCHER_PID")
        assert {k: v for k, v in after.items() if k not in per_process} == {
            k: v for k, v in before.items() if k not in per_process}
        assert after["RANK"] == str(r) and after["WORLD_SIZE"] == "4"
    assert "node 1 rejoins a running job" in replacement.text()
    assert alive(first[0][0]["pid"]) and alive(first[1][0]["pid"])  # node 0 untouched

    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", job.master_port, is_master=False, timeout=timedelta(seconds=10))
    assert int(store.add("tftest/checkin/2", 0)) == 2  # both incarnations reached the store
    job.stop()
    assert node0.wait() == 0
    assert replacement.wait() == 0
