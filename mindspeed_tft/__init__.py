"""mindspeed-tft: training fault tolerance for Megatron (megatron-core) and MindSpeed-LLM.

Optimizer replicas, a ZeroMQ controller/processor mesh, dying-gasp checkpoints (TTP),
on-chip memory fault repair (UCE) and worker reboot (ARF). See README.md.
"""

__version__ = "0.1.0"

#: the package root holds its version only; the Stable API (docs/architecture.md) names the
#: modules users import: `plugin`, `arguments`, `events`, `megatron_adaptor`, `torchrun_adaptor`
__all__ = ["__version__"]
