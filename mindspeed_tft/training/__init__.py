"""The reference trainer on megatron-core, shaped like Megatron-LM's `megatron.training`."""

from mindspeed_tft.training.training import pretrain

__all__ = ["pretrain"]
