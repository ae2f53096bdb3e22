"""Where the plugin meets a host's trainer (the reference trainer in
`mindspeed_tft.training`, Megatron-LM's `megatron.training` through `mindspeed_tft.megatron`).

The interface a host implements is this package's: `state.TrainingState` (what recovery may
act on) and `hooks.TrainerHooks` (the points of a step where the plugin acts), plus one
function, its own `initialize_model_parallel(args)`, that recovery calls when it rebuilds
megatron-core's parallel state. A host creates one `TFTPlugin` per process after parsing its
args and:

1. calls `register()` before it initializes torch.distributed: with high availability,
   rank 0 starts the controller (unless the launcher hosts it, `tft-run`) and every rank's
   processor registers. A restarted worker (worker reboot) learns here that it joins a
   running job (`rejoining`): it then builds what needs no communication and calls
   `join_job()`, which waits for the controller's repair to bring it into the rebuilt
   process groups, instead of initializing torch.distributed itself;
2. calls `setup()` once torch.distributed and megatron-core's parallel state exist (builds
   the replica groups and installs the replica optimizer);
3. calls `attach(state)` with its `TrainingState` once model, optimizer and data exist;
4. installs `hooks()` into its loop and runs its training function through `run(fn)`,
   which under high availability is the fault handler of SPEC 6 (report, wait for the
   controller's decision, resume after a repair or exit with the decided code);
5. calls `finish()` when training ended normally.

The hooks are: the processor's step reports (hold before an update when stopped, data
status, progress for the hang watchdog), step snapshots, fault injection (`TFT_INJECT`,
honoured with or without high availability) and, with `--tft-check-replicas-interval`, the
replica consistency check. Layers below the plugin (control, recovery, replica) never call
back into it: recovery gets the training state through its `RecoverableState` protocol and
the group rebuild as one callable.

Modules:

- `state`: `TrainingState`, what recovery may act on (half of a host's interface)
- `hooks`: `TrainerHooks`, the points of a step where the plugin acts (the other half)
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from mindspeed_tft.control.processor.core import Decision
from mindspeed_tft.control.processor.termination import Termination, exit_without_teardown
from mindspeed_tft.control.wire.order_types import ExitOrder
from mindspeed_tft.envvars import launcher_value
from mindspeed_tft.events import configure_events, emit, iteration_log, validate_record
from mindspeed_tft.faults import FaultInjector
from mindspeed_tft.features import Features
from mindspeed_tft.plugin.hooks import HookList, TrainerHooks
from mindspeed_tft.plugin.state import TrainingState
from mindspeed_tft.process_exit import print_error
from mindspeed_tft.recovery.snapshot import StepSnapshots
from mindspeed_tft.replica.check import ReplicaConsistencyCheck
from mindspeed_tft.replica.groups import ReplicaGroups, ReplicaLayout
from mindspeed_tft.replica.optimizer import use_replica_groups

#: the Stable API of this package (docs/architecture.md, "Stable API"); every other name here
#: is internal
__all__ = ["TFTPlugin", "TrainerHooks", "TrainingState"]

log = logging.getLogger("mindspeed_tft.plugin")

T = TypeVar("T")

#: what this package imports on first use, from `register()` to the first repair: a warm
#: spare of `tft-run` imports them before it is ready (`spare.wait_for_assignment`), so that
#: a spare that takes over a rank spends the repair on set-up, not on imports
SETUP_IMPORTS = (
    "mindspeed_tft.control",
    "mindspeed_tft.launcher.lifetime",
    "mindspeed_tft.recovery.actions",
    "mindspeed_tft.recovery.collectives",
    "mindspeed_tft.elastic",
    "mindspeed_tft.recovery.memory_fault",
    "mindspeed_tft.recovery.rebuild",
    "megatron.core.num_microbatches_calculator",
)


class FaultInjectionHooks(TrainerHooks):
    """Fires the `TFT_INJECT` items of this rank at their step and phase.

    A `uce` item really corrupts the target memory (`memory_fault.corrupt_memory`); the UCE
    error it raises then carries the region the damaged address belongs to, found the way a
    device-reported address would be (`memory_fault.classify_address`)."""

    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector

    def on_phase(self, state: TrainingState, phase: str, step: int) -> None:
        from mindspeed_tft.recovery.memory_fault import classify_address, corrupt_memory

        hit: list[int] = []

        def corrupt(target: str) -> None:
            hit.append(corrupt_memory(state, target))

        try:
            self.injector.fire(step, phase, corrupt=corrupt)
        except RuntimeError as error:
            if hit:
                error.tft_detail = {  # type: ignore[attr-defined]
                    "target": classify_address(state, hit[0]),
                    "address": hex(hit[0]),
                }
            raise


class ProcessorHooks(TrainerHooks):
    """Feeds the trainer's step into the processor (SPEC 3).

    The processor numbers an update by the iteration it produces (step s -> s + 1)."""

    def __init__(self, processor: Any, termination: Termination) -> None:
        self.processor = processor
        self.termination = termination

    def on_train_start(self, state: TrainingState) -> None:
        self.processor.report_update_end(state.iteration)
        self.processor.report_progress(state.iteration)

    def on_phase(self, state: TrainingState, phase: str, step: int) -> None:
        if phase == "forward":
            self.termination.check(self.processor)

    def on_update_start(self, state: TrainingState, step: int) -> None:
        self.processor.before_update(step + 1)

    def on_update_end(self, state: TrainingState, step: int) -> None:
        self.processor.report_update_end(step + 1)

    def on_step_end(self, state: TrainingState) -> None:
        self.processor.report_progress(state.iteration)
        self.termination.check(self.processor)


class SnapshotHooks(TrainerHooks):
    """Feeds the step into recovery's `StepSnapshots`."""

    def __init__(self, snapshots: StepSnapshots) -> None:
        self.snapshots = snapshots

    def on_train_start(self, state: TrainingState) -> None:
        self.snapshots.on_train_start(state)

    def on_update_start(self, state: TrainingState, step: int) -> None:
        self.snapshots.on_update_start(state, step)

    def on_update_end(self, state: TrainingState, step: int) -> None:
        self.snapshots.on_update_end(state, step)

    def on_step_end(self, state: TrainingState) -> None:
        self.snapshots.on_step_end(state)


class RepairWorkHooks(TrainerHooks):
    """Closes a repair's work count at the end of its first step (`RecoveryActions.
    after_step`; one attribute check per step otherwise)."""

    def __init__(self, actions: Any) -> None:
        self.actions = actions

    def on_step_end(self, state: TrainingState) -> None:
        self.actions.after_step()


class StopPointHooks(TrainerHooks):
    """Installs the compute stop points (`collectives.install_stop_points`) into the model
    at every train start (a rebuilt model gets them too)."""

    def on_train_start(self, state: TrainingState) -> None:
        from mindspeed_tft.recovery.collectives import install_stop_points

        install_stop_points(state.model)


class ReplicaCheckHooks(TrainerHooks):
    """Runs the replica consistency check (`--tft-check-replicas-interval`)."""

    def __init__(self, check: ReplicaConsistencyCheck) -> None:
        self.check = check

    def on_train_start(self, state: TrainingState) -> None:
        self.check.start()

    def on_step_end(self, state: TrainingState) -> None:
        self.check.after_step(state.iteration, state.optimizer, state.model)


InitializeModelParallel = Callable[[argparse.Namespace], None]


class TFTPlugin:
    """The plugin's state in one training process.

    A host calls, in order: `register`, `setup`, `attach`, `hooks` and `run`, then `finish`
    (a restarted worker calls `join_job` instead of initializing torch.distributed).

    Args:
        args: the training script's parsed arguments, with the flags of
            `mindspeed_tft.arguments.add_tft_args` (checked: `args.tft_features`).
        initialize_model_parallel: the host's own call that builds megatron-core's parallel
            state on the current default process group from `args`; recovery calls it again
            when it rebuilds the groups after a fault.
    """

    def __init__(self, args: argparse.Namespace,
                 initialize_model_parallel: InitializeModelParallel) -> None:
        self.args = args
        self.features: Features = getattr(args, "tft_features", None) or Features.from_args(args)
        self.initialize_model_parallel = initialize_model_parallel
        self.replica_groups: ReplicaGroups | None = None
        self.controller: Any = None
        self.processor: Any = None
        self.snapshots: StepSnapshots | None = None
        self.termination: Termination | None = None
        self.control_config: Any = None
        self.actions: Any = None
        self.state: TrainingState | None = None
        #: the TFT_INJECT faults of this process (`hooks`), fired at a scale change too
        self.injector: FaultInjector | None = None

    @property
    def high_availability(self) -> bool:
        """Whether high availability is on (`--enable-high-availability`)."""
        return self.features.high_availability

    @property
    def rejoining(self) -> bool:
        """This process restarted into a running job (worker reboot)."""
        return self.processor is not None and self.processor.rejoining

    def register(self) -> None:
        """Join the control plane; call it before initializing torch.distributed.

        Without high availability it only opens the events file. With it, rank 0 starts the
        controller (unless `tft-run` hosts it), every rank starts its processor and installs
        the SIGTERM handler; afterwards `rejoining` says whether this process restarted into
        a running job.

        Raises:
            mindspeed_tft.control.ControlConfigError: a control-plane environment variable
                (`TTP_*`) is not allowed; the process exits 2 instead when the controller's
                port was taken after the start-up check.
        """
        # the store's highest logged iteration is bounded by the job's last one
        iteration_log.limit = getattr(self.args, "train_iters", None) or None
        from mindspeed_tft.control.wire.transport import raise_fd_limit

        raise_fd_limit()  # the soft open-files limit up to the hard one: peers' connections
        configure_events(getattr(self.args, "tft_events_file", None))
        if not self.high_availability:
            return
        from mindspeed_tft import patches
        from mindspeed_tft.arguments import launched_by_tft
        from mindspeed_tft.control import ControlConfig, Controller, Processor
        from mindspeed_tft.control.wire.config import ControlConfigError
        from mindspeed_tft.launcher.lifetime import tie_to_launcher
        from mindspeed_tft.recovery.actions import RecoveryActions

        tie_to_launcher()  # a worker never outlives its launcher (tft-run, torchrun)
        # its data-loader workers leave a launcher's SIGTERM to it, and end with it
        patches.install("data-loader-workers")
        patches.install("connection-tracking")  # before any process group exists
        config = ControlConfig.from_env()
        self.control_config = config
        if config.job_token:  # what the logging rank writes to the store is the job's
            iteration_log.key = config.job_token.encode()
        if self.args.distributed_backend == "gloo":
            patches.install("gloo-collectives")
        rank, world_size = self.args.rank, self.features.parallel.world_size
        if rank == 0 and not launched_by_tft(os.environ):  # tft-run's is in its launcher
            self.controller = Controller(world_size, config, features=self.features)
            try:
                self.controller.start()
            except ControlConfigError as error:  # its port taken since the start-up check
                print_error(str(error))
                exit_without_teardown(2)
        dense_map = ReplicaLayout(self.features).dense_map()
        keep_ports = [config.port, *(port for _, port in config.backups)]
        master_port = launcher_value("MASTER_PORT")
        if master_port:
            keep_ports.append(int(master_port))
        self.snapshots = StepSnapshots()
        self.actions = RecoveryActions(self.rebuild_process_groups, self.snapshots, dense_map,
                                       rank, keep_ports, scale_in=self.scale_in,
                                       scale_out=self.scale_out)
        self.processor = Processor(rank, world_size, config,
                                   replica={"dense": dense_map.describe_rank(rank)})
        self.actions.register(self.processor)
        self.processor.start()
        self.termination = Termination(config.lost_after + config.heartbeat_interval + 1.0)
        self.termination.install()

    def join_job(self) -> None:
        """A restarted worker: wait, serving the repair, until it is in the rebuilt groups.

        Called instead of initializing torch.distributed when `rejoining`; afterwards the
        host sets up its model as usual, without collectives.

        Raises:
            mindspeed_tft.control.ProcessorError: no repair brought it in within the
                decision timeout.
        """
        assert self.processor is not None
        print(f"[mindspeed-tft] rank {self.args.rank} restarted into a running job: waiting for "
              "the repair", flush=True)
        self.processor.serve_training_thread(
            until=lambda: self.replica_groups is not None,
            timeout=self.control_config.effective_decision_timeout(),
        )

    def setup(self) -> None:
        """Build the replica groups and install the replica optimizer.

        Call it once torch.distributed and megatron-core's parallel state exist, before the
        optimizer is built. Does nothing without high availability or the replica check.
        """
        if self.high_availability or bool(getattr(self.args, "tft_check_replicas_interval", 0)):
            self.replica_groups = ReplicaGroups(ReplicaLayout(self.features))
            self.replica_groups.build()
            use_replica_groups(self.replica_groups)
            emit("replica_layout", dist.get_rank(), pid=os.getpid(),
                 **self.replica_groups.layout_event())

    def rebuild_process_groups(self, generation: int, survivor: bool) -> None:
        """Every process group again, with the restarted workers (training thread)."""
        from mindspeed_tft.recovery import collectives
        from mindspeed_tft.recovery.rebuild import (
            join_generation,
            leave_generation,
            repoint_process_groups,
        )

        old = leave_generation() if survivor else {}
        with collectives.tracking_window():
            join_generation(self.args, generation, self.initialize_model_parallel)
            collectives.reset()
            self.replica_groups = None
            self.setup()
        if survivor:
            state = self.state
            roots = [*state.model, state.optimizer] if state is not None else []
            replaced = repoint_process_groups(roots, old)
            del old, roots  # let go at the end of the rollback (RecoveryActions)
            log.info("rank %d: %d process-group references re-pointed", self.args.rank,
                     replaced)

    def scale_in(self, generation: int, ranks: list[int], root: str) -> dict[str, Any]:
        """Elastic training (training thread): continue in the smaller world of the DP
        replicas of `ranks` (control-plane ranks) that split the global batch evenly
        (`mindspeed_tft.elastic`), from the checkpoint under `root`. Returns whether this rank
        stays, the new DP size and, for the controller, the rank's new replica layout with
        control-plane ranks and the global batch in micro-batches."""
        from mindspeed_tft.elastic import shrunk_world
        from mindspeed_tft.recovery.rebuild import leave_generation

        args, me = self.args, self.actions.rank
        assert self.replica_groups is not None and self.state is not None
        dense = self.replica_groups.dense
        actions = self.actions
        world, dp_size = shrunk_world(ranks, lambda r: dense.dp_index(actions.global_rank_of(r)),
                                      args.global_batch_size, args.micro_batch_size)
        if self.injector is not None:
            self.injector.fire(self.state.iteration, "scale")
        leave_generation()
        if me not in world:
            print(f"[mindspeed-tft] rank {me}: the job continues at DP {dp_size} without this "
                  "rank's replica (the global batch splits evenly over that many)", flush=True)
            return {"stays": False, "dp_size": dp_size}
        return self._enter_world(generation, world, dp_size, root)

    def scale_out(self, generation: int, world: list[int], dp_size: int, root: str,
                  lock_step: int) -> dict[str, Any]:
        """Elastic training (training thread): continue in the larger world `world`
        (control-plane ranks, ascending) at DP `dp_size`, from the checkpoint of `lock_step`
        under `root`. A returning rank (no model yet) only joins the process groups here; its
        trainer builds the model next and the action loads the checkpoint into it."""
        from mindspeed_tft.recovery.rebuild import leave_generation

        if self.state is not None:
            if self.injector is not None:
                self.injector.fire(self.state.iteration, "scale")
            leave_generation()
        else:  # a returning rank: its trainer has set up no injector yet
            injector = FaultInjector.from_env(self.actions.rank)
            if injector:
                injector.fire(lock_step, "scale")
        return self._enter_world(generation, world, dp_size, root)

    def _enter_world(self, generation: int, world: list[int], dp_size: int,
                     root: str) -> dict[str, Any]:
        """This rank's part of a scale change: megatron-core's parallel state, the replica
        groups and (for a member) model, optimizer and data, rebuilt for `world`."""
        from megatron.core.num_microbatches_calculator import (
            reconfigure_num_microbatches_calculator,
        )

        from mindspeed_tft.arguments import apply_scale
        from mindspeed_tft.elastic import replica_num_for
        from mindspeed_tft.recovery.rebuild import release_retired_groups

        args, me, launched = self.args, self.actions.rank, self.features.launch_replica_num
        old_dp = self.features.parallel.data
        replica_num = replica_num_for(dp_size, launched)
        if replica_num != launched and world.index(me) == 0:
            what = ("one copy of the optimizer state (a further fault ends in a dump, not a "
                    "repair)" if replica_num == 1 else f"{replica_num} optimizer replicas")
            print(f"[mindspeed-tft] elastic training: --optimizer-replica-num "
                  f"{launched} does not divide the new DP size {dp_size}: the "
                  f"job continues with {what}", flush=True)
        # the new world's features replace the old (the replica layout and Megatron's args
        # are built from them)
        self.features = self.features.scaled(len(world), replica_num)
        assert self.features.parallel.data == dp_size, (self.features.parallel, dp_size)
        apply_scale(args, self.features, world.index(me))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(args.rank), str(args.world_size)
        state = self.state
        member = state is not None
        if state is not None:
            state.model, state.optimizer = [], None  # free the old replicas' memory
        self.rebuild_process_groups(generation, survivor=False)
        iteration = None
        reconfigure_num_microbatches_calculator(args.rank, None, args.global_batch_size,
                                                args.micro_batch_size, dp_size)
        if state is not None:
            iteration = state.rebuild(root)
        release_retired_groups()
        assert self.replica_groups is not None
        self.actions.scale_to(world, self.replica_groups.dense)
        layout = self.replica_groups.dense.describe_rank(args.rank)
        layout["holders"] = [world[h] for h in layout["holders"]]
        where = (f"from iteration {iteration}" if member
                 else f"once its model is built, from the checkpoint in {root}")
        print(f"[mindspeed-tft] rank {me}: continues as rank {args.rank} of {len(world)} at DP "
              f"{dp_size} (was {old_dp}) {where}", flush=True)
        return {"stays": True, "dp_size": dp_size, "iteration": iteration,
                "replica": {"dense": layout},
                "micro_batches": args.global_batch_size // args.micro_batch_size}

    def attach(self, state: TrainingState) -> None:
        """Hand the trainer's state to the plugin: from now on recovery may act on it.

        Args:
            state: the host's model, optimizer, scheduler, data iterators and checkpoint
                callbacks, once they exist.
        """
        from mindspeed_tft.launcher.spare import setup_report

        self.state = state
        report = setup_report()
        if report is not None:  # a warm spare that took over a rank: what its set-up cost
            log.info("rank %d: %s", dist.get_rank(), report)
        if self.actions is not None:
            self.actions.attach(state)

    def hooks(self) -> TrainerHooks:
        """The trainer hooks of this process, for the host to call at each point of a step.

        Returns:
            One `TrainerHooks` combining the processor's hold and step reports, the step
            snapshots, the stop points, `TFT_INJECT` fault injection and the replica check,
            as the flags ask.
        """
        hooks = HookList()
        if self.processor is not None:
            assert self.termination is not None and self.snapshots is not None
            hooks.append(ProcessorHooks(self.processor, self.termination))
            hooks.append(SnapshotHooks(self.snapshots))
            hooks.append(StopPointHooks())
            hooks.append(RepairWorkHooks(self.actions))
        injector = FaultInjector.from_env(dist.get_rank())
        if injector:
            hooks.append(FaultInjectionHooks(injector))
            self.injector = injector
        interval = getattr(self.args, "tft_check_replicas_interval", 0)
        if interval and self.replica_groups is not None:
            hooks.append(ReplicaCheckHooks(ReplicaConsistencyCheck(self._replica_groups,
                                                                   interval)))
        return hooks

    def _replica_groups(self) -> ReplicaGroups:
        assert self.replica_groups is not None
        return self.replica_groups

    def run(self, train_fn: Callable[[], T]) -> T:
        """Run the training function, under the fault handler with high availability.

        Args:
            train_fn: the host's training loop; after a repair it is called again and
                resumes at the lock step (the state's `iteration`).

        Returns:
            What `train_fn` returns. When the controller decides that the process exits
            instead, it does not return: the process ends with the decided code (75 after a
            dump, 76 to be restarted, 1 when nothing could be saved; see the exit codes).
        """
        if self.processor is None:
            return train_fn()
        from mindspeed_tft.control import run_with_fault_tolerance

        return run_with_fault_tolerance(train_fn, self.processor, on_resume=self._log_missed,
                                        on_exit=self._log_missed_at_exit,
                                        exit_fn=exit_without_teardown)

    def _log_missed(self, decision: Decision) -> None:
        """After a repair: the logging rank logs the iterations the stop cut off."""
        iteration_log.fill(self._records(decision),
                           logger=dist.get_rank() == dist.get_world_size() - 1,
                           train_iters=getattr(self.args, "train_iters", None))

    def _log_missed_at_exit(self, decision: Decision) -> None:
        """The job ends with a dump: the rank the controller chose (a survivor) logs the
        iterations up to the dump's that the stop cut off."""
        assert self.processor is not None
        order = decision.order
        if not isinstance(order, ExitOrder) or order.logger != self.processor.rank:
            return
        iteration_log.fill(self._records(decision), logger=True,
                           train_iters=getattr(self.args, "train_iters", None),
                           why="logged at the exit: the dump holds it, the stop cut its log "
                               "line off")

    @staticmethod
    def _records(decision: Decision) -> list[dict[str, Any]]:
        given = decision.order.iterations if decision.order is not None else None
        return [r for r in map(validate_record, given or ()) if r is not None]

    def finish(self) -> None:
        """Training ended normally: leave the control plane (the processor says bye)."""
        if self.processor is not None:
            self.processor.stop(0)
        if self.controller is not None:
            self.controller.stop()
