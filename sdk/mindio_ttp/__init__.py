"""`mindio_ttp`, the API of Huawei's MindIO TFT SDK (7.3.0), on mindspeed-tft's control plane.

MindSpeed-LLM's own high-availability code (`mindspeed_llm/core/high_availability/`, 2.3.0 and
later) drives fault tolerance through this API: it starts the controller and a processor per
rank, tells them its optimizer replicas, registers handlers that stop, clean, repair, roll
back and dump its training state, and runs its training function under
`framework_ttp.tft_exception_handler`. Installed as `mindio_ttp` (a distribution of its own,
sdk/ in the mindspeed-tft repository), this package answers those calls with mindspeed-tft's
controller, processor, strategies and launcher (`tft-run`): the same handlers are called with
the same arguments, in the same order, and behaviour differs only where this control plane is
better (docs/design.md, "mindio_ttp: MindSpeed-LLM's own code on this control plane").
Importing `mindio_ttp.framework_ttp` in the installed `torchrun` script (the usage guide's
step) routes torchrun's launches with high availability through mindspeed-tft's launcher,
which restarts only failed workers. The first three modules below are the SDK's; the rest
are this package's own.

Modules:

- `framework_ttp/`: the processor side and the exception decorator, as MindSpeed-LLM imports it
- `controller_ttp/`: the controller side: mindspeed-tft's `Controller` in this process
- `utils/`: update times for the UCE decision
- `gloo_device`: what torch_npu's `stop_device` / `restart_device` do for HCCL, for gloo
- `_runtime`: the per-process state: hosted controller, processor, handlers, the incident
- `_actions`: the controller's orders as calls of the handlers a framework registered
- `_translate`: from this control plane's orders to the handlers' arguments (pure)
- `_zit`: elastic training through the SDK's four ZIT handlers (pure)
- `_faults`: which report an exception of the training function becomes: the SDK's patterns
- `_enums`: the SDK's enumerations, with its values
- `_token`: the job's token on the SDK route, made by the controller this package starts
- `_torchrun`: the usage guide's step: the ``torchrun`` moment installed in torchrun only
- `_dump_manifest`: the manifest of a dump the host's own handlers wrote
"""

#: which implementation of the API this is (Huawei's package has no such name)
IMPLEMENTATION = "mindspeed-tft"
#: the SDK version whose API this package follows
API_VERSION = "7.3.0"

__all__ = ["API_VERSION", "IMPLEMENTATION"]
