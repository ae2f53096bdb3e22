"""The launcher of mindspeed-tft: worker reboot (ARF) at the process level (SPEC 9, 11).

- `run`: `tft-run`, a drop-in for torchrun (`mindspeed_tft.launcher.run:main`)
- `torchrun_hook`: the same behaviour for plain `torchrun` once its script imports
  `mindspeed_tft.torchrun_adaptor` (`scripts/patch_torchrun.sh` applies
  `patches/torchrun.patch`), which installs the hook (the ``torchrun`` moment of
  `mindspeed_tft.patches`); it changes nothing unless high availability is on
- `options`: torchrun's arguments plus `--tft-spares-per-node`, `TFT_MAX_WORKER_RESTARTS`,
  and the features read from the training command (`--enable-high-availability`,
  `--enable-worker-reboot`, `HIGH_AVAILABILITY`)
- `agent`: torch's `LocalElasticAgent` with the controller in node 0's launcher, restarts of
  failed workers only, and replacement launchers that rejoin a running job
- `pool` / `spare`: warm spare workers, the launcher's and the worker's side
  (`spare.wait_for_assignment()` at the top of the trainer's `pretrain()`)
- `lifetime`: workers and spares never outlive their launcher (parent-death signal set
  between fork and exec, `TFT_LAUNCHER_PID`, and `tie_to_launcher()` in the worker)
"""

from .spare import wait_for_assignment

__all__ = ["wait_for_assignment"]
