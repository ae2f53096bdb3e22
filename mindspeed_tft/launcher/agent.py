"""The elastic agent of `tft-run`: torch's `LocalElasticAgent` with mindspeed-tft's failure
handling, everything else (rendezvous, worker environment, logs, error files, exit barrier,
group restarts of `--max-restarts` without worker reboot) left to torch.distributed.elastic.

What changes, by feature (see `options`):

- high availability: node 0's launcher (group rank 0) hosts the `Controller` in a thread,
  every worker gets `TFT_CONTROLLER_IN_LAUNCHER=1` (so rank 0 does not start one), and each
  worker exit seen by node 0's launcher goes to `Controller.report_process_exit` at once
  (a worker killed by a signal as soon as the signal lands, before its reap: `procfs`),
  with why the launcher will not restart it when it will not (the incident then decides
  at once instead of waiting for a replacement). Every other node's launcher sends the
  same report over the network (`exit_report`: an `exited` frame to the active
  controller), so that a worker's end on any node is known at once, not only once its
  heartbeats stop.
  The launcher's exit waits, bounded, for the controller to reach FINAL.
- backups: when the job spans several nodes and `TTP_BACKUP_ADDRS` is not set, the
  launchers of nodes 1 and 2 each host a backup controller (on this host's address toward
  the controller, any free port) and publish its endpoint in the rendezvous store
  (`BACKUP_KEY`); node 0's launcher waits for them (bounded, `BACKUP_WAIT_SECONDS`) and gives
  them to its controller, whose registration replies tell every processor where they are.
  Such a backup knows that ranks absent at its takeover cannot come back (node 0's launcher
  and the store went with the controller): it takes charge dump-only (`control.controller.backup`).
  With `TTP_BACKUP_ADDRS` set, a launcher hosts the backup whose address is one of its
  host's, as before.
- lifetimes: every worker and spare gets the parent-death signal and `TFT_LAUNCHER_PID`
  (`lifetime`): a launcher killed by SIGKILL takes its workers with it.
- worker reboot (ARF): a worker killed by a signal or exiting with the reboot code (76,
  `ControlConfig.reboot_exit_code`) is restarted at once as the same rank with the same
  environment plus `TFT_WORKER_RESTART_COUNT`, while the other workers keep running; a
  worker exiting 0, 75 (dump saved), 1 or anything else is not. The node's workers are
  done when all of them ended. `--max-restarts` (torchrun's flag, or `TFT_MAX_WORKER_RESTARTS`;
  `options.restart_budget`) bounds the restarts per launcher; torch's own restarts of the
  whole group are off.
  A worker killed by a signal counts as dead as soon as the signal takes effect, before the
  kernel has released its memory and lets it be reaped (`procfs`: 0.2-0.7 s for a 2.5 GB
  CPU worker here, more for a GPU worker's device context): its replacement starts while
  the dead process is still being torn down, and waits for it to be gone before it
  touches an accelerator (`spare.wait_for_assignment`).
  With spares (`--tft-spares-per-node`), a failed worker's rank goes to a warm spare when one
  is ready. A node whose launcher is replaced finds its record in the rendezvous store and
  starts its workers as the same ranks without a rendezvous (static rendezvous, node rank
  > 0).

How it plugs in: `TFTElasticAgent` overrides `_rendezvous` (controller, replacement
nodes), `_start_workers` (its process context, the record, the spares) and `run` (tear-down);
`TFTSubprocessContext` overrides `SubprocessContext._poll`, the only place where torch
decides that one worker's exit ends the others.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server import local_elastic_agent as _local_agent
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, Worker, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import (
    PContext,
    RunProcsResult,
    SubprocessContext,
)
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from mindspeed_tft import patches
from mindspeed_tft.arguments import CONTROLLER_IN_LAUNCHER_ENV
from mindspeed_tft.events import store_refused

from ..procfs import killed_returncode
from .exit_report import ExitReporter
from .heartbeat import NodeBeat, NodeWatch
from .lifetime import TiedSubprocessHandler
from .options import MAX_RESTARTS_OPTION, LauncherError, LaunchOptions
from .pool import SparePool
from .spare import PREDECESSOR_PID_ENV
from .store import bind_static_store

#: how many times this rank's process was restarted (set in restarted workers only)
WORKER_RESTART_COUNT_ENV = "TFT_WORKER_RESTART_COUNT"
#: key (under the rendezvous' run-id prefix) of a node's record: what its workers are
RECORD_KEY = "mindspeed_tft/launcher/node/{}"
#: key of backup controller `i`'s endpoint ("" when it could not start)
BACKUP_KEY = "mindspeed_tft/launcher/backup/{}"
#: seconds node 0's launcher waits for the other nodes' backups to be published
BACKUP_WAIT_SECONDS = 60.0

_ORIGINAL_START_PROCESSES = _local_agent.start_processes


def say(message: str) -> None:
    """One line of the launcher's log (stderr, prefixed like torchrun's own lines)."""
    sys.stderr.write(f"[tft-run] {message}\n")  # one write: never split by another line
    sys.stderr.flush()


def _say_transition(old: Any, new: Any, reason: str) -> None:
    """The controller's incident transitions in the launcher's log (its loop thread): what
    happened to the job (a repair, a dump, a shrink or grow of elastic training) without
    opening the controller's own log."""
    if new.value in ("ABNORMAL", "DUMP", "REPAIR", "EXIT") or (
            new.value == "NORMAL" and old.value not in ("INIT", "PAUSE")):
        say(f"controller {old.value} -> {new.value}: {reason}")


def describe_exit(returncode: int) -> str:
    """'died (signal 9)' or 'exited with code 76'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "?"
        return f"died (signal {-returncode}, {name})"
    return f"exited with code {returncode}"


#: the most workers a node record may list, and the largest number in it
_RECORD_MAX_WORKERS = 4096
_RECORD_MAX_NUMBER = 2**31 - 1


def parse_node_record(raw: bytes, key: str) -> dict[str, Any] | None:
    """A node's record (`RECORD_KEY`) read from the store, checked field by field (types and
    bounds), or None: refused with a `store_value_refused` event (anyone who can reach the
    store can write it)."""
    allowed = ("a JSON object: local_world_size, restart_count, master_port (whole numbers), "
               "master_addr (text), workers (lists of 5 whole numbers)")
    try:
        record = json.loads(raw) if len(raw) < (1 << 20) else None
    except ValueError:
        record = None

    def number(value: Any) -> bool:
        return type(value) is int and 0 <= value <= _RECORD_MAX_NUMBER

    workers = record.get("workers") if isinstance(record, dict) else None
    if not (isinstance(record, dict) and isinstance(workers, list)
            and 0 < len(workers) <= _RECORD_MAX_WORKERS
            and all(isinstance(w, list) and len(w) == 5 and all(map(number, w))
                    for w in workers)
            and all(number(record.get(k)) for k in ("local_world_size", "restart_count",
                                                    "master_port"))
            and isinstance(record.get("master_addr"), str)
            and 0 < len(record["master_addr"]) <= 255):
        store_refused(key, raw, allowed)
        return None
    return record


class _AppendingHandler(TiedSubprocessHandler):
    """A `SubprocessHandler` that appends to the log files: a restarted worker's output
    follows its predecessor's in the same files (which `--tee` keeps following)."""

    def __init__(self, *, stdout: str, stderr: str, **kwargs: Any) -> None:
        self._append_to = (stdout, stderr)
        super().__init__(stdout=None, stderr=None, **kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Any:
        out, err = self._append_to
        self._stdout = open(out, "a") if out else None  # noqa: SIM115 (closed by close())
        self._stderr = open(err, "a") if err else None  # noqa: SIM115
        return super()._popen(args, env)


def _address_toward(addr: str, port: int) -> str:
    """This host's address on the route to `addr` (no packet is sent)."""
    import socket

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((addr, port))
        return str(probe.getsockname()[0])


def _is_local_address(addr: str) -> bool:
    """Whether `addr` is an address of this host (it can be bound here)."""
    import socket

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((addr, 0))
        except OSError:
            return False
    return True


class TFTSubprocessContext(SubprocessContext):
    """torch's process context for binaries, with the agent deciding what a worker's exit
    means (see the module docstring)."""

    def __init__(self, *, agent: TFTElasticAgent, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.agent = agent
        self._first_final_failure: float | None = None
        self._final_since: float | None = None
        self._next_wait_log = 0.0
        #: replaced workers that were seen dying before the kernel let them be reaped
        self._dying: list[Any] = []
        self._reported_dying: set[int] = set()  # without worker reboot: reported, not reaped

    def _start(self) -> None:
        """torch's start, with workers that die with this launcher (`lifetime`)."""
        if self.subprocess_handlers:
            raise ValueError("the workers were started already")
        self.subprocess_handlers = {
            local_rank: TiedSubprocessHandler(
                entrypoint=str(self.entrypoint), args=self.args[local_rank],
                env=self.envs[local_rank], stdout=self.stdouts[local_rank],
                stderr=self.stderrs[local_rank], local_rank_id=local_rank,
                numa_options=getattr(self, "_numa_options", None))
            for local_rank in range(self.nprocs)
        }

    def _poll(self) -> RunProcsResult | None:
        agent = self.agent
        if not agent.options.worker_reboot:  # torch's policy; the controller hears first
            for local_rank in sorted(self._running_local_ranks):
                proc = self.subprocess_handlers[local_rank].proc
                code = proc.poll()
                if code is None and local_rank not in self._reported_dying:
                    code = killed_returncode(proc.pid)  # the dump starts before the reap
                    if code is not None:
                        self._reported_dying.add(local_rank)
                if code is not None:
                    agent.report_exit(local_rank, code, pid=proc.pid)
            return super()._poll()
        if agent.pool is not None:
            agent.pool.poll()
        self._dying = [proc for proc in self._dying if proc.poll() is None]
        for local_rank in sorted(self._running_local_ranks):
            handler = self.subprocess_handlers[local_rank]
            code = handler.proc.poll()
            if code is None:  # killed, and the kernel still releasing its memory?
                code = killed_returncode(handler.proc.pid)
                if code is not None:
                    self._dying.append(handler.proc)
            if code is None or agent.on_worker_exit(self, local_rank, handler, code):
                continue
            self._running_local_ranks.discard(local_rank)
            if code != 0:
                self._failures[local_rank] = ProcessFailure(
                    local_rank=local_rank, pid=handler.proc.pid, exitcode=code,
                    error_file=self.error_files[local_rank])
                if self._first_final_failure is None:
                    self._first_final_failure = time.monotonic()
        self._forgive_left_ranks()
        now = time.monotonic()
        acting = agent.acting_controller()
        if (acting is not None and acting.state.value == "FINAL"
                and self._final_since is None and self._running_local_ranks):
            # the job's end was decided: workers get the exit grace, then they are stopped
            # (also a worker restarted while the controller was deciding, which waits for a
            # repair that will not come)
            self._final_since = now
        final_grace = agent.control_config.exit_grace + agent.control_config.lost_after
        if (self._first_final_failure is not None and self._running_local_ranks
                and now >= self._next_wait_log):
            if self._next_wait_log:  # no wait is silent for more than a minute
                say(f"still waiting for workers {sorted(self._running_local_ranks)} (local "
                    f"ranks) to end after a worker failed for good "
                    f"({now - self._first_final_failure:.0f}s of at most "
                    f"{agent.failure_grace:g}s)")
            self._next_wait_log = now + 60.0
        if self._running_local_ranks and (
                (self._first_final_failure is not None
                 and now - self._first_final_failure > agent.failure_grace)
                or (self._final_since is not None and now - self._final_since > final_grace)):
            say(f"workers {sorted(self._running_local_ranks)} (local ranks) still run after "
                "the job ended (a worker failed for good, or the controller is final); "
                "stopping them")
            self.close()
            self._capture_process_failures(set())
            self._running_local_ranks.clear()
            # a rank's restarted process that came after the job shrank without it (and
            # trained to its end) is no failure of the job
            self._forgive_left_ranks()
        if self._running_local_ranks:
            return None
        result = RunProcsResult(failures=dict(self._failures), stdouts=self.stdouts,
                                stderrs=self.stderrs)
        if not result.is_failed():
            result.return_values = dict.fromkeys(range(self.nprocs))
        self.close()
        return result

    def _forgive_left_ranks(self) -> None:
        """Drop the failures of ranks the job continues without (elastic training shrank it
        without them): they neither end this node's wait nor fail the run."""
        agent = self.agent
        acting = agent.acting_controller()
        if acting is None or not agent.options.elastic or not self._failures:
            return
        ended = acting.state.value == "FINAL" and acting.exit_code == 0
        for local_rank, failure in list(self._failures.items()):
            rank = agent._worker_group.workers[local_rank].global_rank
            if acting.has_left(rank):
                del self._failures[local_rank]
                say(f"rank {rank} (exit code {failure.exitcode}) left the job: " + (
                    "the job trained to its end without it" if ended
                    else "elastic training continues without it"))
        if not self._failures:
            self._first_final_failure = None

    def replace(self, local_rank: int, handler: SubprocessHandler) -> None:
        """`handler` runs `local_rank` from now on (the dead process' group is cleaned up)."""
        old = self.subprocess_handlers[local_rank]
        try:  # orphans of the dead worker (its data loader workers, ...) go with it
            os.killpg(old.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for stream in (getattr(old, "_stdout", None), getattr(old, "_stderr", None)):
            if stream is not None:
                stream.close()
        self.subprocess_handlers[local_rank] = handler


class TFTElasticAgent(LocalElasticAgent):
    """`LocalElasticAgent` with mindspeed-tft's controller, worker reboot and spares."""

    def __init__(self, *args: Any, options: LaunchOptions, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from mindspeed_tft.control.wire.config import ControlConfig
        from mindspeed_tft.events import configure_events

        self.options = options
        self.control_config = ControlConfig.from_env()
        self.reboot_exit_code = self.control_config.reboot_exit_code
        self.dump_exit_code = self.control_config.dump_exit_code
        #: seconds the other workers may go on after one failed for good (the controller's
        #: fault handling ends them long before, with a dump or an exit order)
        cfg = self.control_config
        self.failure_grace = cfg.effective_decision_timeout() + cfg.exit_grace + cfg.lost_after
        self.controller: Any = None
        self.backup_controller: Any = None
        #: node 0: the other launchers' beats (`heartbeat.NodeWatch`); others: its own beat
        self.heartbeat: NodeWatch | NodeBeat | None = None
        #: nodes other than 0: worker exits go to the controller over the network
        self.exit_reporter: ExitReporter | None = None
        self.pool: SparePool | None = None
        self.restarts = 0
        #: (monotonic time, rank, old pid, new pid, via) of every restart, for tests and logs
        self.restart_log: list[tuple[float, int, int, int, str]] = []
        self.adopted = False
        self._first_rendezvous = True
        self._warned_function = False
        configure_events(getattr(options.tft_args, "tft_events_file", None))

    # -- rendezvous ---------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        first, self._first_rendezvous = self._first_rendezvous, False
        if not (first and self.options.worker_reboot and self._adopt_running_job(worker_group)):
            # node 0: the store listens on --master-addr only, not every interface
            bind_static_store(worker_group.spec.rdzv_handler)
            super()._rendezvous(worker_group)
        self._start_controller(worker_group)

    def _adopt_running_job(self, worker_group: WorkerGroup) -> bool:
        """A replacement launcher of a running job: take over the node's workers' ranks from
        its record instead of a rendezvous the other nodes will never redo."""
        spec = worker_group.spec
        handler = spec.rdzv_handler
        if handler.get_backend() != "static" or self.options.node_rank == 0:
            return False  # node 0 hosts the store: a new one knows of no running job
        info = handler.next_rendezvous()  # static, node rank > 0: a store client, no waiting
        key = RECORD_KEY.format(info.rank)
        if not info.store.check([key]):
            return False
        record = parse_node_record(info.store.get(key), key)
        if record is None:  # refused (an event says why): this node joins as a new one
            return False
        if record["local_world_size"] != spec.local_world_size:
            raise LauncherError(
                f"--nproc-per-node {spec.local_world_size} differs from the "
                f"{record['local_world_size']} workers node {info.rank} ran in the running job; "
                "allowed: the same --nproc-per-node as before")
        worker_group.workers = [Worker(local_rank=w[0], global_rank=w[1], role_rank=w[2],
                                       world_size=w[3], role_world_size=w[4])
                                for w in record["workers"]]
        # torch leaves WorkerGroup's rendezvous fields un-annotated (`= None` in its __init__):
        # its stub types them None; they are ints and a Store once a rendezvous ran
        worker_group.store = info.store  # type: ignore[assignment]
        worker_group.group_rank = info.rank  # type: ignore[assignment]
        worker_group.group_world_size = info.world_size  # type: ignore[assignment]
        worker_group.master_addr = record["master_addr"]
        worker_group.master_port = record["master_port"]
        self._store = info.store  # type: ignore[assignment]
        self._remaining_restarts = max(0, spec.max_restarts - int(record["restart_count"]))
        self.adopted = True
        ranks = [w.global_rank for w in worker_group.workers]
        say(f"node {info.rank} rejoins a running job (its record is in the rendezvous store): "
            f"starting ranks {ranks} of {record['workers'][0][3]} without a rendezvous")
        return True

    def _publish(self, worker_group: WorkerGroup) -> None:
        """Record what this node's workers are, for a replacement launcher."""
        if worker_group.spec.rdzv_handler.get_backend() != "static" or worker_group.store is None:
            return
        record = {
            "local_world_size": worker_group.spec.local_world_size,
            "master_addr": worker_group.master_addr,
            "master_port": worker_group.master_port,
            "restart_count": worker_group.spec.max_restarts - self._remaining_restarts,
            "workers": [[w.local_rank, w.global_rank, w.role_rank, w.world_size,
                         w.role_world_size] for w in worker_group.workers],
        }
        worker_group.store.set(RECORD_KEY.format(worker_group.group_rank), json.dumps(record))

    # -- controller -----------------------------------------------------------------------
    def _start_controller(self, worker_group: WorkerGroup) -> None:
        if not self.options.high_availability:
            return
        if worker_group.group_rank != 0:
            self._start_backup_controller(worker_group)
            return
        from mindspeed_tft.control import Controller, Features
        from mindspeed_tft.control.wire.config import setup_logging

        if self.controller is not None:  # a group restart (--max-restarts): all new workers
            self._stop_controller(wait=0.0)
        world_size = worker_group.workers[0].world_size
        setup_logging(self.control_config)
        config = self.control_config
        # torch's WorkerGroup stub types it None (see _adopt_running_job)
        if not config.backups and worker_group.group_world_size > 1:  # type: ignore[operator]
            config = config.replace(backups=self._published_backups(worker_group))
        # this launcher reports its workers' deaths itself (`report_process_exit`)
        controller = Controller(world_size, config, watch_processes=False,
                                features=Features.from_args(self.options.tft_args))
        controller.sm.listeners.append(_say_transition)
        controller.start()
        self.controller = controller
        say(f"controller for {world_size} ranks listening on {controller.endpoint}")
        self._start_heartbeat(worker_group)

    def _auto_backup_count(self, worker_group: WorkerGroup) -> int:
        """How many backups the launchers start themselves (no `TTP_BACKUP_ADDRS`)."""
        from mindspeed_tft.control.wire.config import MAX_BACKUPS

        if self.control_config.backups:
            return 0
        # torch's WorkerGroup stub types it None (see _adopt_running_job)
        return min(MAX_BACKUPS, worker_group.group_world_size - 1)  # type: ignore[operator]

    def _published_backups(self, worker_group: WorkerGroup) -> list[tuple[str, int]]:
        """Node 0: the endpoints the backups of nodes 1 and 2 published (bounded wait)."""
        from datetime import timedelta

        from mindspeed_tft.control.wire.config import ControlConfigError, parse_hostport

        count = self._auto_backup_count(worker_group)
        keys = [BACKUP_KEY.format(i) for i in range(count)]
        store = worker_group.store
        if not keys or store is None:
            return []
        try:
            store.wait(keys, timedelta(seconds=BACKUP_WAIT_SECONDS))
        except Exception as error:  # a node that never published: go on without it
            say(f"not every backup controller was published within {BACKUP_WAIT_SECONDS:g}s "
                f"({error}); going on with those that were")
        backups = []
        for key in keys:
            try:
                if not store.check([key]):
                    continue
                endpoint = store.get(key).decode()
            except Exception:
                continue
            if endpoint:
                try:
                    backups.append(parse_hostport(endpoint, "published backup"))
                except ControlConfigError as error:  # anyone who reaches the store can write
                    store_refused(key, endpoint.encode(), f"ip:port ({error})")
        say(f"backup controllers: {', '.join(f'{a}:{p}' for a, p in backups) or 'none'}")
        return backups

    def _start_auto_backup(self, worker_group: WorkerGroup) -> None:
        """Nodes 1 and 2 (no `TTP_BACKUP_ADDRS`): start a backup and publish its endpoint."""
        from mindspeed_tft.control import Controller, Features
        from mindspeed_tft.control.wire.config import setup_logging

        # torch's WorkerGroup stub types it None (see _adopt_running_job)

        # torch's WorkerGroup stub types it None (see _adopt_running_job)
        index = worker_group.group_rank - 1  # type: ignore[operator]
        if self.backup_controller is not None or index >= self._auto_backup_count(worker_group):
            return
        config = self.control_config
        endpoint = ""
        try:
            addr = _address_toward(config.processor_addr, config.port)
            setup_logging(config)
            controller = Controller(worker_group.workers[0].world_size, config,
                                    features=Features.from_args(self.options.tft_args),
                                    watch_processes=False, role="backup", backup_index=index,
                                    bind_addr=addr, port=0, absent_ranks_return=False)
            controller.start()
            self.backup_controller = controller
            endpoint = controller.endpoint
            say(f"backup controller {index} listening on {controller.endpoint}")
        except Exception as error:
            say(f"backup controller {index} not started: {error}")
        if worker_group.store is not None:
            worker_group.store.set(BACKUP_KEY.format(index), endpoint)

    def _start_backup_controller(self, worker_group: WorkerGroup) -> None:
        """Host a backup controller: one of the launchers' own (see the module docstring),
        or the one `TTP_BACKUP_ADDRS` names at an address of this host (SPEC 4: up to 2
        backups, on other nodes than the active controller's)."""
        from mindspeed_tft.control import Controller, Features
        from mindspeed_tft.control.wire.config import setup_logging

        self._start_heartbeat(worker_group)
        if not self.control_config.backups:
            self._start_auto_backup(worker_group)
            return
        for index, (addr, port) in enumerate(self.control_config.backups):
            if self.backup_controller is not None or not _is_local_address(addr):
                continue
            setup_logging(self.control_config)
            controller = Controller(worker_group.workers[0].world_size, self.control_config,
                                    features=Features.from_args(self.options.tft_args),
                                    watch_processes=False, role="backup", backup_index=index,
                                    bind_addr=addr, port=port)
            try:
                controller.start()
            except Exception as error:  # another launcher of this host serves it already
                say(f"backup controller {index} not started on {addr}:{port}: {error}")
                continue
            self.backup_controller = controller
            say(f"backup controller {index} listening on {controller.endpoint}")

    def _start_heartbeat(self, worker_group: WorkerGroup) -> None:
        """Several nodes with worker reboot: node 0's launcher watches the others' beats and
        tells its controller who fell silent; the others beat (`heartbeat`)."""
        handler = worker_group.spec.rdzv_handler
        nodes = worker_group.group_world_size
        if (self.heartbeat is not None or not self.options.worker_reboot or nodes is None
                or nodes < 2 or handler.get_backend() != "static"):
            return
        cfg = self.control_config
        addr, port = handler.master_addr, handler.master_port
        if worker_group.group_rank == 0:
            controller = self.controller
            self.heartbeat = NodeWatch(addr, port, nodes, worker_group.workers[0].world_size,
                                       cfg.heartbeat_interval, cfg.lost_after,
                                       controller.report_node_silent,
                                       controller.report_node_back)
        else:
            self.heartbeat = NodeBeat(addr, port, worker_group.group_rank,
                                      [w.global_rank for w in worker_group.workers],
                                      cfg.heartbeat_interval)
        self.heartbeat.start()

    def _stop_controller(self, wait: float) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        backup, self.backup_controller = self.backup_controller, None
        if backup is not None:
            if backup.role == "active" and wait > 0:  # it took charge: let it finish
                backup.wait_final(wait)
            backup.stop()
        controller, self.controller = self.controller, None
        if controller is None:
            return
        from mindspeed_tft.control.controller.states import State

        if controller.state is State.INIT:
            wait = 0.0  # no rank registered everywhere: nothing left to bring to an end
        if wait > 0 and not controller.wait_final(wait):
            say(f"the controller did not reach FINAL within {wait:g}s after the workers ended "
                f"(state {controller.state.value}); stopping it")
        controller.stop()

    def acting_controller(self) -> Any:
        """The controller in charge hosted here: node 0's, or a backup that took charge."""
        if self.controller is not None:
            return self.controller
        backup = self.backup_controller
        if backup is not None and backup.role == "active":
            return backup
        return None

    def report_exit(self, local_rank: int, returncode: int,
                    no_replacement: str | None = None, *, pid: int) -> None:
        """Tell the controller in charge that a worker process (`pid`) ended, and why it
        gets no replacement when it does not: in-process when it is hosted here (node 0's,
        or a backup that took charge), else over the network (`exit_report`)."""
        rank = self._worker_group.workers[local_rank].global_rank
        acting = self.acting_controller()
        if acting is not None:
            acting.report_process_exit(rank, returncode, no_replacement)
            return
        if (not self.options.high_availability or self._worker_group.group_rank == 0
                or (returncode == 0 and no_replacement is None)):
            return  # no controller to tell, or nothing to tell it
        if self.exit_reporter is None:
            self.exit_reporter = ExitReporter(self.control_config)
        self.exit_reporter.report(rank, pid, returncode, no_replacement)

    # -- workers --------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        with patches.swapped(
            "torch.distributed.elastic.agent.server.local_elastic_agent:start_processes",
            self._start_processes,
        ):
            pids = super()._start_workers(worker_group)
        if self.options.worker_reboot:
            self._publish(worker_group)
            if self.options.spares_per_node and self.pool is None:
                self._start_pool()
        return pids

    def _start_processes(self, **kwargs: Any) -> PContext:
        """torch's `start_processes` with this agent's context for binaries."""
        for env in kwargs["envs"].values():
            if self.options.high_availability:
                env[CONTROLLER_IN_LAUNCHER_ENV] = "1"
            if self.adopted:
                env[WORKER_RESTART_COUNT_ENV] = "1"
        if not isinstance(kwargs.get("entrypoint"), str):
            if self.options.worker_reboot and not self._warned_function:
                self._warned_function = True
                say("worker reboot needs workers started as programs; --run-path runs them as "
                    "functions, so a failed worker stops the node as under torchrun")
            return _ORIGINAL_START_PROCESSES(**kwargs)
        kwargs.pop("start_method", None)
        context = TFTSubprocessContext(agent=self, **kwargs)
        try:
            context.start()
        except Exception:
            context.close()
            raise
        return context

    def _start_pool(self) -> None:
        context = self._pcontext
        if not isinstance(context, TFTSubprocessContext):
            return
        args = {tuple(a) for a in context.args.values()}
        if len(args) != 1:
            say("no warm spares: the workers' arguments differ by local rank (a "
                "${local_rank} macro), so a spare cannot be started ahead of time")
            return
        self.pool = SparePool(self.options.spares_per_node, str(context.entrypoint),
                              next(iter(args)), say=say)
        self.pool.start()
        say(f"started {self.options.spares_per_node} warm spare(s): pids "
            f"{[s.pid for s in self.pool.spares]}")

    def job_ending(self) -> bool:
        """The controller this launcher hosts decided to end the job (dump or exit)."""
        acting = self.acting_controller()
        if acting is None:
            return False
        return acting.state.value in ("DUMP", "EXIT", "FINAL")

    def on_worker_exit(self, context: TFTSubprocessContext, local_rank: int,
                       handler: SubprocessHandler, returncode: int) -> bool:
        """A worker ended: report it, and restart it when the policy says so (True). A
        refusal goes with the report (`report_exit`): the controller decides at once."""
        worker = self._worker_group.workers[local_rank]
        rank, pid = worker.global_rank, handler.proc.pid
        what = f"rank {rank} (pid {pid}) {describe_exit(returncode)}"
        refusal = None if returncode == 0 else self._refusal(what, returncode)
        self.report_exit(local_rank, returncode, refusal, pid=pid)
        if returncode == 0 or refusal is not None:
            return False
        limit = self.options.max_restarts
        self.restarts += 1
        env = dict(context.envs[local_rank])
        count = int(env.get(WORKER_RESTART_COUNT_ENV, "0") or 0) + 1
        env[WORKER_RESTART_COUNT_ENV] = str(count)
        env[PREDECESSOR_PID_ENV] = str(pid)  # may still be exiting (`spare`, `procfs`)
        context.envs[local_rank] = env
        error_file = context.error_files.get(local_rank)
        if error_file and os.path.isfile(error_file):
            os.remove(error_file)  # the new process' error file, not the dead one's
        new, via = self._replacement(context, local_rank, env)
        context.replace(local_rank, new)
        worker.id = new.proc.pid
        self.restart_log.append((time.monotonic(), rank, pid, new.proc.pid, via))
        say(f"{what}; {via} (restart {self.restarts}/{limit})")
        from mindspeed_tft.events import emit

        emit("worker_restarted", rank, pid=pid, new_pid=new.proc.pid, returncode=returncode,
             restart=self.restarts, rank_restarts=count, spare=via.startswith("handing"),
             node=self._worker_group.group_rank)
        return True

    def _refusal(self, what: str, returncode: int) -> str | None:
        """Why a worker that ended with `returncode` (not 0) is not restarted (said in the
        log), or None: it is."""
        if returncode > 0 and returncode != self.reboot_exit_code:
            kind = " (dying-gasp checkpoint saved)" if returncode == self.dump_exit_code else ""
            say(f"{what}{kind}; not restarting it (only a worker killed by a signal or exiting "
                f"with {self.reboot_exit_code} is restarted)")
            return (f"{describe_exit(returncode)}: its launcher restarts only a worker killed "
                    f"by a signal or exiting with {self.reboot_exit_code}")
        if self.job_ending():
            say(f"{what}; not restarting it: the job is ending (the controller decided to "
                "dump or exit)")
            return "the job is ending"
        limit = self.options.max_restarts
        if self.restarts >= limit:
            say(f"{what}; not restarting it: the {limit} restart(s) allowed on this node "
                f"({MAX_RESTARTS_OPTION} {limit}) are used up")
            return f"{MAX_RESTARTS_OPTION} {limit}: its node's restarts are used up"
        return None

    def _replacement(self, context: TFTSubprocessContext, local_rank: int,
                     env: dict[str, str]) -> tuple[SubprocessHandler, str]:
        rank = self._worker_group.workers[local_rank].global_rank
        stdout, stderr = context.stdouts[local_rank], context.stderrs[local_rank]
        if self.pool is not None:
            spare = self.pool.take(env, stdout, stderr)
            if spare is not None:
                return spare.handler, (f"handing rank {rank} to warm spare pid {spare.pid}; "
                                       f"a new spare is starting")
        handler = _AppendingHandler(
            entrypoint=str(context.entrypoint), args=context.args[local_rank], env=env,
            stdout=stdout, stderr=stderr, local_rank_id=local_rank,
            numa_options=getattr(context, "_numa_options", None))
        return handler, f"restarting it as rank {rank}"

    # -- end ------------------------------------------------------------------------------
    def _exit_barrier(self) -> None:
        """torch's wait (`--exit-barrier-timeout`, 300 s) for every node's launcher to end,
        except for launchers known gone: node 0 does not wait for nodes whose launchers fell
        silent, nor a node for the others when it is cut off from node 0's store."""
        beat = self.heartbeat
        if isinstance(beat, NodeWatch) and beat.reported:
            say(f"not waiting for nodes {sorted(beat.reported)} to end: their launchers fell "
                "silent")
            return
        if isinstance(beat, NodeBeat) and beat.cut_off(self.control_config.lost_after):
            say("not waiting for the other nodes to end: node 0's store is out of reach")
            return
        super()._exit_barrier()

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        finished = False
        try:
            result = super().run(role)
            finished = True
            return result
        finally:
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            self._stop_controller(wait=self.control_config.lost_after + 10.0 if finished else 0.0)
            reporter, self.exit_reporter = self.exit_reporter, None
            if reporter is not None:
                reporter.close()


def agent_factory(options: LaunchOptions,
                  created: list[TFTElasticAgent] | None = None) -> Callable[..., TFTElasticAgent]:
    """A stand-in for `LocalElasticAgent` in torch's `launch_agent` (same keyword arguments)."""

    def make(**kwargs: Any) -> TFTElasticAgent:
        agent = TFTElasticAgent(options=options, **kwargs)
        if created is not None:
            created.append(agent)
        return agent

    return make
