"""mindspeed-tft: training fault tolerance for Megatron (megatron-core) and MindSpeed-LLM.

Optimizer replicas, a ZeroMQ controller/processor mesh, dying-gasp checkpoints (TTP),
on-chip memory fault repair (UCE) and worker reboot (ARF). See README.md; the map of the code
and its layers is docs/architecture.md.

Modules:

- `plugin/`: where the plugin meets a host's trainer (`TFTPlugin`, its interface)
- `control/`: the control plane: controller, processor, what they share, the simulator
- `recovery/`: what the controller's orders do to a rank's training state
- `replica/`: optimizer replicas: who holds which shard, their groups, the shard copy
- `platform/`: the accelerator a process trains on, and megatron-core made to run there
- `launcher/`: `tft-run`: worker reboot at the process level, warm spares
- `megatron/`: the Megatron-LM host: Megatron-LM's own loop, adapted at run time
- `training/`: the reference trainer on megatron-core
- `tools/`: the user tools (`tft-report`, `tft-drill`, `tft-plan`, `tft-testbed`)
- `arguments`: the command-line switches and their validation (SPEC 1, 2 and 10)
- `features`: `Features`, the one object saying which features a job switched on
- `envvars`: every environment variable read or set, in one table
- `events`: the JSON Lines event stream (SPEC 11)
- `records`: the events' vocabulary without I/O: the controller's rank, an iteration record's check
- `faults`: fault injection, the `TFT_INJECT` contract (SPEC 11)
- `elastic`: the smaller world a job continues in when a lost rank gets no replacement
- `goodput`: a job's goodput and what each incident cost, read from its events
- `patches`: every run-time patch of third-party code, in one table
- `stand_ins`: stand-ins for megatron-core modules that cannot be imported here
- `startup`: a worker's start-up without the cyclic garbage collector's passes
- `process_exit`: how a training process ends with a decided code
- `procfs`: what `/proc/<pid>/stat` says of a process that is exiting
- `megatron_adaptor`: the one line that switches mindspeed-tft on in a Megatron-LM script
- `torchrun_adaptor`: the one line in the installed `torchrun` script for worker reboot
- `drill`: `python -m mindspeed_tft.drill`, the name users' commands have for `tools.drill`
- `plan`: `python -m mindspeed_tft.plan`, the name users' commands have for `tools.plan`
- `report`: `python -m mindspeed_tft.report`, the name users' commands have for `tools.report`
"""

__version__ = "0.1.0"

#: the package root holds its version only; the Stable API (docs/architecture.md) names the
#: modules users import: `plugin`, `arguments`, `events`, `megatron_adaptor`, `torchrun_adaptor`
__all__ = ["__version__"]
