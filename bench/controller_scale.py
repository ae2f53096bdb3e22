"""Controller scale benchmark: one real controller, K simulated processors.

    python bench/controller_scale.py [--ks 1000,4000,16000,32000] [--curve] [--interval 2]

For each K, a real controller (`python -m mindspeed_tft.control.controller`, its own
process) serves K simulated processors: real DEALER sockets spread over a few processes
(each connecting from its own loopback source address, 127.0.0.2, .3, ...), all connecting
and registering at once, then heartbeating at the configured interval (staggered evenly over
the interval, as independent ranks would be). With `--curve` every connection is a CURVE
handshake against the controller's ZAP handler (keys made for the run) and every REGISTER
carries the job's token. We measure

- register_s: from starting the simulators until the controller's `NORMAL` (every rank
  registered): the registration storm;
- register_ctrl_cpu_s: the controller's CPU seconds in that storm; register_floor_s: the
  controller's and the simulators' CPU seconds in it over this machine's cores, the least
  wall time the storm could take here (both ends of every handshake share the machine);
- listen_drops: connections the kernel dropped meanwhile because the controller's listen
  queue was full (TcpExt ListenDrops; its length is min(backlog, net.core.somaxconn), 4096
  here): each such client retries its SYN a second later;
- cpu_cores: the controller process's CPU time over a steady-state window / wall time;
- rss_per_rank_kib: the controller's resident memory after the storm minus before it,
  per rank;
- report_to_action_s: rank k-2 sends an error report; time until the first action (the
  `hold` that starts every incident, sent to every rank in rank order) reaches rank 0, the
  first addressed;
- report_to_every_s: the same until the hold reached every rank (each simulator notes
  when each of its ranks read it);
- report_to_hold_event_s: the same until the controller's `hold` action event, written as
  it starts sending the hold (extra column: its reaction time);
- report_to_stop_s: the same until the `stop` reaches rank 0: the hold's round trip to every
  rank (each simulated rank answers its hold at once) and the stop's first send (extra
  column; the simulators' own answering is part of it);
- hold_round_s: the same round as the controller's events show it, from its `hold` to its
  `stop` action event (extra column);
- silent_to_decision_s: another rank stops heartbeating; time from the last message it sent
  (a heartbeat, or its answer to the hold) to the controller's `fault_detected` event for it
  (declared lost).

Goals (`goal_failures`): register_s <= 10 at every K; at 16k and above cpu_cores <= 0.25;
silent_to_decision_s <= 3 x interval + 1 and report_to_every_s <= 0.5 at every K. A K whose
controller would need more open files than this machine's hard limit (RLIMIT_NOFILE) allows
is not run: its row says so. Prints a table; the last line is JSON:
{"rows": [{"k":..,"curve":..,"register_s":..,"cpu_cores":..,...}], "failures": [...]}
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgpack  # noqa: E402
import zmq  # noqa: E402

from mindspeed_tft.control.wire.protocol import MsgType, encode  # noqa: E402
from mindspeed_tft.control.wire.transport import new_routing_id, raise_fd_limit  # noqa: E402
from mindspeed_tft.events import read_events_if_any  # noqa: E402

#: the job's token every simulated REGISTER carries (the controller requires it)
TOKEN = "controller-scale-bench-token-0123456789"
#: open files a controller needs beyond one per rank (its own sockets, logs, margin)
FD_RESERVE = 512
#: how an order to hold shows in a frame (the action's name, a msgpack short string)
HOLD = b"\xa4hold"
#: simulated ranks per process at most: each DEALER costs its process two files (the TCP
#: connection and its mailbox), under this machine's open-files limit
MAX_PER_PROC = 8000


@dataclass
class Options:
    """What one run of the bench uses (the command line's flags)."""

    interval: float = 2.0
    misses: int = 3
    procs: int = 4
    window: float = 10.0
    curve: bool = False
    #: the register/steady-state phases' bounds (s)
    register_timeout: float = 120.0


def _dealer(ctx: zmq.Context, port: int, source: str, curve: dict[str, bytes] | None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, new_routing_id())
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        s.setsockopt(zmq.CURVE_SERVERKEY, curve["server"])
        s.setsockopt(zmq.CURVE_PUBLICKEY, curve["public"])
        s.setsockopt(zmq.CURVE_SECRETKEY, curve["secret"])
    s.connect(f"tcp://{source}:0;127.0.0.1:{port}")
    return s


class _Sim:
    """One simulator process' state: a DEALER per rank and what they heard."""

    def __init__(self, conn: Any, ranks: list[int], world: int, socks: list[zmq.Socket],
                 interval: float, misses: int) -> None:
        self.conn, self.ranks, self.socks = conn, ranks, socks
        self.n = len(ranks)
        self.interval = interval
        self.world = world
        self.seq = [0] * self.n
        self.registered = [False] * self.n
        self.registered_at = [0.0] * self.n  # when its REGISTER was last sent
        self.silent: set[int] = set()
        self.last_sent = [0.0] * self.n  # a heartbeat or a result: the controller hears it
        self.heard = [0.0] * self.n  # like a Processor: ask for an ack when not heard a while
        self.ack_after = interval * misses / 2
        self.watching: set[int] = set()
        self.hold_at: dict[int, float] = {}  # rank index -> when its hold was read
        #: after the report every rank answers its hold: the sockets' ZMQ_FDs in epoll, so a
        #: turn costs what is ready, not a zmq_poll over thousands of sockets
        self.sel: selectors.EpollSelector | None = None
        #: sockets that may hold input the epoll did not announce (a send may have taken
        #: their wake-up: libzmq's FD signals edges)
        self.dirty: set[int] = set()
        #: holds read this turn, answered at its end (as a processor answers from its own
        #: thread, not as it reads): (rank index, frame)
        self.answers: list[tuple[int, bytes]] = []

    def register(self, i: int) -> None:
        """Send rank i's REGISTER (queued until its connection is up)."""
        self.seq[i] += 1
        self.socks[i].send(encode(MsgType.REGISTER, self.ranks[i], self.seq[i], {
            "world_size": self.world, "pid": os.getpid(), "host": "sim", "token": TOKEN}),
            zmq.NOBLOCK)
        self.registered_at[i] = time.monotonic()

    def heartbeat(self, i: int, now: float) -> None:
        """Rank i's turn: a heartbeat, or, like a processor not registered yet, its
        REGISTER again (once an interval)."""
        if self.sel is None and i not in self.watching:
            while True:  # throw the acks (and actions) away
                try:
                    frame = self.socks[i].recv(zmq.NOBLOCK)
                    self.heard[i] = now
                    if not self.registered[i]:
                        self.registered[i] = msgpack.unpackb(frame)[1] == MsgType.REGISTERED
                except zmq.Again:
                    break
        if i in self.silent:
            return
        if not self.registered[i]:
            if now - self.registered_at[i] >= self.interval:
                self.register(i)
            return
        self.seq[i] += 1
        try:
            self.socks[i].send(encode(MsgType.HEARTBEAT, self.ranks[i], self.seq[i],
                                      {"step": 1, "status": "updated",
                                       "ack": now - self.heard[i] >= self.ack_after},
                                      check=False), zmq.NOBLOCK)
            self.last_sent[i] = time.time()
        except zmq.Again:
            pass
        if self.sel is not None:
            self.dirty.add(i)

    def read_actions(self, ready: list[int]) -> None:
        """Read what the watched ranks (or, after the report, the ranks `ready` names and
        the dirty ones) were sent: each until it has nothing more."""
        if self.sel is None:
            indices: Any = list(self.watching)
        else:
            indices, self.dirty = self.dirty.union(ready), set()
        for idx in indices:
            while True:
                try:
                    frame = self.socks[idx].recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if self.sel is not None and idx not in self.watching:
                    if HOLD in frame:  # noted as it is read, answered after this turn's reads
                        self.hold_at.setdefault(idx, time.time())
                        self.answers.append((idx, frame))
                    continue
                self._on_frame(idx, frame)
        for idx, frame in self.answers:
            self._on_frame(idx, frame)
        self.answers.clear()

    def wait(self, seconds: float) -> list[int]:
        """Sleep up to `seconds`; after the report, wake at once for input (its ranks)."""
        if self.sel is None:
            time.sleep(seconds)
            return []
        return [key.data for key, _ in self.sel.select(seconds if not self.dirty else 0)]

    def _on_frame(self, idx: int, frame: bytes) -> None:
        # the simulated rank reads its orders as cheaply as it can (msgpack alone: the
        # controller's frames need no checking here), so the bench's 2 cores go to the
        # controller rather than to the simulation
        _, mtype, _, _, payload = msgpack.unpackb(frame)
        if mtype != MsgType.ACTION:
            return
        name, now = payload["name"], time.time()
        if idx in self.watching:
            self.conn.send(("action", self.ranks[idx], now, name))
            if name == "stop" or self.sel is None:
                self.watching.discard(idx)
        if name == "hold" and self.sel is not None:
            self.hold_at.setdefault(idx, now)
            self.seq[idx] += 1
            self.socks[idx].send(encode(MsgType.RESULT, self.ranks[idx], self.seq[idx], {
                "id": payload["id"], "action": "hold", "ok": True,
                "result": {"step": 1, "status": "updated"}}, check=False), zmq.NOBLOCK)
            self.last_sent[idx] = time.time()

    def command(self, cmd: tuple[Any, ...]) -> bool:
        """Run one command from the bench; False: stop."""
        name = cmd[0]
        if name == "stop":
            return False
        idx = cmd[1] if len(cmd) > 1 else None
        if name == "arm" and self.sel is None:  # every rank answers its hold from now on
            self.sel = selectors.EpollSelector()
            for i, sock in enumerate(self.socks):
                self.sel.register(sock.getsockopt(zmq.FD), selectors.EVENT_READ, i)
            self.dirty = set(range(self.n))
        if name in ("watch", "report"):
            while True:  # from now on, the actions this rank gets are reported
                try:
                    self.socks[idx].recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
            self.watching.add(idx)
        if name == "watch":
            self.conn.send(("watching",))
        elif name == "arm":
            self.conn.send(("armed",))
        elif name == "report":
            self.seq[idx] += 1
            sent = time.time()
            self.socks[idx].send(encode(MsgType.REPORT, self.ranks[idx], self.seq[idx], {
                "kind": "comm", "message": "HCCL OP RETRY FAILED (bench)", "step": 1,
                "status": "updated"}))
            self.conn.send(("reported", sent))
        elif name == "silence":
            self.silent.add(idx)
            self.conn.send(("silenced", self.last_sent[idx]))
        elif name == "holds":
            self.conn.send(("holds", len(self.hold_at), max(self.hold_at.values(), default=0.0)))
        return True


def simulate(conn: Any, port: int, ranks: list[int], world: int, interval: float,
             misses: int, source: str = "127.0.0.1",
             curve: dict[str, bytes] | None = None) -> None:
    """One simulator process: a DEALER per rank (all connecting at once), registration,
    staggered heartbeats, and the bench's commands over `conn`."""
    n = len(ranks)
    raise_fd_limit(2 * n + 256)
    ctx = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, n + 64)
    socks = [_dealer(ctx, port, source, curve) for _ in range(n)]
    sim = _Sim(conn, ranks, world, socks, interval, misses)
    for i in range(n):  # all at once
        sim.register(i)
    conn.send(("connected", n))
    start = time.monotonic()
    i = rnd = 0
    ready: list[int] = []
    while True:
        now = time.monotonic()
        due = start + (rnd + i / n) * interval
        budget = 2000
        while due <= now and budget:
            budget -= 1
            sim.heartbeat(i, now)
            i += 1
            if i == n:
                i, rnd = 0, rnd + 1
            due = start + (rnd + i / n) * interval
        sim.read_actions(ready)
        if conn.poll(0) and not sim.command(conn.recv()):
            break
        ready = sim.wait(max(0.0, min(0.005, start + (rnd + i / n) * interval - time.monotonic())))
    for s in socks:
        s.close(0)
    ctx.term()


class SimPipe:
    """The bench's end of one simulator's pipe: answers are told apart from the action
    notes the simulator sends for its watched ranks at any time (kept in `notes`)."""

    def __init__(self, proc: Any, conn: Any, first_rank: int) -> None:
        self.proc, self.conn, self.first_rank = proc, conn, first_rank
        self.notes: list[tuple[int, float, str]] = []

    def _take(self, msg: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if msg[0] == "action":
            self.notes.append(tuple(msg[1:]))  # type: ignore[arg-type]
            return None
        return msg

    def ask(self, cmd: tuple[Any, ...], answer: str, timeout: float = 60.0) -> tuple[Any, ...]:
        """Send `cmd` and wait for the reply tagged `answer` (notes are kept)."""
        self.conn.send(cmd)
        return self.expect(answer, timeout)

    def expect(self, answer: str, timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while self.conn.poll(max(0.0, deadline - time.monotonic())):
            msg = self._take(self.conn.recv())
            if msg is None:
                continue
            if msg[0] != answer:
                raise RuntimeError(f"simulator answered {msg!r}, expected {answer!r}")
            return msg
        raise TimeoutError(f"simulator gave no {answer!r} within {timeout}s")

    def poll_notes(self) -> None:
        while self.conn.poll(0):
            msg = self._take(self.conn.recv())
            if msg is not None:
                raise RuntimeError(f"unexpected message from a simulator: {msg!r}")


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def listen_drops() -> int:
    """This host's TcpExt ListenDrops: connections the kernel dropped because a listen
    queue was full (min(backlog, net.core.somaxconn)); the client retries after a second."""
    try:
        with open("/proc/net/netstat") as f:
            lines = [line.split() for line in f if line.startswith("TcpExt:")]
        return int(dict(zip(lines[0], lines[1], strict=True))["ListenDrops"])
    except (OSError, KeyError, IndexError, ValueError):
        return -1


def wait_event(path: Path, pred: Any, timeout: float, proc: Any = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in read_events_if_any(path):
            if pred(e):
                return e
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the controller exited with code {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError("event not seen")


def fd_room(k: int) -> str | None:
    """Why a controller of k ranks cannot run here (None: it can)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and k + FD_RESERVE > hard:
        return (f"a controller of {k} ranks needs {k + FD_RESERVE} open files; this "
                f"machine's hard limit (RLIMIT_NOFILE) is {hard}")
    return None


def _curve_env(run: Path) -> tuple[dict[str, str], dict[str, bytes]]:
    """Keys for the run: the controller's environment and the simulators' keys."""
    from mindspeed_tft.control.wire.keys import generate_keys
    from mindspeed_tft.control.wire.transport import load_cert

    env = generate_keys(str(run / "keys"))
    proc = env["processor"]
    public, secret = load_cert(proc["TTP_CURVE_CLIENT_KEY"])
    server, _ = load_cert(proc["TTP_CURVE_SERVER_KEY"])
    assert secret is not None
    return env["controller"], {"server": server, "public": public, "secret": secret}


def _start_controller(k: int, opts: Options, run: Path) -> tuple[subprocess.Popen[bytes],
                                                                  dict[str, bytes] | None]:
    ev, ready = run / "events.jsonl", run / "ready.json"
    env = {key: v for key, v in os.environ.items() if not key.startswith(("TTP_", "TFT_"))}
    env.update({"PYTHONPATH": str(REPO), "TTP_LOG_PATH": str(run), "TTP_LOG_LEVEL": "WARNING",
                "TTP_JOB_TOKEN": TOKEN})
    curve = None
    if opts.curve:
        ctrl_env, curve = _curve_env(run)
        env.update(ctrl_env)
    ctrl = subprocess.Popen(
        [sys.executable, "-m", "mindspeed_tft.control.controller", "--world-size", str(k),
         "--port", "0", "--interval", str(opts.interval), "--misses", str(opts.misses),
         "--features", "dump,retry", "--events", str(ev), "--ready-file", str(ready),
         "--register-timeout", str(opts.register_timeout + 60)],
        env=env, cwd=run, stdout=subprocess.DEVNULL, stderr=open(run / "controller.err", "w"))
    deadline = time.monotonic() + 30
    while not ready.exists():
        if ctrl.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("controller did not start; see " + str(run / "controller.err"))
        time.sleep(0.05)
    return ctrl, curve


def _start_sims(k: int, opts: Options, port: int,
                curve: dict[str, bytes] | None) -> list[SimPipe]:
    nproc = max(1, min(max(opts.procs, math.ceil(k / MAX_PER_PROC)), math.ceil(k / 1000)))
    per = math.ceil(k / nproc)
    ctx = mp.get_context("fork")
    sims = []
    for p in range(nproc):
        ranks = list(range(p * per, min(k, (p + 1) * per)))
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=simulate, daemon=True, args=(
            child, port, ranks, k, opts.interval, opts.misses, f"127.0.0.{2 + p}", curve))
        proc.start()
        sims.append(SimPipe(proc, parent, ranks[0]))
    return sims


def _incident(k: int, sims: list[SimPipe], ev: Path) -> dict[str, float]:
    """Rank k-2 reports an error: when the hold reached rank 0, rank k-2 and every rank, and
    when the stop reached rank 0."""
    first, last = sims[0], sims[-1]
    first.ask(("watch", 0), "watching")
    for s in sims:  # every simulator answers holds from now on (set up before the report)
        s.ask(("arm",), "armed")
    _, sent = last.ask(("report", (k - 2) - last.first_rank), "reported")
    want = {(0, "hold"), (0, "stop"), (k - 2, "hold")}
    got: dict[tuple[int, str], float] = {}
    deadline = time.monotonic() + 60
    while not want <= got.keys():
        for s in (first, last):
            s.poll_notes()
            for rank, at, name in s.notes:
                got.setdefault((rank, name), at)
        if time.monotonic() > deadline:
            raise RuntimeError(f"no hold and stop after the report (got {sorted(got)})")
        time.sleep(0.005)
    every, held = 0.0, 0
    for s in sims:
        _, n, at = s.ask(("holds",), "holds")
        held, every = held + n, max(every, at)
    if held != k:
        raise RuntimeError(f"the hold reached {held} of {k} ranks")
    acts = {e["action"]: e["time"] for e in read_events_if_any(ev) if e["event"] == "action"}
    return {"report_to_hold_event_s": acts["hold"] - sent,
            "report_to_action_s": got[0, "hold"] - sent,
            "report_to_all_s": got[k - 2, "hold"] - sent,
            "report_to_every_s": every - sent,
            "report_to_stop_s": got[0, "stop"] - sent,
            "hold_round_s": acts["stop"] - acts["hold"]}


def run_one(k: int, opts: Options, tmp: Path) -> dict[str, Any]:
    """One K: start a controller and the simulators, measure, stop everything."""
    why = fd_room(k)
    if why is not None:
        return {"k": k, "curve": opts.curve, "skipped": why}
    run = tmp / f"k{k}{'-curve' if opts.curve else ''}"
    run.mkdir()
    ev = run / "events.jsonl"
    ctrl, curve = _start_controller(k, opts, run)
    sims: list[SimPipe] = []
    try:
        port = json.loads((run / "ready.json").read_text())["port"]
        rss0 = proc_rss_kib(ctrl.pid)
        drops0 = listen_drops()
        t_reg, ctrl_cpu0 = time.time(), proc_cpu(ctrl.pid)
        sims = _start_sims(k, opts, port, curve)
        for s in sims:
            s.expect("connected", 120)
        normal = wait_event(ev, lambda e: e["event"] == "state" and e["state"] == "NORMAL",
                            opts.register_timeout, ctrl)
        registered_s = normal["time"] - t_reg
        storm_cpu = _storm_cpu(ctrl.pid, ctrl_cpu0, sims)
        drops = listen_drops() - drops0
        time.sleep(opts.interval * 1.5)  # steady state: every rank heartbeats
        c0, w0 = proc_cpu(ctrl.pid), time.monotonic()
        time.sleep(opts.window)
        cpu = (proc_cpu(ctrl.pid) - c0) / (time.monotonic() - w0)
        rss = proc_rss_kib(ctrl.pid)
        row: dict[str, Any] = {"k": k, "curve": opts.curve, "register_s": round(registered_s, 2),
                               "cpu_cores": round(cpu, 3),
                               "rss_mib": round(rss / 1024, 1),
                               "rss_per_rank_kib": round((rss - rss0) / k, 2),
                               "listen_drops": drops, **storm_cpu}
        row.update({name: round(v, 4) for name, v in _incident(k, sims, ev).items()})
        # rank k-1 going silent: time from its last message until it is declared lost
        last = sims[-1]
        _, last_sent = last.ask(("silence", (k - 1) - last.first_rank), "silenced")
        lost = wait_event(ev, lambda e: e["event"] == "fault_detected" and e["ranks"] == [k - 1],
                          opts.interval * (opts.misses + 3) + 30, ctrl)
        row["silent_to_decision_s"] = round(lost["time"] - last_sent, 3)
        row["_procs"] = len(sims)
        return row
    finally:
        if ctrl.poll() is None:
            ctrl.kill()
        ctrl.wait()
        _stop_sims(sims)


def _storm_cpu(ctrl_pid: int, ctrl_cpu0: float, sims: list[SimPipe]) -> dict[str, float]:
    """The registration storm's CPU seconds: the controller's, and what the machine's
    cores could at best do with the controller's and the simulators' together."""
    ctrl = proc_cpu(ctrl_pid) - ctrl_cpu0
    both = ctrl + sum(proc_cpu(s.proc.pid) for s in sims)
    return {"register_ctrl_cpu_s": round(ctrl, 2),
            "register_floor_s": round(both / (os.cpu_count() or 1), 2)}


def _stop_sims(sims: list[SimPipe]) -> None:
    for s in sims:
        try:
            s.conn.send(("stop",))
        except OSError:
            pass
    for s in sims:
        s.proc.join(20)
        if s.proc.is_alive():
            s.proc.kill()
            s.proc.join(5)


def goal_failures(row: dict[str, Any], opts: Options) -> list[str]:
    """The goals a row misses (none for a skipped row: it says why it did not run)."""
    if "skipped" in row:
        return []
    k, fails = row["k"], []
    goals = [("register_s", 10.0), ("silent_to_decision_s", 3 * opts.interval + 1),
             ("report_to_every_s", 0.5)]
    if k >= 16000:
        goals.append(("cpu_cores", 0.25))
    for name, limit in goals:
        if row[name] > limit:
            fails.append(f"k={k}{' curve' if row['curve'] else ''}: {name} {row[name]} > {limit:g}")
    return fails


COLUMNS = ("register_s", "register_ctrl_cpu_s", "register_floor_s", "listen_drops", "cpu_cores", "rss_per_rank_kib", "silent_to_decision_s",
           "report_to_hold_event_s", "report_to_action_s", "report_to_every_s",
           "report_to_stop_s", "hold_round_s")


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'k':>6} {'curve':>5} " + " ".join(f"{c:>{max(9, len(c))}}" for c in COLUMNS)]
    for r in rows:
        head = f"{r['k']:>6} {str(r['curve']):>5} "
        if "skipped" in r:
            lines.append(head + "skipped: " + r["skipped"])
            continue
        lines.append(head + " ".join(f"{r[c]:>{max(9, len(c))}}" for c in COLUMNS))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="1000,4000,16000,32000", help="comma list of rank counts")
    ap.add_argument("--curve", action="store_true", help="CURVE keys and handshakes")
    ap.add_argument("--interval", type=float, default=2.0, help="heartbeat interval (s)")
    ap.add_argument("--misses", type=int, default=3, help="missed heartbeats before lost")
    ap.add_argument("--procs", type=int, default=4, help="simulator processes (at least)")
    ap.add_argument("--window", type=float, default=10.0, help="CPU measuring window (s)")
    args = ap.parse_args()
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    if not ks or min(ks) < 3:
        ap.error("--ks: every K must be at least 3")
    opts = Options(interval=args.interval, misses=args.misses, procs=args.procs,
                   window=args.window, curve=args.curve)
    rows = []
    with tempfile.TemporaryDirectory(prefix="controller_scale_") as tmp:
        for k in ks:
            rows.append(run_one(k, opts, Path(tmp)))
            print(json.dumps(rows[-1]), file=sys.stderr)
    failures = [f for r in rows for f in goal_failures(r, opts)]
    print(table(rows))
    print(f"goals: register_s <= 10, report_to_every_s <= 0.5, silent_to_decision_s <= "
          f"{3 * opts.interval + 1:g}; at 16k and above cpu_cores <= 0.25")
    print("\n".join(failures) if failures else "every goal met")
    print(json.dumps({"rows": [{k: v for k, v in r.items() if not k.startswith("_")}
                               for r in rows], "failures": failures}))


if __name__ == "__main__":
    main()
