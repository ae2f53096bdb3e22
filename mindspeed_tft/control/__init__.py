"""The control plane: a ZeroMQ controller and one processor per rank (SPEC 4, 5, 6).

Each side's decisions are cores without I/O (`controller.core.ControllerCore`;
`processor.core.ProcessorCore` and `processor.link.LinkCore`) in shells of sockets, threads
and clocks; the simulator (`sim/`) feeds the same cores on virtual time.

Wiring, in short: rank 0 (or the node-0 launcher) runs `Controller(world_size).start()`;
every rank runs `p = Processor(rank, world_size, replica=...)`, registers callbacks,
`p.start()`, then `run_with_fault_tolerance(train, p)` and finally `p.stop()`.

Modules:

- `wire/`: what both sides share: frames, typed orders and results, sockets, configuration
- `controller/`: the controller, active or backup: its core, the core's parts, its shell
- `processor/`: the agent in every training process: its cores and their shell
- `sim/`: `tft-sim`, a deterministic simulator of the control plane under faults
- `keys`: `python -m mindspeed_tft.control.keys`, the key tool's stable name (`wire.keys`)
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
