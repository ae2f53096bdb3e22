"""The manifest of a dump the host's own handlers wrote (`mindspeed_tft.recovery.manifest`).

The SDK's save handler writes the dying-gasp checkpoint into `<save>/iter_XXXXXXX_tmp/`
(MindSpeed-LLM's `tft_save_callback`, under Megatron-LM's `get_args().save`) and its rename
handler publishes it as `iter_XXXXXXX` with the tracker. Once every writer's save handler has
returned, the renaming rank writes the manifest of each `mp_rank_*` folder there, before it
calls the rename handler, so the manifest is published with the files; Megatron-LM's load
verifies it (the `sdk-load-verify` moment, installed by `tft_init_processor`).
"""

from __future__ import annotations

import logging
import os
import sys

from mindspeed_tft.recovery import manifest
from mindspeed_tft.recovery.layout import iteration_dir_name

log = logging.getLogger("mindio_ttp")


def save_root() -> str | None:
    """Where the host's handlers write the dump: Megatron-LM's `args.save` once its
    arguments are parsed (MindSpeed-LLM), else this process's own `--save DIR`; None
    without either."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    save = getattr(getattr(global_vars, "_GLOBAL_ARGS", None), "save", None)
    if save:
        return str(save)
    argv = sys.argv[1:]
    for index, arg in enumerate(argv):
        if arg == "--save" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--save="):
            return arg[len("--save="):]
    return None


def write_before_rename(step: int, rank: int | None) -> list[str]:
    """The manifests of the dump of `step` in `<save>/iter_X_tmp` (the paths written); a
    warning names what is missing when nothing could be written."""
    root = save_root()
    folder = os.path.join(root, iteration_dir_name(step) + "_tmp") if root else None
    written = manifest.write_dump_manifests(folder, step) if folder else []
    if not written:
        log.warning("rank %s: the dump of step %d is not checksummed: %s", rank, step,
                    f"{folder} does not exist" if folder else
                    "no save folder (neither Megatron-LM's args.save nor --save)")
    return written
