"""The processor: one per training rank, inside the training process.

It registers with the controller, heartbeats from a background I/O thread (so heartbeats
keep flowing while the training thread is stuck), reports the rank's step status and
errors, and runs the framework callbacks the controller orders, sending every result back.
`Processor` composes three parts and keeps the public API:

- `channel.Channel`: the socket to the controller, registration, heartbeats, failover to
  the backups, the I/O thread;
- `gate.Gate`: the training thread's side: the hold before an update, stop and park,
  pause, the hand-off of work to the training thread, the decision it waits for;
- `orders.Orders`: the two long-lived worker threads that run the orders (see there why
  exit and resume have a lane of their own).

Trainer hooks (all cheap, none talks to the network on the calling thread):

    processor.before_update(step)      # right before optimizer update `step`: holds while
                                       # paused, raises ForceStop once the controller stopped
                                       # the job; marks the data Updating
    processor.report_update_end(step)  # update `step` done: data Updated at `step`
    processor.report_progress(step)    # once per step (the first call arms the hang watchdog)

`step` is the number the update produces: Megatron's `iteration` after the update
(`iteration + 1` before it is incremented). `report_update_start` is the same as
`before_update`.

Actions and callbacks: `set_callbacks(host)` with the host's `callbacks.RecoveryCallbacks`
(default `NoRecovery`: nothing to do). Each method runs on an order worker thread with the
typed order (`order_types`) and returns the typed result (`results`), which goes back to
the controller; an exception goes back as a failure. What the processor does around the
callbacks (hold, stop, pause, resume, exit; an order whose payload does not match its type)
is decided by its core, `core.ProcessorCore`, which has no I/O: this class is its shell of
sockets (`channel`), threads (`orders`, `gate`) and the real clock. An exit hands an exit
`Decision` to the training thread and, if the process is still alive after `exit_grace`
seconds (a hung training thread), ends it with `exit_without_teardown(code)`.

If the controller goes silent for interval x (misses + 1), the processor fails over to the next
controller address (backups from `TTP_BACKUP_ADDRS` and from the registration reply).
A rank that heard from no active controller for `TTP_CONTROLLER_LOST_TIMEOUT` seconds
(default 120) ends itself as an exit order would, with code 77
(`ControlConfig.controller_lost_exit_code`): nobody is left to decide for it, and a rank
must not train on, or wait, unsupervised.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ...process_exit import exit_without_teardown
from ..wire import local
from ..wire.callbacks import NoRecovery, RecoveryCallbacks, run_callback
from ..wire.classify import FaultKind
from ..wire.config import ControlConfig, setup_logging
from ..wire.fields import WireError
from ..wire.messages import RegisteredMessage
from ..wire.order_types import ExitOrder, TypedOrder
from ..wire.protocol import DropCounter, MsgType
from ..wire.results import ActionResult, ResultMessage
from .channel import Channel
from .core import Decision, OwnOrder, Received, Run
from .gate import Gate, ProcessorError, WaitLog
from .orders import Orders

__all__ = ["Decision", "Processor", "ProcessorError"]

log = logging.getLogger("mindspeed_tft.control.processor")

class Processor:
    """The control plane's agent in one training process (see the module docstring).

    rank, world_size: this process's global rank and the job's world size.
    config: default `ControlConfig.from_env()`. replica: this rank's replica layout,
    `{optimizer: {dp_index, dp_size, replica_num, shard, holders}}` (SPEC 7 dump holders).
    controllers: `(addr, port)` to try in order (default: processor_addr:port, then the
    backups). hard_exit: end the process (`exit_without_teardown`) when an exit order is not
    obeyed within `exit_grace` (off in tests that host a processor inside the test process).
    """

    def __init__(self, rank: int, world_size: int, config: ControlConfig | None = None, *,
                 replica: dict[str, Any] | None = None, host: str | None = None,
                 controllers: list[tuple[str, int]] | None = None,
                 hard_exit: bool = True) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.rank = rank
        self.world_size = world_size
        self.config = config or ControlConfig.from_env()
        self.replica = replica
        self.host = host or socket.gethostname()
        self.hard_exit = hard_exit
        self._callbacks: RecoveryCallbacks = NoRecovery()
        self._gate = Gate(rank, self.config)
        self._orders = Orders(rank, self._run_order)
        self._channel = Channel(
            rank, world_size, self.config, view=self._gate, orders=self._orders,
            addresses=list(controllers or [(self.config.processor_addr, self.config.port)]),
            replica=replica, host=self.host, on_controller_lost=self._controller_lost)
        self._exit_timer: threading.Timer | None = None

    # -- lifecycle --------------------------------------------------------------------
    def set_callbacks(self, callbacks: RecoveryCallbacks) -> None:
        """What this rank does for each order (see the module docstring)."""
        self._callbacks = callbacks

    def start(self, timeout: float | None = None) -> None:
        """Connect, register (waits for the controller's answer) and start heartbeating."""
        channel = self._channel
        if channel.started:
            raise RuntimeError("processor already started")
        setup_logging(self.config)
        timeout = self.config.register_timeout if timeout is None else timeout
        channel.start()
        if not channel.wait_registered(timeout):
            self._shutdown()
            where = ", ".join(f"{a}:{p}" for a, p in channel.addresses)
            raise ProcessorError(f"rank {self.rank}: no controller accepted the registration "
                                 f"within {timeout:g}s (tried {where})")
        if channel.reject is not None:
            self._shutdown()
            raise ProcessorError(f"rank {self.rank}: registration refused: {channel.reject}")

    def stop(self, code: int = 0, timeout: float = 5.0) -> None:
        """Training ended: say bye, let a controller in this process finish, stop threads."""
        if not self._channel.running:
            return
        self._channel.post(MsgType.BYE, {"code": int(code)})
        self._channel.flush(timeout)
        if local.local_controllers():  # plain torchrun: this process hosts the controller
            limit = self.config.effective_decision_timeout()
            waiting = WaitLog(self.rank, "the controller in this process to end the job",
                              limit)
            deadline = time.monotonic() + limit
            while not local.wait_local_controllers(min(5.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    log.error("rank %d: the controller in this process did not end the job "
                              "within %gs; leaving", self.rank, limit)
                    break
                waiting.tick()
        self._shutdown()

    def close(self) -> None:
        """Stop threads without a bye (the controller decided this process ends). An exit
        order's deadline stays armed: if the process does not manage to exit, it is ended."""
        self._channel.flush(1.0)
        self._shutdown(cancel_exit=False)

    def _shutdown(self, cancel_exit: bool = True) -> None:
        self._channel.shutdown()
        self._orders.close()
        if cancel_exit and self._exit_timer is not None:
            self._exit_timer.cancel()

    def update_replica(self, replica: dict[str, Any]) -> None:
        """This rank's replica layout (as `replica=` at construction), known only after it
        registered (an SDK host learns it from its framework later): the controller is told."""
        self.replica = replica
        self._channel.update_replica(replica)

    @property
    def registered(self) -> bool:
        return self._channel.registered

    @property
    def rejoining(self) -> bool:
        """A restarted process joining a job being recovered: wait for the repair first."""
        info = self._channel.join_info
        return info is not None and info.rejoin

    @property
    def stopped(self) -> bool:
        return self._gate.stopped

    @property
    def step(self) -> int:
        return self._gate.step

    # -- what the controller said (read-only views of the channel) ------------------------
    @property
    def join_info(self) -> RegisteredMessage | None:
        """The first registration reply of the active controller (None: none yet)."""
        return self._channel.join_info

    @property
    def interval(self) -> float:
        return self._channel.interval

    @property
    def misses(self) -> int:
        return self._channel.misses

    @property
    def failovers(self) -> int:
        return self._channel.failovers

    @property
    def controller_state(self) -> str | None:
        return self._channel.controller_state

    @property
    def controller_role(self) -> str | None:
        return self._channel.controller_role

    @property
    def last_ack(self) -> float | None:
        return self._channel.last_ack

    @property
    def drops(self) -> DropCounter:
        return self._channel.drops

    # -- trainer hooks ------------------------------------------------------------------
    def before_update(self, step: int, timeout: float | None = None) -> None:
        """Hold point before optimizer update `step` (see the module docstring)."""
        self._gate.before_update(step, timeout)

    report_update_start = before_update

    def hold_point(self, step: int, timeout: float | None = None) -> None:
        """A step boundary before update `step` where the training thread may be held: waits
        while the rank is paused, raises ForceStop once it is stopped (as `before_update`,
        without marking the data Updating)."""
        self._gate.wait_unheld(step, timeout)

    def wait_held(self, timeout: float | None = None) -> bool:
        """From a pause callback: wait (bounded; default as a stop waits for the training
        thread to park) until the training thread waits at a hold point; True if it does."""
        if timeout is None:
            timeout = min(self.config.park_timeout, self.config.action_time_limit / 2)
        return self._gate.wait_held(timeout)

    def report_update_end(self, step: int) -> None:
        """Optimizer update `step` completed: the data is Updated at `step`."""
        self._gate.report_update_end(step)

    def report_progress(self, step: int) -> None:
        """The training thread completed `step` (feeds the hang watchdog)."""
        self._gate.report_progress(step)

    def mark_training(self, active: bool) -> None:
        """The handler says whether the training thread is inside the training function."""
        self._gate.mark_training(active)

    # -- errors and decisions -------------------------------------------------------------
    def reported_kind(self, kind: FaultKind) -> FaultKind:
        """What a failure of the training thread classified `kind` is reported as (the
        core decides: after the controller's stop, normal)."""
        return self._gate.core.reported_kind(kind)

    def report_error(self, kind: FaultKind | str, message: str,
                     detail: dict[str, Any] | None = None) -> None:
        """Tell the controller what went wrong in the training thread.

        detail: optional plain data for the planner, e.g. `{"target": "activation"}` for a
        UCE that hit memory holding nothing to copy back (SPEC 8).
        """
        kind = FaultKind(kind)
        if kind is FaultKind.LOST:
            raise ValueError("a process cannot report itself lost")
        self._channel.post(MsgType.REPORT,
                           self._gate.record_error(kind, message, detail).to_wire())

    def wait_decision(self, timeout: float | None = None) -> Decision:
        """Wait for the controller's decision (resume or exit); exit on timeout.

        While it waits, the training thread runs the work that action callbacks hand it
        with `run_in_training_thread` (recovery must act on the training state from the
        thread that owns it)."""
        return self._gate.wait_decision(timeout)

    def serve_training_thread(self, until: Callable[[], bool], timeout: float) -> None:
        """Run handed-over work in the calling (training) thread until `until()` is true.

        For a restarted process before it trains: its training thread is not in the handler
        yet but must run the repair's first steps (joining the process groups)."""
        self._gate.serve_training_thread(until, timeout)

    def run_in_training_thread(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """From an action callback: run `fn` in the training thread (parked in
        `wait_decision` or serving in `serve_training_thread`) and return its result or
        raise its exception; bounded by `timeout` (default: the action time limit)."""
        return self._gate.run_in_training_thread(fn, timeout)

    # -- orders ---------------------------------------------------------------------------
    def _run_order(self, order: Received) -> None:
        """Run one order (on an order worker thread) and send its result back."""
        send = self._gate.run_order(order, self._call, self._arm_exit, self.rejoining)
        if order.id < 0:  # the processor's own exit (no active controller): nobody to answer
            return
        try:
            wire = send.message.to_wire()
        except WireError as e:  # a host's result that does not match its type
            log.error("rank %d: the %s result does not match its type: %s", self.rank,
                      order.name, e)
            wire = ResultMessage(order.id, order.name, error=f"ResultError: {e}").to_wire()
        self._channel.post(send.mtype, wire)

    def _call(self, order: TypedOrder) -> ActionResult | None:
        return run_callback(self._callbacks, order)

    def _controller_lost(self, silent: float) -> None:
        """No active controller for `controller_lost_timeout` (I/O thread): exit with 77 as
        an exit order would, unless an exit was ordered already."""
        if self._gate.core.exit_ordered is not None:
            return
        code = self.config.controller_lost_exit_code
        reason = (f"no active controller for {silent:.0f}s (TTP_CONTROLLER_LOST_TIMEOUT="
                  f"{self.config.controller_lost_timeout:g})")
        print(f"[mindspeed-tft] rank {self.rank}: {reason}; exiting with {code}", flush=True)
        now = time.monotonic()
        for out in self._gate.handle(OwnOrder(-1, "exit", ExitOrder(code, reason).to_wire(),
                                              now + self.config.action_time_limit), now):
            if isinstance(out, Run):
                self._orders.submit(out, now)

    def _arm_exit(self, code: int, deadline: float) -> None:
        """An exit order: end the process at `deadline` if it still lives (a hung training
        thread)."""
        if self.hard_exit and self._exit_timer is None:
            self._exit_timer = threading.Timer(max(0.0, deadline - time.monotonic()),
                                               self._hard_exit, (code,))
            self._exit_timer.daemon = True
            self._exit_timer.start()

    def _hard_exit(self, code: int) -> None:
        log.error("rank %d: training thread did not exit within %gs; ending the process",
                  self.rank, self.config.exit_grace)
        self._channel.flush(1.0)
        local.wait_local_controllers(5.0)
        logging.shutdown()
        exit_without_teardown(code)
