"""Worker reboot for plain `torchrun`: `import mindspeed_tft.torchrun_adaptor` in the torchrun
script.

The reference SDK is enabled under torchrun by adding one import to the installed `torchrun`
script (`scripts/patch_torchrun.sh` does it with `patches/torchrun.patch`). That import
installs the ``torchrun`` moment of `mindspeed_tft.patches` (`install_torchrun_hook`), which
changes two names in `torch.distributed.run`, the module the script's `main` comes from:

- `get_args_parser`: torch's parser plus `--tft-spares-per-node`;
- `run`: `mindspeed_tft.launcher.run.launch`, which hands runs without high availability to
  torch's own `run` unchanged and runs the others with the mindspeed-tft agent.

So plain torchrun behaves as before unless the training command turns high availability on,
and exactly like `tft-run` when it does. Installing twice is harmless.
"""

from __future__ import annotations

import sys
from typing import Any

from .options import get_args_parser, torch_run_functions
from .run import launch


def hooked_run(args: Any) -> None:
    """`torch.distributed.run.run` under the hook (exits with the launch's code if not 0)."""
    code = launch(args)
    if code:
        sys.exit(code)


def install_torchrun_hook() -> None:
    """Route `torch.distributed.run`'s launch through mindspeed-tft (idempotent)."""
    import torch.distributed.run as torch_run

    if getattr(torch_run, "_mindspeed_tft_hooked", False):
        return
    original_run, original_parser = torch_run_functions()
    torch_run._mindspeed_tft_original_run = original_run  # type: ignore[attr-defined]
    torch_run._mindspeed_tft_original_get_args_parser = original_parser  # type: ignore[attr-defined]
    torch_run.run = hooked_run
    torch_run.get_args_parser = get_args_parser
    torch_run._mindspeed_tft_hooked = True  # type: ignore[attr-defined]
