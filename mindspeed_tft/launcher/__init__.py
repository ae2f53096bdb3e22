"""The launcher of mindspeed-tft: worker reboot (ARF) at the process level (SPEC 9, 11).

`tft-run` is a drop-in for torchrun (`mindspeed_tft.launcher.run:main`). Plain `torchrun`
behaves the same once its script imports `mindspeed_tft.torchrun_adaptor`
(`scripts/patch_torchrun.sh` applies `patches/torchrun.patch`), which installs the hook (the
``torchrun`` moment of `mindspeed_tft.patches`); it changes nothing unless high availability
is on.

Modules:

- `run`: `tft-run`, a torchrun that restarts only failed workers when worker reboot is on
- `options`: torchrun's arguments, the launcher's own, and the training command's features
- `agent`: torch's `LocalElasticAgent` with the controller in node 0, per-worker restarts
- `torchrun_hook`: the same behaviour for plain `torchrun` (`torchrun_adaptor`)
- `pool`: warm spare workers, the launcher's side: start them, hand one a rank
- `spare`: warm spare workers, the worker's side (`spare.wait_for_assignment()`)
- `warm_memory`: host memory a waiting spare keeps ready for the state it will build
- `lifetime`: workers and spares never outlive their launcher (parent-death signal)
- `exit_report`: a launcher's report of a worker's end to another node's controller
- `heartbeat`: launchers heard across nodes, through the job's store
- `store`: the job's rendezvous store, listening on the job's address only
"""

from .spare import wait_for_assignment

__all__ = ["wait_for_assignment"]
