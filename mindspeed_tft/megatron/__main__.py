"""``python -m mindspeed_tft.megatron SCRIPT [ARGS]``: run a Megatron-LM training script
unchanged, with the Megatron-LM host adaptor installed first (see `mindspeed_tft.megatron`).
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m mindspeed_tft.megatron SCRIPT [ARGS...]  (e.g. Megatron-LM's "
              "pretrain_gpt.py and its flags)", file=sys.stderr)
        raise SystemExit(2)
    script = argv[0]
    if not os.path.isfile(script):
        print(f"mindspeed_tft.megatron: error: {script!r}: no such training script",
              file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would
    from mindspeed_tft.startup import defer_gc

    defer_gc()  # until Megatron-LM's pretrain() begins: see mindspeed_tft.startup
    from mindspeed_tft.megatron import install

    install()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
