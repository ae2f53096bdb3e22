"""One line at the top of a Megatron-LM training script switches mindspeed-tft on::

    import mindspeed_tft.megatron_adaptor  # noqa: F401  (before Megatron-LM's imports)

MindSpeed's convention (`import mindspeed.megatron_adaptor`). Importing this module is the
named moment at which the Megatron-LM host adaptor is installed (`mindspeed_tft.megatron`);
it is, with `mindspeed_tft.torchrun_adaptor`, the only module whose import changes anything.
"""

from mindspeed_tft.startup import defer_gc

__all__: list[str] = []  # imported for its effect only

defer_gc()  # until Megatron-LM's pretrain() begins: see mindspeed_tft.startup

from mindspeed_tft.megatron import install  # noqa: E402

install()
