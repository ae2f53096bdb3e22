"""The processor: one per training rank, inside the training process.

It registers with the controller, heartbeats from a background I/O thread (so heartbeats
keep flowing while the training thread is stuck), reports the rank's step status and
errors, and runs the framework callbacks the controller orders, each in its own thread,
sending every result back.

Trainer hooks (all cheap, none talks to the network on the calling thread):

    processor.before_update(step)      # right before optimizer update `step`: holds while
                                       # paused, raises ForceStop once the controller stopped
                                       # the job; marks the data Updating
    processor.report_update_end(step)  # update `step` done: data Updated at `step`
    processor.report_progress(step)    # once per step (the first call arms the hang watchdog)

`step` is the number the update produces: Megatron's `iteration` after the update
(`iteration + 1` before it is incremented). `report_update_start` is the same as
`before_update`.

Actions and callbacks: `register_callback(name, fn)` for stop, clean, repair, rollback,
dump, rename, exit (and optionally pause, resume). `fn(payload) -> dict | None` runs in an
action thread; its return value (plain data) goes back as the result, an exception as a
failure. Built in: `stop` first marks the rank stopped and waits (bounded) for an update in
progress to finish, then calls the callback (which should make a stuck training thread raise,
e.g. by aborting communicators); its result always carries `step` and `status`. `resume`
clears the stop and hands a `Decision` to the training thread waiting in
`wait_decision`. `exit` hands an exit `Decision` over and, if the process is still alive
after `exit_grace` seconds (a hung training thread), ends it with `os._exit(code)`.

If the controller goes silent for interval x (misses + 1), the processor fails over to the next
controller address (backups from `TTP_BACKUP_ADDRS` and from the registration reply).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import local
from .classify import FaultKind, ForceStop
from .config import ControlConfig, parse_hostport, setup_logging
from .protocol import ACTIONS, CONTROLLER, DropCounter, MsgType, ProtocolError, decode, encode
from .transport import CurveKeys, connect_dealer, new_routing_id
from .watchdog import ProgressWatchdog

log = logging.getLogger("mindspeed_tft.control.processor")

ActionCallback = Callable[[dict[str, Any]], "dict[str, Any] | None"]


class ProcessorError(RuntimeError):
    """The processor cannot do its job (e.g. no controller accepted its registration)."""


@dataclass(frozen=True)
class Decision:
    """What the controller decided for a rank waiting after an error."""

    action: str                 # "resume" (re-enter training) or "exit"
    code: int = 0               # exit code (exit)
    step: int | None = None     # step to resume at (resume)
    strategy: str = ""
    reason: str = ""
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Task:
    """Work an action callback hands to the training thread."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class Processor:
    """The control plane's agent in one training process (see the module docstring).

    rank, world_size: this process's global rank and the job's world size.
    config: default `ControlConfig.from_env()`. replica: this rank's replica layout,
    `{optimizer: {dp_index, dp_size, replica_num, shard, holders}}` (SPEC 7 dump holders).
    controllers: `(addr, port)` to try in order (default: processor_addr:port, then the
    backups). hard_exit: end the process with os._exit when an exit order is not obeyed
    within `exit_grace` (off in tests that host a processor inside the test process).
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
        self._addresses: list[tuple[str, int]] = list(
            controllers or [(self.config.processor_addr, self.config.port)])
        for b in self.config.backups:
            if b not in self._addresses:
                self._addresses.append(b)
        self._callbacks: dict[str, ActionCallback] = {}
        self._curve = CurveKeys.from_config(self.config, server=False)
        self.drops = DropCounter(log)
        self.watchdog = ProgressWatchdog(self.config.hang_timeout_min,
                                         self.config.hang_timeout_factor,
                                         self.config.hang_initial_timeout)
        self._watching = False
        # training-side state, guarded by _cond
        self._cond = threading.Condition()
        self._step = 0
        self._status = "updated"
        self._updating_step: int | None = None
        self._progress = 0
        self._stopped = False
        self._paused = False
        self._in_handler = False
        self._training = False
        self._training_thread_id: int | None = None
        self._catch_up: int | None = None
        self._pending: Decision | None = None
        self._tasks: deque[_Task] = deque()
        self._last_report: dict[str, Any] | None = None
        # I/O-side state
        #: one identity for the life of this process: a reconnect to the same controller is
        #: recognised as this rank, not taken for a second process claiming it
        self._routing_id = new_routing_id()
        self._outbox: deque[tuple[str, dict[str, Any]]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._running = False
        self._registered = threading.Event()
        self._ever_registered = False
        self._reject: str | None = None
        self._addr_index = 0
        self._last_heard = 0.0
        self._seen_actions: deque[int] = deque(maxlen=256)
        self._exit_timer: threading.Timer | None = None
        self.controller_state: str | None = None
        self.controller_role: str | None = None
        self.join_info: dict[str, Any] = {}
        self.interval = self.config.heartbeat_interval
        self.misses = self.config.heartbeat_misses
        self.last_ack: float | None = None
        self.failovers = 0

    # -- lifecycle --------------------------------------------------------------------
    def register_callback(self, action: str, fn: ActionCallback) -> None:
        """Run `fn(payload)` for every `action` order (see the module docstring)."""
        if action not in ACTIONS:
            raise ValueError(f"unknown action {action!r} (allowed: {', '.join(ACTIONS)})")
        self._callbacks[action] = fn

    def start(self, timeout: float | None = None) -> None:
        """Connect, register (waits for the controller's answer) and start heartbeating."""
        if self._thread is not None:
            raise RuntimeError("processor already started")
        setup_logging(self.config)
        timeout = self.config.register_timeout if timeout is None else timeout
        self._running = True
        self._thread = threading.Thread(target=self._io_main, name=f"tft-processor-{self.rank}",
                                        daemon=True)
        self._thread.start()
        if not self._registered.wait(timeout):
            self._shutdown()
            where = ", ".join(f"{a}:{p}" for a, p in self._addresses)
            raise ProcessorError(f"rank {self.rank}: no controller accepted the registration "
                                 f"within {timeout:g}s (tried {where})")
        if self._reject is not None:
            self._shutdown()
            raise ProcessorError(f"rank {self.rank}: registration refused: {self._reject}")

    def stop(self, code: int = 0, timeout: float = 5.0) -> None:
        """Training ended: say bye, let a controller in this process finish, stop threads."""
        if self._thread is None or not self._running:
            return
        self._post(MsgType.BYE, {"code": int(code)})
        self._flush(timeout)
        if local.local_controllers():
            local.wait_local_controllers(self.config.effective_decision_timeout())
        self._shutdown()

    def close(self) -> None:
        """Stop threads without a bye (the controller decided this process ends). An exit
        order's deadline stays armed: if the process does not manage to exit, it is ended."""
        self._flush(1.0)
        self._shutdown(cancel_exit=False)

    def _shutdown(self, cancel_exit: bool = True) -> None:
        self._running = False
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        if cancel_exit and self._exit_timer is not None:
            self._exit_timer.cancel()

    @property
    def registered(self) -> bool:
        return self._registered.is_set() and self._reject is None

    @property
    def rejoining(self) -> bool:
        """A restarted process joining a job being recovered: wait for the repair first."""
        return bool(self.join_info.get("rejoin"))

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def step(self) -> int:
        return self._step

    # -- trainer hooks ------------------------------------------------------------------
    def before_update(self, step: int, timeout: float | None = None) -> None:
        """Hold point before optimizer update `step` (see the module docstring)."""
        limit = self.config.effective_decision_timeout() if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while True:
                if self._pending is not None or (self._stopped and not (
                        self._catch_up is not None and step <= self._catch_up)):
                    raise ForceStop(f"rank {self.rank} stopped by the controller before update {step}")
                if not self._paused:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ForceStop(f"rank {self.rank} paused for more than {limit:g}s")
                self.watchdog.pause()  # held on purpose: not a hang
                self._cond.wait(remaining)
                if self._watching:
                    self.watchdog.resume()
            if self._status == "updating" and self._updating_step == step:
                return
            self._status = "updating"
            self._updating_step = step

    report_update_start = before_update

    def report_update_end(self, step: int) -> None:
        """Optimizer update `step` completed: the data is Updated at `step`."""
        with self._cond:
            self._step = step
            self._status = "updated"
            self._updating_step = None
            self._cond.notify_all()

    def report_progress(self, step: int) -> None:
        """The training thread completed `step` (feeds the hang watchdog)."""
        self._progress = step
        if not self._watching and not self._stopped:
            self._watching = True
            self.watchdog.resume()
        self.watchdog.progress(step)

    # -- errors and decisions -------------------------------------------------------------
    def report_error(self, kind: FaultKind | str, message: str,
                     detail: dict[str, Any] | None = None) -> None:
        """Tell the controller what went wrong in the training thread.

        detail: optional plain data for the planner, e.g. `{"target": "activation"}` for a
        UCE that hit memory holding nothing to copy back (SPEC 8).
        """
        kind = FaultKind(kind)
        if kind is FaultKind.LOST:
            raise ValueError("a process cannot report itself lost")
        self.watchdog.pause()
        with self._cond:
            report: dict[str, Any] = {"kind": kind.value, "message": message[:4000],
                                      "step": self._step, "status": self._status}
            if detail:
                report["detail"] = dict(detail)
            self._last_report = report
            self._cond.notify_all()
        self._post(MsgType.REPORT, report)

    def wait_decision(self, timeout: float | None = None) -> Decision:
        """Wait for the controller's decision (resume or exit); exit on timeout.

        While it waits, the training thread runs the work that action callbacks hand it
        with `run_in_training_thread` (recovery must act on the training state from the
        thread that owns it)."""
        limit = self.config.effective_decision_timeout() if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            self._in_handler = True
            self._cond.notify_all()
            try:
                while self._pending is None:
                    if self._tasks:
                        self._run_task_locked()
                        continue
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return Decision("exit", self.config.failure_exit_code,
                                        reason=f"no decision from the controller within {limit:g}s")
                    self._cond.wait(min(remaining, 1.0))
                decision = self._pending
                if decision.action == "resume":
                    self._pending = None
                    self._last_report = None
                return decision
            finally:
                self._in_handler = False

    def serve_training_thread(self, until: Callable[[], bool], timeout: float) -> None:
        """Run handed-over work in the calling (training) thread until `until()` is true.

        For a restarted process before it trains: its training thread is not in the handler
        yet but must run the repair's first steps (joining the process groups)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._training_thread_id = threading.get_ident()
            while not until():
                if self._tasks:
                    self._run_task_locked()
                    continue
                if self._pending is not None and self._pending.action == "exit":
                    raise ProcessorError(f"rank {self.rank}: ordered to exit while joining: "
                                         f"{self._pending.reason}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ProcessorError(f"rank {self.rank}: the repair did not arrive within "
                                         f"{timeout:g}s")
                self._cond.wait(min(remaining, 0.5))

    def run_in_training_thread(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """From an action callback: run `fn` in the training thread (parked in
        `wait_decision` or serving in `serve_training_thread`) and return its result or
        raise its exception; bounded by `timeout` (default: the action time limit)."""
        limit = self.config.action_time_limit if timeout is None else timeout
        task = _Task(fn)
        with self._cond:
            self._tasks.append(task)
            self._cond.notify_all()
        if not task.done.wait(limit):
            self._log_training_stack(f"did not finish a task within {limit:g}s")
            raise ProcessorError(f"rank {self.rank}: the training thread did not run the task "
                                 f"within {limit:g}s")
        if task.error is not None:
            raise task.error
        return task.result

    def _run_task_locked(self) -> None:
        task = self._tasks.popleft()
        self._cond.release()
        try:
            task.result = task.fn()
        except BaseException as e:  # handed back to the callback thread
            task.error = e
        finally:
            self._cond.acquire()
            task.done.set()

    # -- actions --------------------------------------------------------------------------
    def _dispatch(self, payload: dict[str, Any]) -> None:
        aid = payload["id"]
        if aid in self._seen_actions:
            return
        self._seen_actions.append(aid)
        threading.Thread(target=self._run_action, args=(aid, payload["name"], payload["payload"]),
                         name=f"tft-action-{payload['name']}", daemon=True).start()

    def _run_action(self, aid: int, name: str, payload: dict[str, Any]) -> None:
        try:
            builtin = getattr(self, f"_do_{name}", None)
            if builtin is not None:
                result = builtin(payload)
            else:
                result = self._call(name, payload)
            if result is None:
                result = {}
            if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
                raise TypeError(f"the {name} callback returned {type(result).__name__}, not a dict")
            self._post(MsgType.RESULT, {"id": aid, "action": name, "ok": True, "result": result})
        except BaseException as e:
            log.exception("action %s failed on rank %d", name, self.rank)
            self._post(MsgType.RESULT, {"id": aid, "action": name, "ok": False, "result": {},
                                        "error": f"{type(e).__name__}: {e}"[:4000]})

    def _call(self, name: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        fn = self._callbacks.get(name)
        if fn is None:
            log.info("rank %d: no %s callback registered; nothing to do", self.rank, name)
            return {"skipped": True}
        return fn(payload)

    def _hold(self, *, stop: bool, lock_step: int | None = None) -> dict[str, Any]:
        """Hold the training thread before its next update (SPEC 3).

        An update in progress finishes. With a lock step, a rank behind it may still run the
        updates up to it (it already has their gradients): we wait, bounded, until it is
        there, parked in the handler, or out of the training function.
        """
        wait = min(self.config.park_timeout, self.config.action_time_limit / 2)
        deadline = time.monotonic() + wait
        # the watchdog keeps watching: a training thread that never comes back is hung
        with self._cond:
            if stop:
                self._stopped = True
                self._catch_up = lock_step
            else:
                self._paused = True
            self._cond.notify_all()
            while (remaining := deadline - time.monotonic()) > 0:
                behind = (lock_step is not None and self._step < lock_step and self._training
                          and not self._parked())
                if self._status != "updating" and not behind:
                    break
                self._cond.wait(min(remaining, 0.5))
            self._catch_up = None
            return {"step": self._step, "status": self._status}

    def _do_stop(self, payload: dict[str, Any]) -> dict[str, Any]:
        lock = payload.get("lock_step")
        self._hold(stop=True, lock_step=lock if isinstance(lock, int) else None)
        result = self._call("stop", payload) or {}
        parked = self._wait_parked()
        with self._cond:
            return {**result, "step": self._step, "status": self._status, "parked": parked}

    def _parked(self) -> bool:
        return self._in_handler or self._last_report is not None

    def _wait_parked(self) -> bool | None:
        """After a stop: wait (bounded) until the training thread is held in the handler.

        True: it came back, so it is not hung (even if its watchdog fired while it was
        blocked in a collective with a rank that really hung). False: it is inside the
        training function and did not come back: it is hung. None: no training function
        runs under `run_with_fault_tolerance`, so nothing can be said.
        """
        limit = min(self.config.park_timeout, self.config.action_time_limit / 2)
        deadline = time.monotonic() + limit
        with self._cond:
            while not self._parked():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._training:
                    break
                self._cond.wait(min(remaining, 0.5))
            if self._parked():
                return True
            if self._training:
                self._log_training_stack("did not come back to the fault handler when stopped")
            return False if self._training else None

    def _log_training_stack(self, why: str) -> None:
        """Where the training thread is stuck (for the operator; logged, not sent)."""
        import sys
        import traceback

        frame = sys._current_frames().get(self._training_thread_id or -1)
        if frame is not None:
            stack = "".join(traceback.format_stack(frame))
            log.error("rank %d: training thread %s; it is at:\n%s", self.rank, why, stack)

    def mark_training(self, active: bool) -> None:
        """The handler says whether the training thread is inside the training function."""
        with self._cond:
            self._training = active
            if active:
                self._training_thread_id = threading.get_ident()
            self._cond.notify_all()

    def _do_pause(self, payload: dict[str, Any]) -> dict[str, Any]:
        # the whole job is held: a rank blocked in a collective behind a held peer makes no
        # progress either, and is not hung (`_do_resume` watches again)
        self.watchdog.pause()
        held = self._hold(stop=False)
        if "pause" in self._callbacks:
            return {**(self._call("pause", payload) or {}), **held}
        return held

    def _do_resume(self, payload: dict[str, Any]) -> dict[str, Any]:
        result = self._call("resume", payload) if "resume" in self._callbacks else {}
        step = payload.get("step")
        decision = Decision("resume", step=step if isinstance(step, int) and step >= 0 else None,
                            strategy=str(payload.get("strategy", "")), payload=payload)
        with self._cond:
            was_held = self._stopped or self._in_handler or self._last_report is not None
            self._stopped = False
            self._paused = False
            if was_held:
                self._pending = decision
            self._cond.notify_all()
        if self._watching:
            self.watchdog.resume()
        return result or {}

    def _do_exit(self, payload: dict[str, Any]) -> dict[str, Any]:
        code = payload.get("code")
        code = code if isinstance(code, int) else self.config.failure_exit_code
        reason = str(payload.get("reason", ""))
        log.warning("rank %d ordered to exit with code %d: %s", self.rank, code, reason)
        self.watchdog.pause()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self.hard_exit and self._exit_timer is None:
            self._exit_timer = threading.Timer(self.config.exit_grace, self._hard_exit, (code,))
            self._exit_timer.daemon = True
            self._exit_timer.start()
        try:  # the callback runs before the training thread is let go
            result = self._call("exit", payload) if "exit" in self._callbacks else {}
        finally:
            with self._cond:
                self._pending = Decision("exit", code, reason=reason, payload=payload)
                self._cond.notify_all()
        return result or {}

    def _hard_exit(self, code: int) -> None:
        log.error("rank %d: training thread did not exit within %gs; ending the process",
                  self.rank, self.config.exit_grace)
        self._flush(1.0)
        local.wait_local_controllers(5.0)
        logging.shutdown()
        os._exit(code)

    # -- I/O thread -----------------------------------------------------------------------
    def _post(self, mtype: str, payload: dict[str, Any]) -> None:
        self._outbox.append((mtype, payload))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._outbox and self._running and time.monotonic() < deadline:
            time.sleep(0.01)

    def _io_main(self) -> None:
        ctx = zmq.Context(io_threads=1)
        sock: zmq.Socket | None = None
        try:
            sock = self._connect(ctx)
            self._io_loop(ctx, sock)
        except Exception as e:
            log.exception("processor I/O thread of rank %d failed", self.rank)
            if not self._registered.is_set():  # wake start(): it must not wait for nothing
                self._reject = f"processor I/O thread failed: {type(e).__name__}: {e}"
                self._registered.set()
        finally:
            if self._sock is not None:
                self._sock.close(200)  # let a last bye or result leave
            ctx.term()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    _sock: zmq.Socket | None = None

    def _connect(self, ctx: zmq.Context) -> zmq.Socket:
        if self._sock is not None:
            self._sock.close(0)
        addr, port = self._addresses[self._addr_index]
        self._sock = connect_dealer(ctx, addr, port, routing_id=self._routing_id,
                                    max_bytes=self.config.max_message_bytes, curve=self._curve)
        self._last_heard = time.monotonic()
        self._next_register = 0.0
        self.controller_role = None
        self._registered_here = False
        log.info("rank %d connects to controller %s:%d", self.rank, addr, port)
        return self._sock

    def _send(self, mtype: str, payload: dict[str, Any]) -> None:
        self._seq += 1
        frame = encode(mtype, self.rank, self._seq, payload)
        try:
            self._sock.send(frame, zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.ZMQError as e:
            log.debug("rank %d could not send %s: %s", self.rank, mtype, e)

    def _register_payload(self) -> dict[str, Any]:
        with self._cond:
            step, status = self._step, self._status
        return {"world_size": self.world_size, "pid": os.getpid(), "host": self.host[:255],
                "replica": self.replica, "failover": self._ever_registered,
                "step": step, "status": status}

    def _io_loop(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        next_hb = 0.0
        while self._running:
            now = time.monotonic()
            wait = min(self.interval / 4, 0.25)
            if not self._registered_here and now >= self._next_register:
                wait = 0.0  # the (next) registration is due: send it without a poll first
            events = dict(poller.poll(int(wait * 1000)))
            now = time.monotonic()
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            if self._sock in events:
                for _ in range(256):
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)  # type: ignore[union-attr]
                    except zmq.Again:
                        break
                    self._on_frames(frames, now)
            if self._reject is not None:
                return
            switch_to: int | None = self._switch_to
            # one interval more than a rank gets: acks come every other heartbeat or so
            if switch_to is None and now - self._last_heard > self.interval * (self.misses + 1):
                switch_to = (self._addr_index + 1) % len(self._addresses)
                log.warning("rank %d: controller %s:%d silent for %.1fs; failing over", self.rank,
                            *self._addresses[self._addr_index], now - self._last_heard)
            if switch_to is not None:
                self._switch_to = None
                poller.unregister(self._sock)
                self._addr_index = switch_to
                self.failovers += 1
                poller.register(self._connect(ctx), zmq.POLLIN)
                continue
            if self._registered_here:
                while self._outbox:
                    mtype, payload = self._outbox.popleft()
                    self._send(mtype, payload)
                if now >= next_hb:
                    next_hb = now + self.interval
                    with self._cond:
                        hb = {"step": self._step, "status": self._status,
                              "progress": self._progress,
                              # an ack only when needed to know the controller is there: with
                              # the default 3 misses, every other heartbeat (half the traffic)
                              "ack": now - self._last_heard >= self.interval * self.misses / 2}
                    self._send(MsgType.HEARTBEAT, hb)
                hung = self.watchdog.check(now) if self._watching else None
                if hung is not None:
                    idle, limit = hung
                    self._send(MsgType.REPORT, {
                        "kind": FaultKind.HANG.value,
                        "message": f"rank {self.rank}: no training progress for {idle:.1f}s "
                                   f"(timeout {limit:.1f}s) after step {self._progress}",
                        "step": self._step, "status": self._status})
            elif now >= self._next_register:
                self._next_register = now + self.interval
                self._send(MsgType.REGISTER, self._register_payload())

    _switch_to: int | None = None
    _registered_here = False
    _next_register = 0.0

    def _on_frames(self, frames: list[bytes], now: float) -> None:
        if len(frames) != 1:
            self.drops.drop("frames")
            return
        try:
            msg = decode(frames[0], self.config.max_message_bytes)
        except ProtocolError as e:
            self.drops.drop(e.reason, e.detail)
            return
        if msg.sender != CONTROLLER:
            self.drops.drop("spoof", "not from a controller")
            return
        self._last_heard = now
        p = msg.payload
        t = msg.type
        if t == MsgType.ACK:
            self.last_ack = now
            self.controller_state = p["state"]
            self.controller_role = p["role"]
        elif t == MsgType.ACTION:
            if self._registered_here:
                self._dispatch(p)
        elif t == MsgType.REGISTERED:
            self._on_registered(p)
        elif t == MsgType.REJECT:
            if p["retry"]:
                log.warning("rank %d: controller says: %s", self.rank, p["reason"])
            else:
                self._reject = p["reason"]
                self._registered.set()
        elif t == MsgType.REDIRECT:
            if self._addr_index != 0:
                log.info("rank %d: %s; going back", self.rank, p["reason"])
                self._switch_to = 0
        else:
            self.drops.drop("unexpected_type", t)

    def _on_registered(self, p: dict[str, Any]) -> None:
        self.controller_state = p["state"]
        self.controller_role = p["role"]
        self.interval = float(p["interval"])
        self.misses = int(p["misses"])
        for b in p["backups"]:
            try:
                hp = parse_hostport(b, "backup from controller")
            except ValueError:
                continue
            if hp not in self._addresses:
                self._addresses.append(hp)
        if not self._registered_here:
            log.info("rank %d registered with %s controller (state %s)", self.rank, p["role"],
                     p["state"])
        self._registered_here = True
        if p["role"] != "active":
            return  # a standby backup: heartbeat here, wait for it to take charge
        first = not self._ever_registered
        self._ever_registered = True
        if first:
            self.join_info = dict(p)
        self._registered.set()
        with self._cond:
            report = self._last_report if self._pending is None else None
        if report is not None and not first:  # the new controller never saw our error
            self._outbox.append((MsgType.REPORT, report))
