"""One rank of a MindSpeed-LLM-shaped job that talks to `mindio_ttp` and records every handler
call: the same program runs against Huawei's SDK (its own venv) and against this project's
`mindio_ttp` (sdk/), and `tests/test_sdk_compat.py` compares what the two recorded.

It calls the API in MindSpeed-LLM 2.3.0's order (`tft_train_initialize.py`):
`tft_init_controller` + `tft_start_controller` on rank 0 (unless `MINDX_TASK_ID` is set),
`tft_init_processor`, `tft_start_processor`, `tft_is_reboot_node`, then
`tft_set_optimizer_replica`, `tft_set_dp_group_info`, the handler registrations, and trains
under `tft_exception_handler` with `set_mindio_export_version("MindSpeed-LLM")` inside, each
update bracketed by `tft_start_updating_os` / `tft_end_updating_os` and each iteration ended
by `tft_pause_train`. The device is simulated with no framework: the stop handler stops it
(every later device operation raises "FORCE STOP", as after torch_npu's `stop_device`), the
clean handler restarts it. Each iteration starts with a collective (a barrier of files in the
run folder) that a stopped device leaves with "FORCE STOP".

    client.py RUNDIR RANK WORLD PORT CASE [FAULT_RANK FAULT_ITER]

CASE: none, uce, uce_low (the clean finds nothing to rebuild), hccl, precision (MindSpeed-LLM's
`PRECISION ERROR`), unknown, kill, pause (rank 0, the controller's process, pauses the job at
FAULT_ITER through the SDK's cluster-manager API and continues it 1 s later). `RUNDIR/spec.json` holds the rest (iterations, DP
groups, switches). Every handler call is a JSON line in `RUNDIR/calls.<rank>.jsonl`.

Huawei's SDK is run on its MindSpore code path here (no torch_npu on this machine; see
../shared/peers/mindio_ttp/README.md). Two things of that path are adjusted, for the SDK only,
so that it behaves as its PyTorch path does for MindSpeed-LLM (documented in docs/design.md,
"mindio_ttp: MindSpeed-LLM's own code on this control plane"):
its exception decorator reads torch_npu's memory statistics after a RuntimeError (a stub
answers 0), and on the MindSpore path the clean does not release the training thread's first
wait (`tft_wait_next_action`), so that wait ends only at the end of the repair, and the
decorator's second wait (`tft_wait_repair_action`) would wait for a release that already
happened: after a first wait that ended in a retry it returns at once, as on the PyTorch
path once the repair is done (otherwise it waits as before).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import types

RUNDIR, RANK, WORLD, PORT, CASE = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                   int(sys.argv[4]), sys.argv[5])
FAULT_RANK = int(sys.argv[6]) if len(sys.argv) > 6 else -1
FAULT_ITER = int(sys.argv[7]) if len(sys.argv) > 7 else -1
with open(os.path.join(RUNDIR, "spec.json")) as _f:
    SPEC = json.load(_f)

import mindio_ttp  # noqa: E402
import mindio_ttp.framework_ttp as ft  # noqa: E402
from mindio_ttp.framework_ttp import ttp_decorator  # noqa: E402
from mindio_ttp.utils import tft_set_update_end_time, tft_set_update_start_time  # noqa: E402

OURS = getattr(mindio_ttp, "IMPLEMENTATION", "") == "mindspeed-tft"
_out = open(os.path.join(RUNDIR, f"calls.{RANK}.jsonl"), "a", buffering=1)
_lock = threading.Lock()


def record(call: str, **fields) -> None:
    with _lock:
        _out.write(json.dumps({"call": call, "rank": RANK, "t": time.time(), **fields}) + "\n")


if not OURS:  # Huawei's SDK on its MindSpore path: see the module docstring
    _npu = types.SimpleNamespace(memory_allocated=lambda: 0, max_memory_allocated=lambda: 0,
                                 memory_reserved=lambda: 0, max_memory_reserved=lambda: 0,
                                 empty_cache=lambda: None)
    ttp_decorator.torch_npu = types.SimpleNamespace(npu=_npu)
    _released = threading.Event()  # the decorator's first wait returned (notify normal)
    _wait_next, _wait_repair = ttp_decorator.tft_wait_next_action, ttp_decorator.tft_wait_repair_action

    def _next() -> int:
        result = _wait_next()
        if result == ft.Action.RETRY.value:
            _released.set()
        return result

    def _repair() -> int:
        if _released.is_set():
            _released.clear()
            return ft.Action.RETRY.value
        return _wait_repair()

    ttp_decorator.tft_wait_next_action, ttp_decorator.tft_wait_repair_action = _next, _repair


class Device:
    """A device that torch_npu's stop_device / restart_device would control."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def check(self) -> None:
        if self.stopped.is_set():
            raise RuntimeError("FORCE STOP. device stopped (simulated stop_device)")


DEVICE = Device()
STATE = {"iteration": 0, "generation": 0, "faulted": False}


def barrier(iteration: int) -> None:
    """Every rank arrives before any goes on (files); a stopped device leaves it."""
    folder = os.path.join(RUNDIR, "barrier", f"g{STATE['generation']}.i{iteration}")
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, str(RANK)), "w").close()
    deadline = time.monotonic() + SPEC.get("barrier_timeout", 120)
    while len(os.listdir(folder)) < WORLD:
        DEVICE.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier g{STATE['generation']}.i{iteration} timed out")
        time.sleep(0.005)


def operator_pause() -> None:
    """What a cluster manager does for a pause, through the controller process' API: pause,
    1 s later continue (rank 0 hosts the controller)."""
    from mindio_ttp.controller_ttp import ttp_mindx_api

    # the time the order was given: a rank's stream sync may run before the call returns
    ordered = time.time()
    record("pause_ordered", ret=ttp_mindx_api.tft_notify_controller_stop_train({}, "pause", 30),
           t=ordered)
    time.sleep(1.0)
    record("continue_ordered",
           ret=ttp_mindx_api.tft_notify_controller_change_strategy("continue"))


def inject(iteration: int) -> None:
    if CASE == "pause":
        if RANK == 0 and iteration == FAULT_ITER and not STATE["faulted"]:
            STATE["faulted"] = True
            record("fault", case=CASE, iteration=iteration)
            threading.Thread(target=operator_pause, daemon=True).start()
        return
    if RANK != FAULT_RANK or iteration != FAULT_ITER or STATE["faulted"]:
        return
    STATE["faulted"] = True
    record("fault", case=CASE, iteration=iteration)
    if CASE in ("uce", "uce_low"):
        raise RuntimeError("UCE ERROR: an uncorrectable error in device memory (simulated)")
    if CASE == "precision":  # MindSpeed-LLM's registered pattern (RS_RETRY)
        raise RuntimeError("PRECISION ERROR load ckpt step=2 (simulated)")
    if CASE == "hccl":
        raise RuntimeError("HCCL OP RETRY FAILED: link to a peer failed (simulated)")
    if CASE == "unknown":
        raise RuntimeError("a framework error that no pattern names (simulated)")
    if CASE == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def train(forward_step_func, model, optimizer, scheduler, train_iter, valid_iter, fn, config):
    record("train_enter", iteration=STATE["iteration"])
    while STATE["iteration"] < SPEC["iterations"]:
        iteration = STATE["iteration"]
        inject(iteration)
        if iteration < SPEC.get("barrier_until", SPEC["iterations"]):
            barrier(iteration)
        start = time.time()
        ft.tft_start_updating_os(-1)
        if time.time() - start > 0.3:
            record("held", where="tft_start_updating_os", step=iteration + 1,
                   blocked=time.time() - start)
        tft_set_update_start_time(time.monotonic_ns() // 1000)
        DEVICE.check()  # the optimizer's update on the device
        tft_set_update_end_time(time.monotonic_ns() // 1000)
        ft.tft_end_updating_os(iteration + 1)
        STATE["iteration"] = iteration + 1
        start = time.time()
        ft.tft_pause_train(iteration + 1)
        if time.time() - start > 0.3:
            record("held", where="tft_pause_train", step=iteration + 1,
                   blocked=time.time() - start)
        time.sleep(SPEC.get("step_seconds", 0.02))
    return STATE["iteration"], 0


ARF_REBOOT = False


@ft.tft_exception_handler
def tft_train(*args, **kwargs):
    ft.set_mindio_export_version("MindSpeed-LLM")
    if ARF_REBOOT:
        raise RuntimeError("ARF FINISH")
    return train(*args, **kwargs)


# -- handlers (MindSpeed-LLM's signatures) -------------------------------------------------------
def stop_handler(train_args, ctx):
    record("stop")
    DEVICE.stopped.set()


def clean_handler(is_uce_error, train_args, ctx):
    record("clean", is_uce_error=bool(is_uce_error), repair_type=ttp_decorator.tft_get_repair_type())
    DEVICE.stopped.clear()
    # uce_low: the device's check finds the UCE in memory that needs no rebuild (torch_npu's
    # check_uce_in_memory says UCE_LOW_LEVEL; MindSpeed-LLM then returns RET_NO_REBUILD)
    return 2 if is_uce_error and CASE == "uce_low" else 0


def repair_handler(step, need_rebuild, error_ranks, repair_info, train_args, ctx):
    record("repair", step=step, need_rebuild=bool(need_rebuild), error_ranks=list(error_ranks),
           repair_info={k: (list(v) if isinstance(v, (list, tuple)) else v)
                        for k, v in repair_info.items()})
    if repair_info["repair_type"] in (ft.RepairType.RT_LOAD_CKPT.value,
                                      ft.RepairType.RT_LOAD_REBUILD.value):
        ttp_decorator.tft_report_load_ckpt_step(step - 1)  # "loaded" the checkpoint before


def rollback_handler(step, train_args, ctx):
    record("rollback", step=step, args_type=type(train_args).__name__)
    STATE["iteration"] = step
    STATE["generation"] += 1


def rebuild_handler(fault_ranks, train_args, ctx):
    record("rebuild_group", fault_ranks=sorted(fault_ranks))


def save_handler(step, save_info, train_args, ctx):
    record("save_ckpt", step=step, save_info=[{"type": i.get("type"), "ranks": list(i.get("ranks"))}
                                              for i in save_info])


def rename_handler(step, train_args):
    record("rename", step=step)


def exit_handler(ctx):
    record("exit")


def stream_sync_handler():
    record("stream_sync")


def precision_handle(err_str):
    return "PRECISION ERROR"


def main() -> None:
    global ARF_REBOOT
    ip = "127.0.0.1"
    arf, uce, zit = SPEC.get("arf", False), SPEC.get("uce", True), False
    if RANK == 0 and os.getenv("MINDX_TASK_ID") is None:
        ft.tft_init_controller(RANK, WORLD, False, arf, zit)
        ft.tft_start_controller(ip, PORT, False, "")
    ft.tft_init_processor(RANK, WORLD, False, False, "", uce, arf, zit)
    ft.tft_start_processor(ip, PORT)
    ARF_REBOOT = ft.tft_is_reboot_node()
    record("started", reboot=ARF_REBOOT, pid=os.getpid(), device=ttp_decorator.get_device())
    group = next(g for g in SPEC["dp_groups"] if RANK in g)
    ft.tft_set_optimizer_replica(RANK, [{"rank_list": group, "replica_cnt": len(group),
                                         "replica_shift": 0}])
    ft.tft_set_dp_group_info(RANK, group)
    ft.tft_register_save_ckpt_handler(save_handler)
    ft.tft_register_rename_handler(rename_handler)
    ft.tft_register_stop_handler(stop_handler)
    ft.tft_register_clean_handler(clean_handler)
    ft.tft_register_repair_handler(repair_handler)
    ft.tft_register_rollback_handler(rollback_handler)
    ft.tft_register_rebuild_group_handler(rebuild_handler)
    ft.tft_register_stream_sync_handler(stream_sync_handler)
    ft.tft_register_exit_handler(exit_handler)
    ft.tft_register_exception_handler("PRECISION ERROR", "RS_RETRY", precision_handle)
    train_args = (None, {"model": True}, None, None, None, None, None, None)
    iteration, _ = tft_train(*train_args)
    record("end", iteration=iteration)
    _out.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
