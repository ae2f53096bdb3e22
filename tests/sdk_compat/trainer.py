"""A data-parallel trainer whose fault tolerance is written against the `mindio_ttp` API only,
in MindSpeed-LLM's shape, on CPU gloo: the end-to-end program of `tests/test_sdk_trainer.py`.

It follows MindSpeed-LLM 2.3.0's high-availability code (`tft_train_initialize.py`,
`tft_stop_clean.py`, `tft_optimizer_data_repair.py`, `tft_arf_group_repair.py`,
`tft_rollback.py`, `tft_dump.py`) with a small model instead of Megatron's:

- start-up: rank 0 starts the controller (`tft_init_controller` + `tft_start_controller`,
  addresses from `TTP_ADDR` / `CONTROLLER_ADDR`, unless `MINDX_TASK_ID` is set), every rank
  `tft_init_processor` + `tft_start_processor` before torch.distributed starts; a worker
  restarted into the job (`tft_is_reboot_node`) builds its model without joining the old
  process groups and raises "ARF FINISH" in its training function;
- every rank holds the whole optimizer state (the non-distributed optimizer: replica count =
  DP size), or with `--use-distributed-optimizer` one shard of it, as MindSpeed-LLM's replica
  optimizer does: the DP group is cut into two consecutive replica groups (its
  `REPLICA_NUM = 2`; DP4: [0, 1] and [2, 3]) and shard s (here the parameters whose index is
  s modulo the number of shards) is held by the s-th rank of each, which sends the updated
  parameters of its shard to the others after each update; the update is bracketed by
  `tft_start_updating_os` / `tft_end_updating_os`;
- handlers: stop (`gloo_device.stop_device`, as torch_npu's `stop_device`), clean (a retry
  rebuilds the process groups, as MindSpeed-LLM's `reinit_process_group`; then
  `restart_device`), rebuild (worker reboot: new process groups with the restarted worker),
  repair (RT_SEND sends the model, the optimizer and the step to the repaired rank; a
  receiver loads them; RT_LOAD_CKPT loads the last checkpoint), rollback (the step), save
  and rename (a Megatron-like `iter_XXXXXXX_tmp` folder renamed to `iter_XXXXXXX` with the
  tracker file);
- the training function runs under `tft_exception_handler`, which enters it again with the
  same arguments after a repair;
- elastic training (`--enable-elastic-training`), as MindSpeed-LLM's `elastic_training_*`
  modules: the downgrade handler checks what MindSpeed-LLM's scale-in assumes (its DP group
  without exactly the ranks that were lost, a holder of every shard among the ranks that
  stay: else it would wait in `new_group` for a rank that left) and rebuilds the world with
  the ranks that stay (each then takes a larger slice of the same global batch, the first
  ranks one sample more where the batch does not divide evenly, as MindSpeed-LLM gives them
  one micro-batch more), the upgrade handlers rebuild the launch world,
  send the state to each returning rank (RT_SEND / RT_RECV_REPAIR) and roll back to the step;
  each checks its strategy parameters (`{"scale-in-strategy": "DP"}` and the scale-out's).

The data of iteration i is a function of i, so a rollback needs no data state. Each rank
writes `OUT/losses.<rank>.jsonl` (iteration, loss as float.hex, learning rate, the world and
the samples of the global batch it trained on) and `OUT/calls.<rank>.jsonl` (the handler
calls). `--gate ITERATION:FILE`: every rank waits before that iteration, bounded and at the
SDK's hold point (`tft_pause_train`), until FILE exists. Faults: `--fault KIND:RANK:ITERATION`,
once or more, with KIND kill (SIGKILL), uce (the rank's parameters and Adam state are
overwritten with NaN, then "UCE ERROR" is raised) or unknown (a RuntimeError no pattern
names: a dying-gasp checkpoint); each fires once, and a restarted process does not fault
again.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import time
from datetime import timedelta

import mindio_ttp.framework_ttp as ft
import torch
import torch.distributed as dist
from mindio_ttp import gloo_device
from mindio_ttp.framework_ttp.ttp_decorator import tft_get_repair_type, tft_report_load_ckpt_step
from mindio_ttp.utils import tft_set_update_end_time, tft_set_update_start_time

MODEL_INDEX, OPTIM_INDEX, STATE_INDEX = 1, 2, 3
RET_OK = 0
GLOBAL_BATCH, FEATURES = 8, 16
#: MindSpeed-LLM's replica groups of the distributed optimizer (`tft_replica_group`)
REPLICA_NUM = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--fault", action="append", default=[],
                   help="KIND:RANK:ITERATION (repeatable)")
    p.add_argument("--enable-high-availability", action="store_true")
    p.add_argument("--enable-hbmfault-repair", action="store_true")
    p.add_argument("--enable-worker-reboot", action="store_true")
    p.add_argument("--enable-elastic-training", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--gate", default=None, help="ITERATION:FILE")
    return p.parse_args()


ARGS = parse_args()
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
#: the global ranks of the world this rank trains in (elastic training changes it)
WORLD_RANKS = list(range(WORLD))
TIMEOUT = timedelta(seconds=60)
os.makedirs(ARGS.out, exist_ok=True)
_calls = open(os.path.join(ARGS.out, f"calls.{RANK}.jsonl"), "a", buffering=1)
_losses = open(os.path.join(ARGS.out, f"losses.{RANK}.jsonl"), "a", buffering=1)
ARF_REBOOT = False
STORE: dist.Store | None = None
#: the optimizer shards: how many, and each one's holders in the current world (at launch:
#: every rank holds the one shard, or MindSpeed-LLM's replica groups)
SHARDS = WORLD // REPLICA_NUM if ARGS.use_distributed_optimizer else 1
HOLDERS = {s: list(range(s, WORLD, SHARDS)) for s in range(SHARDS)}
SHARD = RANK % SHARDS


def record(call: str, **fields) -> None:
    _calls.write(json.dumps({"call": call, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")


class TrainState:
    """What MindSpeed-LLM keeps in its args and scheduler: the iteration."""

    def __init__(self) -> None:
        self.iteration = 0


def shard_params(model: torch.nn.Module, shard: int) -> list[torch.nn.Parameter]:
    return [p for i, p in enumerate(model.parameters()) if i % SHARDS == shard]


def build_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, and an optimizer over this rank's shard of it."""
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, FEATURES))
    return model, torch.optim.Adam(shard_params(model, SHARD), lr=1e-2, foreach=False)


def share_updated_shards(model: torch.nn.Module) -> None:
    """Each shard's updated parameters, from its first holder to every rank that does not
    hold it (nothing to send where every rank holds the whole state)."""
    for shard, holders in sorted(HOLDERS.items()):
        if len(holders) < len(WORLD_RANKS):
            for p in shard_params(model, shard):
                dist.broadcast(p.data, group_rank(holders[0]))


def samples() -> tuple[int, int]:
    """This rank's slice of the global batch in the current world (the first ranks one
    sample more where the world does not divide it)."""
    per, extra = divmod(GLOBAL_BATCH, len(WORLD_RANKS))
    index = WORLD_RANKS.index(RANK)
    start = index * per + min(index, extra)
    return start, start + per + (index < extra)


def batch(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of `iteration` (a function of the iteration)."""
    g = torch.Generator().manual_seed(10_000 + iteration)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g)
    y = torch.sin(x) + 0.1 * torch.randn(GLOBAL_BATCH, FEATURES, generator=g)
    start, end = samples()
    return x[start:end], y[start:end]


# -- process groups ------------------------------------------------------------------------------
_retired: list = []  # old groups are never destroyed by the training thread (stuck work)


def store() -> dist.Store:
    global STORE
    if STORE is None:
        STORE = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=TIMEOUT, wait_for_workers=False)
    return STORE


def rebuild_world() -> int:
    """Every rank of the world (`WORLD_RANKS`) makes its group again (a new key space each
    time: each member counts once per rebuild of that world)."""
    name = ",".join(map(str, WORLD_RANKS))
    generation = (store().add(f"mindio-trainer/rebuilds/{name}", 1) - 1) // len(WORLD_RANKS) + 1
    if dist.is_initialized():
        _retired.append(dist.group.WORLD)
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(
        f"mindio-trainer/{name}/{generation}/", store()), rank=WORLD_RANKS.index(RANK),
        world_size=len(WORLD_RANKS), timeout=TIMEOUT)
    return generation


def group_rank(rank: int) -> int:
    """The rank in the world group of global rank `rank` (the SDK passes global ranks)."""
    return WORLD_RANKS.index(rank)


# -- handlers ------------------------------------------------------------------------------------
def stop_callback(train_args, ctx) -> None:
    record("stop")
    gloo_device.stop_device()


def clean_callback(is_uce_error: bool, train_args, ctx) -> int:
    repair_type = tft_get_repair_type()
    record("clean", is_uce_error=is_uce_error, repair_type=repair_type)
    if repair_type == "retry":
        rebuild_world()
    gloo_device.restart_device()
    return RET_OK


def rebuild_callback(fault_ranks: list, train_args, ctx) -> None:
    global ARF_REBOOT
    record("rebuild_group", fault_ranks=fault_ranks)
    generation = rebuild_world()
    gloo_device.restart_device()
    ARF_REBOOT = False
    record("rebuilt", generation=generation)


def _state_bytes(train_args) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save({"model": train_args[MODEL_INDEX].state_dict(),
                "optimizer": train_args[OPTIM_INDEX].state_dict(),
                "iteration": train_args[STATE_INDEX].iteration}, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _load(train_args, state: dict) -> None:
    train_args[MODEL_INDEX].load_state_dict(state["model"])
    train_args[OPTIM_INDEX].load_state_dict(state["optimizer"])
    train_args[STATE_INDEX].iteration = state["iteration"]


def repair_callback(step: int, need_rebuild: bool, error_ranks: list, repair_info: dict,
                    train_args, ctx) -> None:
    kind = ft.RepairType(repair_info["repair_type"])
    record("repair", step=step, need_rebuild=need_rebuild, error_ranks=error_ranks,
           repair_type=kind.name, src=repair_info["src"], dst=repair_info["dst"],
           rank_list=repair_info["rank_list"])
    if kind is ft.RepairType.RT_SEND:
        payload = _state_bytes(train_args)
        for dst in repair_info["dst"]:
            dist.send(torch.tensor([payload.numel()], dtype=torch.long), group_rank(dst))
            dist.send(payload, group_rank(dst))
    elif kind in (ft.RepairType.RT_UCE_HIGHLEVEL, ft.RepairType.RT_UCE_LOWLEVEL,
                  ft.RepairType.RT_RECV_REPAIR):
        for src in repair_info["src"]:
            size = torch.zeros(1, dtype=torch.long)
            dist.recv(size, group_rank(src))
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(payload, group_rank(src))
            _load(train_args, torch.load(io.BytesIO(payload.numpy().tobytes()),
                                         weights_only=False))
    elif kind in (ft.RepairType.RT_LOAD_CKPT, ft.RepairType.RT_LOAD_REBUILD):
        iteration = load_checkpoint(train_args, ARGS.save)
        tft_report_load_ckpt_step(iteration)
    else:
        raise ValueError(f"repair type {kind} is not valid here")


def rollback_callback(step: int, train_args, ctx) -> None:
    record("rollback", step=step, args_type=type(train_args).__name__)
    train_args[STATE_INDEX].iteration = step


def _check_strategy(params: str, key: str) -> None:
    """MindSpeed-LLM's `check_scale_in_params` / `check_scale_out_params`."""
    strategy = json.loads(params).get(key, "")
    if strategy != "DP":
        raise ValueError(f"Only support DP strategy, but got {strategy}")


def killed_by(iteration: int) -> set[int]:
    """The ranks this job's `--fault kill:...` killed before `iteration` ended."""
    return {int(rank) for kind, rank, at in (f.split(":") for f in ARGS.fault)
            if kind == "kill" and int(at) <= iteration}


def zit_downgrade_rebuild_callback(new_dp_ranks: list, new_world_ranks: list, train_args,
                                   params: str) -> None:
    """Scale-in: the world without the lost DP replicas; the same global batch in larger
    slices (MindSpeed-LLM changes its number of micro-batches). What MindSpeed-LLM's
    `scale_in_rebuild_callback` takes for granted is checked: a broken assumption there is a
    hang, here an error (the controller then ends the job with the dump)."""
    global WORLD_RANKS, HOLDERS
    _check_strategy(params, "scale-in-strategy")
    iteration = train_args[STATE_INDEX].iteration
    record("zit_downgrade_rebuild", new_dp_ranks=new_dp_ranks, new_world_ranks=new_world_ranks,
           params=params, iteration=iteration)
    removed = set(WORLD_RANKS) - set(new_dp_ranks)
    if new_dp_ranks != new_world_ranks or removed != set(WORLD_RANKS) & killed_by(iteration):
        raise RuntimeError(f"scale-in from {WORLD_RANKS} to {new_dp_ranks}: MindSpeed-LLM "
                           "takes every rank missing from new_dp_ranks for a lost one")
    HOLDERS = {s: [r for r in held if r in new_dp_ranks] for s, held in HOLDERS.items()}
    if not all(HOLDERS.values()):
        raise RuntimeError(f"scale-in to {new_dp_ranks} keeps no holder of shards "
                           f"{[s for s, held in HOLDERS.items() if not held]}")
    WORLD_RANKS = list(new_world_ranks)
    rebuild_world()
    gloo_device.restart_device()


def zit_upgrade_rebuild_callback(rank_list: list, train_args, params: str) -> None:
    """Scale-out: the launch world again, with the returning ranks `rank_list`."""
    global WORLD_RANKS, ARF_REBOOT, HOLDERS
    _check_strategy(params, "scale-out-strategy")
    record("zit_upgrade_rebuild", rank_list=rank_list, params=params)
    WORLD_RANKS = list(range(WORLD))
    HOLDERS = {s: list(range(s, WORLD, SHARDS)) for s in range(SHARDS)}
    rebuild_world()
    gloo_device.restart_device()
    ARF_REBOOT = False


def zit_upgrade_repair_callback(step: int, need_rebuild: bool, error_ranks: list,
                                repair_info: dict, train_args, params: str) -> None:
    _check_strategy(params, "scale-out-strategy")
    repair_callback(step, need_rebuild, error_ranks, repair_info, train_args, params)


def zit_upgrade_rollback_callback(step: int, train_args, params: str) -> None:
    _check_strategy(params, "scale-out-strategy")
    record("zit_upgrade_rollback", step=step)
    train_args[STATE_INDEX].iteration = step


def checkpoint_dir(root: str, iteration: int, tmp: bool = False) -> str:
    return os.path.join(root, f"iter_{iteration:07d}" + ("_tmp" if tmp else ""))


def shard_file(folder: str) -> str:
    """This rank's shard's file in a checkpoint folder (one file without shards)."""
    name = "model_optim_rng.pt" if SHARDS == 1 else f"model_optim_rng.shard{SHARD}.pt"
    return os.path.join(folder, name)


def save_callback(step: int, save_info: list, train_args, ctx) -> None:
    record("save_ckpt", step=step, save_info=save_info)
    if ARGS.save is None:
        raise RuntimeError("--save is None, TTP unavailable")
    if train_args[STATE_INDEX].iteration != step:
        raise RuntimeError(f"rank {RANK} is at {train_args[STATE_INDEX].iteration}, not {step}")
    folder = checkpoint_dir(ARGS.save, step, tmp=True)
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": train_args[MODEL_INDEX].state_dict(),
                "optimizer": train_args[OPTIM_INDEX].state_dict(), "iteration": step},
               shard_file(folder))


def rename_callback(step: int, train_args) -> None:
    record("rename", step=step)
    os.rename(checkpoint_dir(ARGS.save, step, tmp=True), checkpoint_dir(ARGS.save, step))
    with open(os.path.join(ARGS.save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(step))


def load_checkpoint(train_args, root: str) -> int:
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    state = torch.load(shard_file(checkpoint_dir(root, iteration)), weights_only=False)
    _load(train_args, state)
    return iteration


# -- training ------------------------------------------------------------------------------------
FIRED: set[str] = set()  # the `--fault`s this process fired (a rollback repeats iterations)


def inject(iteration: int, train_args) -> None:
    if ARF_REBOOT_AT_START:
        return
    for fault in ARGS.fault:
        kind, rank, at = fault.split(":")
        if int(rank) == RANK and int(at) == iteration and fault not in FIRED:
            FIRED.add(fault)
            fire(kind, iteration, train_args)


def fire(kind: str, iteration: int, train_args) -> None:
    record("fault", kind=kind, iteration=iteration)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "uce":  # the memory really is damaged: only the repair brings it back
        with torch.no_grad():
            for p in train_args[MODEL_INDEX].parameters():
                p.fill_(float("nan"))
            for state in train_args[OPTIM_INDEX].state.values():
                state["exp_avg"].fill_(float("nan"))
        raise RuntimeError("UCE ERROR: uncorrectable error in device memory (injected)")
    if kind == "unknown":
        raise RuntimeError("an error no pattern names (injected)")


def gate(iteration: int) -> None:
    """`--gate`: wait at the SDK's hold point until the file exists (bounded)."""
    if not ARGS.gate:
        return
    at, path = ARGS.gate.split(":", 1)
    deadline = time.monotonic() + 180
    while int(at) == iteration and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within 180 s")
        ft.tft_pause_train(iteration)  # a stop or a pause of the controller comes here
        time.sleep(0.05)


def train(forward_step_func, model, optimizer, state, *rest):
    record("train_enter", iteration=state.iteration)
    loss_fn = torch.nn.MSELoss(reduction="sum")
    while state.iteration < ARGS.iterations:
        iteration = state.iteration
        gate(iteration)
        inject(iteration, [forward_step_func, model, optimizer, state])
        x, y = batch(iteration)
        model.zero_grad(set_to_none=False)  # every gradient: the optimizer holds a shard
        loss = loss_fn(model(x), y) / GLOBAL_BATCH
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        ft.tft_start_updating_os(-1)
        tft_set_update_start_time()
        optimizer.step()
        share_updated_shards(model)
        tft_set_update_end_time()
        ft.tft_end_updating_os(iteration + 1)
        state.iteration = iteration + 1
        _losses.write(json.dumps({"iteration": iteration + 1, "loss": total.item().hex(),
                                  "lr": optimizer.param_groups[0]["lr"], "world": WORLD_RANKS,
                                  "samples": samples()}) + "\n")
        ft.tft_pause_train(state.iteration)
    return state.iteration


@ft.tft_exception_handler
def tft_train(*args, **kwargs):
    ft.set_mindio_export_version("MindSpeed-LLM")
    if ARF_REBOOT:
        raise RuntimeError("ARF FINISH")
    return train(*args, **kwargs)


def init_controller_processor() -> None:
    """MindSpeed-LLM's `tft_init_controller_processor` (the port: TTP_PORT, default 8000)."""
    global ARF_REBOOT
    default_ip = "127.0.0.1"
    ttp_ip = os.getenv("TTP_ADDR", default_ip)
    controller_ip = os.getenv("CONTROLLER_ADDR", default_ip)
    controller_ip = ttp_ip if controller_ip == default_ip else controller_ip
    processor_ip = os.getenv("PROCESSOR_ADDR", default_ip)
    processor_ip = ttp_ip if processor_ip == default_ip else processor_ip
    port = int(os.getenv("TTP_PORT", "8000"))
    arf, uce = ARGS.enable_worker_reboot, ARGS.enable_hbmfault_repair
    if RANK == 0 and os.getenv("MINDX_TASK_ID") is None:
        ft.tft_init_controller(RANK, WORLD, False, arf, ARGS.enable_elastic_training)
        ft.tft_start_controller(controller_ip, port, False, "")
    ft.tft_init_processor(RANK, WORLD, False, False, "", uce, arf, False)
    ft.tft_start_processor(processor_ip, port)
    ARF_REBOOT = ft.tft_is_reboot_node()


def register_processor() -> None:
    """MindSpeed-LLM's `tft_register_processor` (its DP group is the world here)."""
    ranks = list(range(WORLD))
    replicas = REPLICA_NUM if ARGS.use_distributed_optimizer else WORLD
    ft.tft_set_optimizer_replica(RANK, [{"rank_list": ranks, "replica_cnt": replicas,
                                         "replica_shift": 0}])
    ft.tft_set_dp_group_info(RANK, ranks)
    ft.tft_register_save_ckpt_handler(save_callback)
    ft.tft_register_rename_handler(rename_callback)
    ft.tft_register_stop_handler(stop_callback)
    ft.tft_register_clean_handler(clean_callback)
    ft.tft_register_repair_handler(repair_callback)
    ft.tft_register_rollback_handler(rollback_callback)
    ft.tft_register_rebuild_group_handler(rebuild_callback)
    if ARGS.enable_elastic_training:  # MindSpeed-LLM registers them with elastic training
        ft.tft_register_zit_downgrade_rebuild_handler(zit_downgrade_rebuild_callback)
        ft.tft_register_zit_upgrade_rebuild_handler(zit_upgrade_rebuild_callback)
        ft.tft_register_zit_upgrade_repair_handler(zit_upgrade_repair_callback)
        ft.tft_register_zit_upgrade_rollback_handler(zit_upgrade_rollback_callback)


def main() -> None:
    global ARF_REBOOT_AT_START
    init_controller_processor()
    ARF_REBOOT_AT_START = ARF_REBOOT
    record("started", reboot=ARF_REBOOT, reboot_again=ft.tft_is_reboot_node())
    if not ARF_REBOOT:  # a restarted worker joins the job's groups in the rebuild handler
        dist.init_process_group("gloo", timeout=TIMEOUT)
    model, optimizer = build_model()
    state = TrainState()
    if ARGS.load and not ARF_REBOOT:
        load_checkpoint([None, model, optimizer, state], ARGS.load)
    register_processor()
    iteration = tft_train(None, model, optimizer, state, None, None, None, None)
    record("end", iteration=iteration)
    _calls.flush()
    _losses.flush()
    os._exit(0)  # groups retired by a repair may still wait for a peer that left


ARF_REBOOT_AT_START = False

if __name__ == "__main__":
    main()
