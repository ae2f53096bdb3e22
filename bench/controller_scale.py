"""Controller scale benchmark: one real controller, K simulated processors.

    python bench/controller_scale.py [--ks 1000,4000,16000] [--interval 2] [--procs 4]

For each K, a real controller (`python -m mindspeed_tft.control.controller`, its own
process) serves K simulated processors: real DEALER sockets spread over a few processes,
each registering and heartbeating at the configured interval (staggered evenly over the
interval, as independent ranks would be). After every rank registered we measure

- cpu_cores: the controller process's CPU time over a steady-state window / wall time;
- report_to_action_s: rank k-2 sends an error report; time until the first action (the
  `hold` that starts every incident, sent to every rank in rank order) reaches rank 0, the
  first addressed;
- report_to_all_s: the same until the hold reaches rank k-2 itself, near the end of the
  broadcast (extra column);
- report_to_stop_s: the same until the `stop` reaches rank 0: the hold's round trip to every
  rank (each simulated rank answers its hold at once) and the stop's first send (extra
  column; the simulators' own answering is part of it);
- hold_round_s: the same round as the controller's events show it, from its `hold` to its
  `stop` action event (extra column);
- silent_to_decision_s: another rank stops heartbeating; time from the last message it sent
  (a heartbeat, or its answer to the hold) to the controller's `fault_detected` event for it
  (declared lost).

Goals at 16k: cpu_cores <= 0.5, silent_to_decision_s <= 3 x interval + 1,
report_to_action_s <= 0.5. Prints a table; the last line is JSON:
{"rows": [{"k":..,"cpu_cores":..,"silent_to_decision_s":..,"report_to_action_s":..}]}
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from mindspeed_tft.control.protocol import MsgType, decode, encode  # noqa: E402
from mindspeed_tft.control.transport import new_routing_id, raise_fd_limit  # noqa: E402


def simulate(conn: Any, port: int, ranks: list[int], world: int, interval: float,
             misses: int) -> None:
    """One simulator process: a DEALER per rank, registration, staggered heartbeats."""
    n = len(ranks)
    raise_fd_limit(4 * n + 256)
    ctx = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, n + 64)
    socks = []
    for i in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, new_routing_id())
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)
        if i % 500 == 499:
            time.sleep(0.05)  # do not flood the listen backlog
    seq = [1] * n
    index = {id(sock): i for i, sock in enumerate(socks)}
    for i, r in enumerate(ranks):
        s = socks[i]
        s.send(encode(MsgType.REGISTER, r, 1, {"world_size": world, "pid": os.getpid(),
                                                "host": "sim"}), zmq.NOBLOCK)
    conn.send(("connected", n))
    silent: set[int] = set()
    last_sent = [0.0] * n  # a heartbeat or a result: the controller hears the rank then
    heard = [0.0] * n  # like a Processor: ask for an ack only when not heard for a while
    ack_after = interval * misses / 2
    watching: set[int] = set()
    poller: zmq.Poller | None = None  # after the report: every rank answers its hold
    start = time.monotonic()
    i = 0
    rnd = 0
    while True:
        now = time.monotonic()
        due = start + (rnd + i / n) * interval
        budget = 2000
        while due <= now and budget:
            budget -= 1
            if i not in watching and poller is None:
                while True:  # throw the acks (and actions) away
                    try:
                        socks[i].recv(zmq.NOBLOCK)
                        heard[i] = now
                    except zmq.Again:
                        break
            if i not in silent:
                seq[i] += 1
                try:
                    socks[i].send(encode(MsgType.HEARTBEAT, ranks[i], seq[i],
                                         {"step": 1, "status": "updated",
                                          "ack": now - heard[i] >= ack_after}, check=False),
                                  zmq.NOBLOCK)
                    last_sent[i] = time.time()
                except zmq.Again:
                    pass
            i += 1
            if i == n:
                i, rnd = 0, rnd + 1
            due = start + (rnd + i / n) * interval
        ready = ([index[id(sock)] for sock, _ in poller.poll(0)] if poller is not None
                 else list(watching))
        for idx in ready:
            while True:
                try:
                    frame = socks[idx].recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = decode(frame)
                if msg.type != MsgType.ACTION:
                    continue
                name = msg.payload["name"]
                if idx in watching:
                    conn.send(("action", ranks[idx], time.time(), name))
                    if name == "stop" or poller is None:
                        watching.discard(idx)
                if name == "hold" and poller is not None:
                    seq[idx] += 1
                    socks[idx].send(encode(MsgType.RESULT, ranks[idx], seq[idx], {
                        "id": msg.payload["id"], "action": "hold", "ok": True,
                        "result": {"step": 1, "status": "updated"}}), zmq.NOBLOCK)
                    last_sent[idx] = time.time()
        if conn.poll(0):
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            idx = cmd[1]
            if cmd[0] == "report" and poller is None:
                poller = zmq.Poller()
                for sock in socks:
                    poller.register(sock, zmq.POLLIN)
            if cmd[0] in ("watch", "report") and idx is not None:
                while True:  # from now on, the actions this rank gets are reported
                    try:
                        socks[idx].recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                watching.add(idx)
            if cmd[0] == "watch":
                conn.send(("watching",))
            elif cmd[0] == "report" and idx is not None:
                seq[idx] += 1
                sent = time.time()
                socks[idx].send(encode(MsgType.REPORT, ranks[idx], seq[idx], {
                    "kind": "comm", "message": "HCCL OP RETRY FAILED (bench)", "step": 1,
                    "status": "updated"}))
                conn.send(("reported", sent))
            elif cmd[0] == "silence":
                silent.add(idx)
                conn.send(("silenced", last_sent[idx]))
        nxt = start + (rnd + i / n) * interval
        wait = max(0.0, min(0.005, nxt - time.monotonic()))
        if poller is not None:
            poller.poll(wait * 1000)  # wake at once for an action (read on the next turn)
        else:
            time.sleep(wait)
    for s in socks:
        s.close(0)
    ctx.term()


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def events(path: Path) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def wait_event(path: Path, pred: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events(path):
            if pred(e):
                return e
        time.sleep(0.05)
    raise TimeoutError("event not seen")


def run_one(k: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    run = tmp / f"k{k}"
    run.mkdir()
    ev, ready = run / "events.jsonl", run / "ready.json"
    env = {key: v for key, v in os.environ.items() if not key.startswith(("TTP_", "TFT_"))}
    env.update({"PYTHONPATH": str(REPO), "TTP_LOG_PATH": str(run), "TTP_LOG_LEVEL": "ERROR"})
    ctrl = subprocess.Popen(
        [sys.executable, "-m", "mindspeed_tft.control.controller", "--world-size", str(k),
         "--port", "0", "--interval", str(args.interval), "--misses", str(args.misses),
         "--features", "dump,retry", "--events", str(ev), "--ready-file", str(ready)],
        env=env, cwd=run, stdout=subprocess.DEVNULL, stderr=open(run / "controller.err", "w"))
    sims: list[tuple[Any, Any]] = []
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if ctrl.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("controller did not start; see " + str(run / "controller.err"))
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        nproc = max(1, min(args.procs, math.ceil(k / 1000)))
        per = math.ceil(k / nproc)
        ctx = mp.get_context("fork")
        t_reg = time.monotonic()
        for p in range(nproc):
            ranks = list(range(p * per, min(k, (p + 1) * per)))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=simulate, args=(child, port, ranks, k, args.interval, args.misses),
                               daemon=True)
            proc.start()
            sims.append((proc, parent))
        for _, c in sims:
            if not c.poll(120):
                raise RuntimeError("a simulator did not connect")
            c.recv()
        wait_event(ev, lambda e: e["event"] == "state" and e["state"] == "NORMAL", 300)
        registered_s = time.monotonic() - t_reg
        time.sleep(args.interval * 1.5)  # steady state: every rank heartbeats
        c0, w0 = proc_cpu(ctrl.pid), time.monotonic()
        time.sleep(args.window)
        cpu = (proc_cpu(ctrl.pid) - c0) / (time.monotonic() - w0)
        # an error report from rank k-2. The controller sends the stop to every rank in rank
        # order: rank 0 gets the first action sent, rank k-2 one of the last
        _, first_conn = sims[0]
        _, last_conn = sims[-1]
        base = (len(sims) - 1) * per
        first_conn.send(("watch", 0))
        first_conn.recv()
        for _, c in sims[:-1]:  # every simulator answers holds from now on
            c.send(("report", None))
        last_conn.send(("report", (k - 2) - base))
        _, sent = last_conn.recv()
        got: dict[tuple[int, str], float] = {}
        deadline = time.monotonic() + 60
        while not {(0, "hold"), (0, "stop"), (k - 2, "hold")} <= got.keys():
            for c in {id(first_conn): first_conn, id(last_conn): last_conn}.values():
                while c.poll(0):
                    _, rank, at, name = c.recv()
                    got.setdefault((rank, name), at)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no hold and stop after the report (got {sorted(got)})")
            time.sleep(0.005)
        report_to_action, report_to_last = got[0, "hold"] - sent, got[k - 2, "hold"] - sent
        report_to_stop = got[0, "stop"] - sent
        # the hold round as the controller saw it: its `hold` and `stop` action events
        acts = {e["action"]: e["time"] for e in events(ev) if e["event"] == "action"}
        hold_round = acts["stop"] - acts["hold"]
        # rank k-1 going silent: time from its last heartbeat until it is declared lost
        last_conn.send(("silence", (k - 1) - base))
        _, last_sent = last_conn.recv()
        lost = wait_event(ev, lambda e: e["event"] == "fault_detected" and e["ranks"] == [k - 1],
                          args.interval * (args.misses + 3) + 30)
        silent_to_decision = lost["time"] - last_sent
        return {"k": k, "cpu_cores": round(cpu, 3),
                "silent_to_decision_s": round(silent_to_decision, 3),
                "report_to_action_s": round(report_to_action, 4),
                "report_to_all_s": round(report_to_last, 4),
                "report_to_stop_s": round(report_to_stop, 4),
                "hold_round_s": round(hold_round, 4),
                "_register_s": round(registered_s, 2), "_procs": nproc}
    finally:
        if ctrl.poll() is None:
            ctrl.kill()
        ctrl.wait()
        for _proc, c in sims:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for proc, _ in sims:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="1000,4000,16000", help="comma list of processor counts")
    ap.add_argument("--interval", type=float, default=2.0, help="heartbeat interval (s)")
    ap.add_argument("--misses", type=int, default=3, help="missed heartbeats before lost")
    ap.add_argument("--procs", type=int, default=4, help="simulator processes (at most)")
    ap.add_argument("--window", type=float, default=10.0, help="CPU measuring window (s)")
    args = ap.parse_args()
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    if not ks or min(ks) < 3:
        ap.error("--ks: every K must be at least 3")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and max(ks) + 512 > hard:
        print(f"warning: open-files hard limit {hard} is below {max(ks) + 512}; the controller "
              "may not accept every connection", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="controller_scale_") as tmp:
        for k in ks:
            rows.append(run_one(k, args, Path(tmp)))
            r = rows[-1]
            print(f"k={k}: registered in {r['_register_s']}s over {r['_procs']} processes",
                  file=sys.stderr)
    goal_silent = 3 * args.interval + 1
    print(f"{'k':>7} {'cpu_cores':>10} {'silent_to_decision_s':>21} {'report_to_action_s':>19} "
          f"{'report_to_all_s':>16} {'report_to_stop_s':>17} {'hold_round_s':>13}")
    for r in rows:
        print(f"{r['k']:>7} {r['cpu_cores']:>10.3f} {r['silent_to_decision_s']:>21.3f} "
              f"{r['report_to_action_s']:>19.4f} {r['report_to_all_s']:>16.4f} "
              f"{r['report_to_stop_s']:>17.4f} {r['hold_round_s']:>13.4f}")
    print(f"goals at 16k: cpu_cores <= 0.5, silent_to_decision_s <= {goal_silent:g}, "
          "report_to_action_s <= 0.5")
    print(json.dumps({"rows": [{k: v for k, v in r.items() if not k.startswith("_")}
                               for r in rows]}))


if __name__ == "__main__":
    main()
