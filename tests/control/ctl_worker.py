"""A fake training rank for the control-plane tests: a real Processor around a toy loop.

Run as a script or through `main(argv)` in a forked process (one process per rank). The toy trainer does `--steps` iterations; each
one first "all-reduces" with the other ranks through small files in `--coll` (it waits until
every peer has reached the same step, like a gradient all-reduce), then runs the update
bracket (`before_update` / `report_update_end`) and reports progress. So, as in a real job,
when one rank fails before its all-reduce the others block in theirs; the stop callback
aborts the fake communicator and the blocked rank raises "NCCL communicator was aborted".

`--fault KIND@STEP` fires once in this process at the start of iteration STEP:
uce, comm, normal (a FORCE STOP), unknown, kill (SIGKILL itself), exit (the process ends
with code 3 at once, without a bye), hang (the training thread blocks forever while
heartbeats go on); `KIND@STEP:update` fires after iteration STEP's
all-reduce, right before its update (every peer may finish that update meanwhile).
`--lag STEP=SECONDS` sleeps that long after iteration STEP's all-reduce (a rank descheduled
between its all-reduce and its update), before a fault at the update point. Every callback
and decision is appended as a JSON line to `--out`, and the process exits with the decided
code (0 after training finished).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from mindspeed_tft.control import ControlConfig, Processor, run_with_fault_tolerance
from mindspeed_tft.control.wire.callbacks import NoRecovery
from mindspeed_tft.control.wire.classify import ForceStop
from mindspeed_tft.control.wire.order_types import (
    CleanOrder,
    DumpOrder,
    ExitOrder,
    RenameOrder,
    RepairOrder,
    RollbackOrder,
    StopOrder,
)
from mindspeed_tft.control.wire.results import (
    CleanResult,
    DumpResult,
    RenameResult,
    RepairResult,
    RollbackResult,
    StopResult,
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--addr", default="127.0.0.1")
    ap.add_argument("--backups", default="")
    ap.add_argument("--interval", type=float, default=0.15)
    ap.add_argument("--misses", type=int, default=4)
    ap.add_argument("--action-limit", type=float, default=5.0)
    ap.add_argument("--hang-floor", type=float, default=60.0)
    ap.add_argument("--exit-grace", type=float, default=1.0)
    ap.add_argument("--lost-timeout", type=float, default=120.0,
                    help="seconds without an active controller before the rank exits 77")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--step-time", type=float, default=0.01)
    ap.add_argument("--fault", default="")
    ap.add_argument("--replicas", type=int, default=2, help="replica_num N (1: no replica)")
    ap.add_argument("--lag", default="", help="STEP=SECONDS: sleep after that all-reduce")
    ap.add_argument("--slow", default="", help="CALLBACK=SECONDS: that callback sleeps")
    ap.add_argument("--die-in", default="", help="CALLBACK: SIGKILL this process inside it")
    ap.add_argument("--coll", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    out = open(args.out, "a", buffering=1, encoding="utf-8")
    lock = threading.Lock()

    def record(event: str, **fields: Any) -> None:
        with lock:
            out.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")

    backups = []
    for b in filter(None, args.backups.split(",")):
        host, port = b.rsplit(":", 1)
        backups.append((host.strip("[]"), int(port)))
    config = ControlConfig(
        controller_addr=args.addr, processor_addr=args.addr, port=args.port,
        heartbeat_interval=args.interval, heartbeat_misses=args.misses,
        action_time_limit=args.action_limit, register_timeout=20, hang_timeout_min=args.hang_floor,
        hang_initial_timeout=max(args.hang_floor, 5.0), exit_grace=args.exit_grace,
        backups=backups, log_path=os.path.dirname(args.out) or ".",
        log_mode="PER_PROC", decision_timeout=30, controller_lost_timeout=args.lost_timeout)
    d, n = args.world, args.replicas
    chunk = d // n
    shard = args.rank % chunk
    replica = {"dense": {"dp_index": args.rank, "dp_size": d, "replica_num": n, "shard": shard,
                         "holders": [shard + k * chunk for k in range(n)]}}
    proc = Processor(args.rank, args.world, config, replica=replica, host="localhost")

    state = {"iteration": 0}
    abort = threading.Event()
    hang_forever = threading.Event()
    fault_kind, _, fault_at = args.fault.partition("@")
    fault_step, _, fault_point = fault_at.partition(":")
    fired = [not fault_kind]
    lag_step, _, lag_secs = args.lag.partition("=")
    slow_name, _, slow_secs = args.slow.partition("=")

    def callback(name: str, order: Any) -> None:
        # the typed orders (order_types) are recorded as they travelled
        record("callback", name=name, payload=order.to_wire())
        if name == slow_name:
            time.sleep(float(slow_secs))
        if name == args.die_in:
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if name == "stop":
            abort.set()  # abort the fake communicator: a blocked all-reduce raises
        if name == "rollback":
            state["iteration"] = order.step

    class Host(NoRecovery):
        """Records every order it runs (and acts out the fault options)."""

        def stop(self, order: StopOrder) -> StopResult:
            callback("stop", order)
            return super().stop(order)

        def clean(self, order: CleanOrder) -> CleanResult:
            callback("clean", order)
            return super().clean(order)

        def repair(self, order: RepairOrder) -> RepairResult:
            callback("repair", order)
            return super().repair(order)

        def rollback(self, order: RollbackOrder) -> RollbackResult:
            callback("rollback", order)
            return super().rollback(order)

        def dump(self, order: DumpOrder) -> DumpResult:
            callback("dump", order)
            return super().dump(order)

        def rename(self, order: RenameOrder) -> RenameResult:
            callback("rename", order)
            return super().rename(order)

        def exit(self, order: ExitOrder) -> None:
            callback("exit", order)

    proc.set_callbacks(Host())

    def allreduce(step: int) -> None:
        mine = os.path.join(args.coll, str(args.rank))
        tmp = mine + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, mine)
        while True:
            if abort.is_set():
                raise RuntimeError("NCCL communicator was aborted (fake all-reduce)")
            ok = True
            for r in range(args.world):
                try:
                    with open(os.path.join(args.coll, str(r))) as f:
                        ok = ok and int(f.read() or -1) >= step
                except (OSError, ValueError):
                    ok = False
            if ok:
                return
            time.sleep(0.004)

    def fire(nxt: int, point: str) -> None:
        if fired[0] or nxt != int(fault_step) or point != (fault_point or "start"):
            return
        fired[0] = True
        record("fault", kind=fault_kind, step=nxt, point=point)
        if fault_kind == "uce":
            raise RuntimeError("UCE ERROR: HBM MULTI BIT ECC on device 0")
        if fault_kind == "comm":
            raise RuntimeError("HCCL OP RETRY FAILED (Connection reset by peer)")
        if fault_kind == "normal":
            raise ForceStop("injected")
        if fault_kind == "unknown":
            raise ValueError("something nobody expected")
        if fault_kind == "kill":
            out.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if fault_kind == "exit":
            out.flush()
            os._exit(3)
        if fault_kind == "hang":
            hang_forever.wait()

    def train() -> int:
        abort.clear()
        while state["iteration"] < args.steps:
            nxt = state["iteration"] + 1
            fire(nxt, "start")
            allreduce(nxt)
            if lag_step and nxt == int(lag_step):
                record("lag", step=nxt, seconds=float(lag_secs))
                time.sleep(float(lag_secs))
            fire(nxt, "update")
            proc.before_update(nxt)
            time.sleep(args.step_time)
            state["iteration"] = nxt
            proc.report_update_end(nxt)
            proc.report_progress(nxt)
        return state["iteration"]

    def on_resume(decision: Any) -> None:
        record("resume", step=decision.step, strategy=decision.strategy)

    def leave(code: int) -> None:
        record("exit", code=code)
        out.flush()
        os._exit(code)

    proc.start()
    record("registered", rejoin=proc.rejoining)
    proc.report_progress(0)
    result = run_with_fault_tolerance(train, proc, on_resume=on_resume, exit_fn=leave)
    record("done", iteration=result)
    proc.stop()
    out.flush()
    sys.exit(0)


if __name__ == "__main__":
    main()
