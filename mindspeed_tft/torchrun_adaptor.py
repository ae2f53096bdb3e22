"""Worker reboot for plain torchrun, the reference SDK's way: one line in the installed
`torchrun` script (`scripts/patch_torchrun.sh apply` adds it)::

    import mindspeed_tft.torchrun_adaptor

Importing this module is the named moment at which the ``torchrun`` patches of
`mindspeed_tft.patches` are installed (see `mindspeed_tft.launcher.torchrun_hook`); it is the
only module of the package whose import changes anything.
"""

from mindspeed_tft import patches

__all__: list[str] = []  # imported for its effect only

patches.install("torchrun")
