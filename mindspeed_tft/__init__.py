"""mindspeed-tft: training fault tolerance for Megatron (megatron-core) and MindSpeed-LLM.

Optimizer replicas, a ZeroMQ controller/processor mesh, dying-gasp checkpoints (TTP),
on-chip memory fault repair (UCE) and worker reboot (ARF). See README.md.
"""

__version__ = "0.1.0"
