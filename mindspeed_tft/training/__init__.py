"""The reference trainer on megatron-core, shaped like Megatron-LM's `megatron.training`.

Modules:

- `training`: the training loop (`pretrain`), shaped like Megatron-LM's `training.py`
- `arguments`: Megatron-LM's command line, with its names, defaults and meaning
- `initialize`: a training process brought up: platform, args, torch.distributed, topology
- `global_vars`: process-wide globals in Megatron-LM's manner: the args and the tokenizer
- `model`: the GPT model: megatron-core's `GPTModel`, configured from the args
- `data`: training data: megatron-core datasets and a resumable data order
- `tokenizer`: tokenizers, selected by Megatron-LM's `--tokenizer-type` names
- `checkpointing`: the trainer's checkpoints in Megatron-LM's layout, published atomically
"""

from mindspeed_tft.platform import import_megatron_core

import_megatron_core()  # before the trainer's modules import megatron-core

from mindspeed_tft.training.training import pretrain  # noqa: E402

__all__ = ["pretrain"]
