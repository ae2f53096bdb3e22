"""The launcher of mindspeed-tft: worker reboot (ARF) at the process level (SPEC 9, 11).

- `run`: `tft-run`, a drop-in for torchrun (`mindspeed_tft.launcher.run:main`)
- `torchrun_hook`: the same behaviour for plain `torchrun` once its script imports this
  package (`scripts/patch_torchrun.sh` applies `patches/torchrun.patch`); importing the
  package installs the hook, which changes nothing unless high availability is on
- `options`: torchrun's arguments plus `--tft-spares-per-node`, `TFT_MAX_WORKER_RESTARTS`,
  and the features read from the training command (`--enable-high-availability`,
  `--enable-worker-reboot`, `HIGH_AVAILABILITY`)
- `agent`: torch's `LocalElasticAgent` with the controller in node 0's launcher, restarts of
  failed workers only, and replacement launchers that rejoin a running job
- `pool` / `spare`: warm spare workers, the launcher's and the worker's side
  (`spare.wait_for_assignment()` at the top of the trainer's `pretrain()`)
"""

from .spare import wait_for_assignment
from .torchrun_hook import install_torchrun_hook, torchrun_hook_installed

install_torchrun_hook()

__all__ = ["install_torchrun_hook", "torchrun_hook_installed", "wait_for_assignment"]
