"""The reference trainer on megatron-core, shaped like Megatron-LM's `megatron.training`."""

from mindspeed_tft.platform import import_megatron_core

import_megatron_core()  # before the trainer's modules import megatron-core

from mindspeed_tft.training.training import pretrain  # noqa: E402

__all__ = ["pretrain"]
