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

Modules, as in the SDK: `framework_ttp` (the processor side and the exception decorator;
`framework_ttp.ttp_decorator`), `controller_ttp` (the controller), `utils` (update times for
the UCE decision). Added: `gloo_device` (what torch_npu's `stop_device` / `restart_device` do
for HCCL, for gloo on CPU). Importing `mindio_ttp.framework_ttp` in the installed `torchrun`
script (the usage guide's step) routes torchrun's launches with high availability through
mindspeed-tft's launcher, which restarts only failed workers.
"""

#: which implementation of the API this is (Huawei's package has no such name)
IMPLEMENTATION = "mindspeed-tft"
#: the SDK version whose API this package follows
API_VERSION = "7.3.0"

__all__ = ["API_VERSION", "IMPLEMENTATION"]
