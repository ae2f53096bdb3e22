"""Test harness: a real controller and real processors, each in its own process, on loopback.

`Job` starts controllers (`mindspeed_tft.control.controller.main`, port 0, announced through
a ready file) and `ctl_worker` ranks, reads the controller's events file, polls with
deadlines, and kills whatever is left at the end. It can act as a launcher: `restart(rank)`
starts the rank again after it died (ARF).

Every controller and rank is its own OS process, forked from a multiprocessing forkserver
that has the modules imported already, so a process starts in milliseconds instead of
paying the interpreter start-up on this small, shared machine. `Proc` gives them the
`subprocess.Popen` calls the tests use (poll, wait, send_signal, returncode).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from mindspeed_tft.events import read_events
from tests.jobs import wait_for

REPO = Path(__file__).resolve().parents[2]
PRELOAD = ["mindspeed_tft.control", "mindspeed_tft.control.controller.controller",
           "tests.control.ctl_worker", "tests.control.ctl_harness"]
_ctx: Any = None


def _mp() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def _child(kind: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """Entry of a forked controller or rank: own environment, folder and log file."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code: object = 1
    try:
        if kind == "controller":
            from mindspeed_tft.control.controller.controller import main as controller_main
            code = controller_main(argv)
        else:
            from tests.control.ctl_worker import main as worker_main
            code = worker_main(argv)
    except SystemExit as e:
        code = e.code
    finally:  # the status a signal-free exit has (multiprocessing's rule), where Proc reads it
        status = 0 if code is None else code if isinstance(code, int) else 1
        Path(log + ".rc").write_text(str(status))
    sys.exit(status)


class Proc:
    """A forked process with the part of `subprocess.Popen` the tests use.

    Its exit status comes from the forkserver through a pipe; where that read fails
    (multiprocessing answers 255 then; seen once: a controller whose events said exit 75
    read as 255) the status the child wrote to `<log>.rc` stands in."""

    def __init__(self, kind: str, argv: list[str], env: dict[str, str], cwd: Path,
                 log: Path) -> None:
        self._rc_file = Path(str(log) + ".rc")
        self._rc_file.unlink(missing_ok=True)
        self._p = _mp().Process(target=_child, args=(kind, argv, env, str(cwd), str(log)),
                                daemon=True)
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        code = self._p.exitcode
        if code == 255 and self._rc_file.exists():
            return int(self._rc_file.read_text())
        return code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        code = self.returncode
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for child processes: no inherited TTP_*/events settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TTP_", "TFT_")) and k not in ("CONTROLLER_ADDR", "PROCESSOR_ADDR")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


class Job:
    """One controller (plus optional backups) and `world` worker processes."""

    def __init__(self, tmp: Path, world: int, *, features: str = "dump", interval: float = 0.15,
                 misses: int = 4, action_limit: float = 5.0, addr: str = "127.0.0.1",
                 env: dict[str, str] | None = None) -> None:
        self.tmp = Path(tmp)
        self.world = world
        self.features = features
        self.interval = interval
        self.misses = misses
        self.action_limit = action_limit
        self.addr = addr
        self.env = clean_env({"TTP_LOG_PATH": str(self.tmp / "logs"), **(env or {})})
        self.events_file = self.tmp / "events.jsonl"
        self.coll = self.tmp / "coll"
        self.coll.mkdir(parents=True, exist_ok=True)
        self.controllers: list[Proc] = []
        self.ports: list[int] = []
        self.workers: dict[int, Proc] = {}
        self.incarnation: dict[int, int] = {}
        self.worker_args: dict[int, dict[str, Any]] = {}
        self.procs: list[Proc] = []

    # -- processes ------------------------------------------------------------------------
    def start_controller(self, *, role: str = "active", port: int = 0, backups: str = "",
                         index: int = 0, active_port: int | None = None,
                         events: Path | None = None, snapshot: Path | None = None,
                         extra: list[str] | None = None) -> int:
        ready = self.tmp / f"ready-{role}-{index}-{len(self.controllers)}.json"
        cmd = ["--world-size", str(self.world), "--addr", self.addr, "--port", str(port),
               "--role", role, "--backup-index", str(index), "--features", self.features,
               "--interval", str(self.interval), "--misses", str(self.misses),
               "--action-time-limit", str(self.action_limit), "--register-timeout", "30",
               "--events", str(events or self.events_file), "--ready-file", str(ready)]
        if snapshot is not None:
            cmd += ["--snapshot", str(snapshot)]
        cmd += extra or []
        env = dict(self.env)
        if backups:
            env["TTP_BACKUP_ADDRS"] = backups
        if role == "backup":
            assert active_port is not None
            env["TTP_ADDR"] = self.addr
            env["TTP_PORT"] = str(active_port)
        p = Proc("controller", cmd, env, self.tmp,
                 self.tmp / f"controller-{len(self.controllers)}.err")
        self.controllers.append(p)
        self.procs.append(p)
        info = wait_for(lambda: self._read_json(ready) or (p.poll() is not None and {"dead": 1}),
                        15, what="controller ready file")
        assert "port" in info, f"controller exited early ({p.returncode})"
        self.ports.append(info["port"])
        return info["port"]

    def start_worker(self, rank: int, port: int | None = None, **opts: Any) -> Proc:
        args = dict(self.worker_args.get(rank, {}))
        args.update(opts)
        self.worker_args[rank] = {k: v for k, v in args.items() if k != "fault"}
        n = self.incarnation.get(rank, -1) + 1
        self.incarnation[rank] = n
        port = port if port is not None else self.ports[0]
        cmd = ["--rank", str(rank), "--world", str(self.world),
               "--port", str(port), "--addr", self.addr, "--interval", str(self.interval),
               "--misses", str(self.misses), "--action-limit", str(self.action_limit),
               "--coll", str(self.coll), "--out", str(self.out_file(rank, n))]
        for k, v in args.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        p = Proc("worker", cmd, self.env, self.tmp, self.tmp / f"worker-{rank}-{n}.err")
        self.workers[rank] = p
        self.procs.append(p)
        return p

    def restart(self, rank: int, **opts: Any) -> Proc:
        """Start `rank` again (same rank, no fault), as an ARF launcher would."""
        return self.start_worker(rank, **opts)

    def out_file(self, rank: int, incarnation: int | None = None) -> Path:
        n = self.incarnation.get(rank, 0) if incarnation is None else incarnation
        return self.tmp / f"worker-{rank}-{n}.jsonl"

    def records(self, rank: int, incarnation: int | None = None) -> list[dict[str, Any]]:
        path = self.out_file(rank, incarnation)
        if not path.exists():
            return []
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def cleanup(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    # -- observation --------------------------------------------------------------------
    def events(self, path: Path | None = None) -> list[dict[str, Any]]:
        path = path or self.events_file
        try:
            return read_events(str(path))
        except (OSError, json.JSONDecodeError):
            return []

    def states(self, path: Path | None = None) -> list[str]:
        return [e["state"] for e in self.events(path) if e["event"] == "state"]

    def strategies(self, path: Path | None = None) -> list[str]:
        return [e["strategy"] for e in self.events(path) if e["event"] == "strategy"]

    def wait_state(self, state: str, timeout: float, path: Path | None = None) -> None:
        wait_for(lambda: state in self.states(path), timeout, what=f"state {state}")

    def wait_event(self, pred: Any, timeout: float, path: Path | None = None,
                   what: str = "event") -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            return next((e for e in self.events(path) if pred(e)), None)
        return wait_for(find, timeout, what=what)

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any] | None:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return None

    def snapshot(self, path: Path) -> dict[str, Any] | None:
        return self._read_json(path)
