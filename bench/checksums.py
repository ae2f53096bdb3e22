"""What the checksums cost: the checkpoint manifest against the save that writes it, the
shard checksum against the repair that moves the shard, and the verification at `--load`.

One 4-rank CPU job (torchrun, DP=4, distributed optimizer, 2 replicas, fp32; the tiny
preset at `--hidden`/`--ffn`, 17 M parameters by default) saves every `--save-interval`
iterations and takes a UCE in rank 2's optimizer state at step `--uce-step`, repaired from
the replica holder; then a second job `--load`s its last checkpoint. Side by side, from the
events of the same runs:

- save: each `checkpoint_saved`'s seconds against the `manifest_written` inside it (the
  manifest is part of the save: the ratio is manifest / (save - manifest));
- repair: the `shard_received` `check_seconds` (what the checksums add after the shard's last
  byte arrived: its message's digest and the wait for the sender's digests; `hash_s`: all
  the receiver's digests, most of them while later messages travelled) against the repair (`fault_detected` -> `repaired`) and against the time to
  recover (`fault_injected` -> the first iteration after `repaired`);
- load: `manifest_verified` seconds and the bytes verified.

    python bench/checksums.py                      # ~3 min here
    python bench/checksums.py --hidden 64 --ffn 176  # the tiny preset
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.jobs import HA_ARGS, run_tiny_job  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--save-interval", type=int, default=3)
    parser.add_argument("--uce-step", type=int, default=7)
    opts = parser.parse_args()
    env = {"TINY_HIDDEN_SIZE": str(opts.hidden), "TINY_FFN_HIDDEN_SIZE": str(opts.ffn)}
    config = {"layout": "dp4", "precision": "fp32", "train_iters": opts.iters,
              "save_interval": opts.save_interval, "env": env}
    with tempfile.TemporaryDirectory(prefix="bench-checksums-") as work:
        job = run_tiny_job(Path(work) / "job", ha_args=f"{HA_ARGS} --enable-hbmfault-repair",
                           inject=f"uce:rank=2,step={opts.uce_step},phase=backward,"
                                  "target=optimizer", timeout=1200, **config)
        if job.returncode != 0:
            print(job.describe(), file=sys.stderr)
            return 1
        saves = []
        manifests = {e["iteration"]: e for e in job.named("manifest_written")}
        for saved in job.named("checkpoint_saved"):
            written = manifests[saved["iteration"]]
            saves.append({"iteration": saved["iteration"], "save_s": saved["seconds"],
                          "manifest_s": written["seconds"], "bytes": written["bytes"],
                          "ratio": written["seconds"] / (saved["seconds"] - written["seconds"])})
        injected = job.named("fault_injected")[0]["time"]
        detected = job.named("fault_detected")[0]["time"]
        repaired = job.named("repaired")[0]["time"]
        first_step = next(e["time"] for e in job.events
                          if e["event"] == "iteration" and e["time"] > repaired)
        received = job.named("shard_received")
        check_s = sum(e["check_seconds"] for e in received)
        repair = {"repair_s": repaired - detected, "check_s": check_s,
                  "hash_s": sum(e["hash_seconds"] for e in received),
                  "shard_bytes": sum(e["bytes"] for e in received),
                  "copy_s": sum(e["seconds"] for e in received),
                  "ratio": check_s / (repaired - detected - check_s),
                  "recovery_s": first_step - injected,
                  "ratio_recovery": check_s / (first_step - injected - check_s)}
        # the same --train-iters (the scheduler must match): it loads, verifies, and ends
        loaded = run_tiny_job(Path(work) / "load", load_dir=job.checkpoint_dir, timeout=1200,
                              ha_args=HA_ARGS, **config)
        verified = loaded.named("manifest_verified")
        load = {"verify_s": [e["seconds"] for e in verified],
                "verified": [e["verified"] for e in verified], "exit": loaded.returncode}
    print(json.dumps({"hidden": opts.hidden, "ffn": opts.ffn, "saves": saves,
                      "repair": repair, "load": load}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
