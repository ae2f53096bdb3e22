"""Worker reboot for plain `torchrun`: `import mindspeed_tft.launcher` in the torchrun script.

The reference SDK is enabled under torchrun by adding one import to the installed `torchrun`
script (`scripts/patch_torchrun.sh` does it with `patches/torchrun.patch`). That import runs
`install_torchrun_hook()`, which changes two names in `torch.distributed.run`, the module the
script's `main` comes from:

- `get_args_parser`: torch's parser plus `--tft-spares-per-node`;
- `run`: `mindspeed_tft.launcher.run.launch`, which hands runs without high availability to
  torch's own `run` unchanged and runs the others with the mindspeed-tft agent.

So plain torchrun behaves as before unless the training command turns high availability on,
and exactly like `tft-run` when it does. Installing twice is harmless.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch.distributed.run as _torch_run

#: torch's own functions, whatever was installed later
ORIGINAL_RUN = getattr(_torch_run, "_mindspeed_tft_original_run", _torch_run.run)
ORIGINAL_GET_ARGS_PARSER = getattr(_torch_run, "_mindspeed_tft_original_get_args_parser",
                                   _torch_run.get_args_parser)


def get_args_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser with the launcher's options added."""
    from .options import add_launcher_args

    return add_launcher_args(ORIGINAL_GET_ARGS_PARSER())


def hooked_run(args: Any) -> None:
    """`torch.distributed.run.run` under the hook (exits with the launch's code if not 0)."""
    from .run import launch

    code = launch(args)
    if code:
        sys.exit(code)


def install_torchrun_hook() -> None:
    """Route `torch.distributed.run`'s launch through mindspeed-tft (idempotent)."""
    if getattr(_torch_run, "_mindspeed_tft_hooked", False):
        return
    _torch_run._mindspeed_tft_original_run = ORIGINAL_RUN  # type: ignore[attr-defined]
    _torch_run._mindspeed_tft_original_get_args_parser = (  # type: ignore[attr-defined]
        ORIGINAL_GET_ARGS_PARSER)
    _torch_run.run = hooked_run
    _torch_run.get_args_parser = get_args_parser
    _torch_run._mindspeed_tft_hooked = True  # type: ignore[attr-defined]


def torchrun_hook_installed() -> bool:
    """True once `install_torchrun_hook` ran in this process."""
    return bool(getattr(_torch_run, "_mindspeed_tft_hooked", False))
