"""The control plane: a ZeroMQ controller and one processor per rank (SPEC 4, 5, 6), in three
subpackages by role.

- `wire/` (both sides): `protocol` (msgpack frames with a version and a typed payload per
  message type: `messages`, `order_types`, `results`), `transport` (ROUTER/DEALER sockets over TCP, IPv4/IPv6, optional CURVE; `keys` makes
  keys), `config` (`ControlConfig.from_env()`: TTP_ADDR, TTP_PORT, timeouts, TTP_LOG_*),
  `classify` (fault kinds, error classification, `ForceStop`), `priority` (thread priorities),
  `local` (controllers hosted by this process: an exiting rank lets them finish)
- `controller/`: `controller` (the controller, active or backup, `python -m
  mindspeed_tft.control.controller`), `incident` (the phases of one fault's handling: stop,
  clean, repair, rollback / dump, exit), `strategy` (strategy choice, SPEC 6, and the planner of
  action payloads, SPEC 7), `backup` (backup controllers kept in sync, failover with a majority
  of ranks), `states` (the SPEC 5 state machine as a transition table), `ranktable` (per-rank
  connection, step, data status and health), `metrics`, `elasticity`, `admission`
- `processor/`: `processor` (the per-rank agent, made of a `channel` to the controller, a `gate`
  for the training thread and the `orders` worker threads; `watchdog`: hang detection),
  `handler` (the exception wrapper around the training function), `termination` (SIGTERM and
  decided exits)

Wiring, in short: rank 0 (or the node-0 launcher) runs `Controller(world_size).start()`;
every rank runs `p = Processor(rank, world_size, replica=...)`, registers callbacks,
`p.start()`, then `run_with_fault_tolerance(train, p)` and finally `p.stop()`.
"""

from ..features import Features
from .controller.controller import Controller
from .processor.handler import run_with_fault_tolerance
from .processor.processor import Processor, ProcessorError
from .wire.classify import ForceStop
from .wire.config import ControlConfig, ControlConfigError

#: internal, all of it (docs/architecture.md, "Stable API"): the names the hosts of this
#: repository and the `mindio_ttp` SDK of the same version (sdk/, pinned to it) take from here;
#: everything else is imported from its module
__all__ = [
    "ControlConfig",
    "ControlConfigError",
    "Controller",
    "Features",
    "ForceStop",
    "Processor",
    "ProcessorError",
    "run_with_fault_tolerance",
]
