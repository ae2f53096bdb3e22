"""A training process's data loader under a launcher's stop, without the training around it.

    python data_worker_stop.py OUT (tft|torch)

Run in a session (process group) of its own, as torch's launchers start their workers. It
marks SIGTERM as the plugin does under high availability (`plugin._Termination`: the stop is
noted, the process goes on), with `tft` installs the ``data-loader-workers`` patch moment,
starts a DataLoader with 2 persistent worker processes (fork, torch's default on Linux) and
takes its first batch, writes `OUT/ready.json` (its pid, the workers' pids), then takes the
rest of the batches, one every 0.2 s, so the test can signal its process group in between.
At the end it writes `OUT/result.json` (the batches, the error the loader raised if any,
whether a SIGTERM was seen) and exits with `sys.exit(0)`: the interpreter's exit, whose
multiprocessing clean-up terminates the workers and joins them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, index * index])


def main() -> int:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    stopped: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    if mode == "tft":
        from mindspeed_tft import patches

        patches.install("data-loader-workers")
    loader = DataLoader(Squares(), batch_size=4, num_workers=2, persistent_workers=True)
    batches, error = [], None
    iterator = iter(loader)
    try:
        try:
            batches.append(next(iterator).tolist())
            workers = [w.pid for w in iterator._workers]  # type: ignore[attr-defined]
            (out / "ready.json").write_text(json.dumps({"pid": os.getpid(), "workers": workers}))
            for batch in iterator:
                time.sleep(0.2)
                batches.append(batch.tolist())
        except RuntimeError as e:
            error = str(e)
            # torch's SIGCHLD handler raises again when the second worker's death is seen
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except RuntimeError as e:  # that second raise, inside the handler above
        error = error or str(e)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    (out / "result.json").write_text(json.dumps(
        {"batches": batches, "error": error, "sigterm": bool(stopped)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
