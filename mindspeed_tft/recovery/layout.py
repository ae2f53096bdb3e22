"""Megatron-LM's checkpoint layout (torch format) and what every host's checkpoints share:
folder and file names, the tracker file, publishing a checkpoint atomically, and the RNG
state of a process.

Layout under the save directory (SPEC 11)::

    latest_checkpointed_iteration.txt          the last published iteration
    iter_0000100/
        mp_rank_00/model_optim_rng.pt          PP = 1: per tensor-parallel rank
        mp_rank_00_001/model_optim_rng.pt      PP > 1: per (TP, PP) rank
        mp_rank_00/distrib_optim.pt            distributed optimizer: fp32 main params,
                                               exp_avg, exp_avg_sq (megatron-core's DP-zero
                                               format)

The content of `model_optim_rng.pt` is the host's (see `RecoverableState`); the RNG state
inside it is `get_rng_state()`'s dict, the keys Megatron-LM uses.

Publishing (`publish_checkpoint`) is crash-safe: a process killed at any point of it leaves
the tracker on a complete checkpoint. Every file and folder of `iter_X_tmp` is fsynced
before any rename; an existing `iter_X` is never moved away before its replacement is
complete: the two are exchanged in one atomic `renameat2(RENAME_EXCHANGE)` (the old copy then
goes to `iter_X_old` and is removed after the tracker is written). Where the file system
cannot exchange names, the old `iter_X` is renamed to `iter_X_old` just before the new one is
renamed in; `resolve_checkpoint` (every loader of this project) puts a tracker's missing
`iter_X` back from `iter_X_old`, the one state a crash between those two renames leaves.
The tracker is replaced through a fsynced temporary file, then the folder is fsynced.

A checkpoint that cannot be written (a full file system, a quota, any failed write:
`checkpoint_writes`) has its partial files removed, publishes nothing, and leaves the
tracker and the checkpoint it names alone; `CheckpointWriteError.report` says so in one line
that names the save folder and the space left on its file system (`full_folder_line`), for
a periodic save and a dump alike.

Loading (`load_file`) is weights-only: tensors, containers and numbers, plus the explicit
`CHECKPOINT_SAFE_GLOBALS` that `model_optim_rng.pt` needs (argparse.Namespace, numpy RNG
state); anything else in a pickle is refused, and every error names the file.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import os
import pickle
import random
import shutil
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from mindspeed_tft.faults import fire_publish_point
from mindspeed_tft.features import Features, ParallelSizes

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"
#: what a tracker holds for Megatron-LM's release checkpoint (its folder `release/`)
RELEASE = "release"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or folder."""


class TrackerError(CheckpointError):
    """The tracker file names no checkpoint that can be loaded (the message names the file
    and what it holds)."""


def iteration_dir_name(iteration: int) -> str:
    """`iter_0000100` for iteration 100."""
    return f"iter_{iteration:07d}"


def model_parallel_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron-LM's per-model-parallel-rank folder: `mp_rank_TT` or `mp_rank_TT_PPP`."""
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def this_rank_dir_name() -> str:
    """The model-parallel folder name of the calling rank."""
    from megatron.core import parallel_state as ps

    return model_parallel_dir_name(
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
    )


def read_tracker(root: str) -> int | None:
    """The last published iteration under `root`, or None when there is none.

    Raises ValueError for Megatron-LM's `release` (a release checkpoint: Megatron-LM's to
    read) and `TrackerError` for anything else that is not a positive iteration number
    (what Megatron-LM's `read_metadata` accepts: an iteration above 0, or `release`)."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
    if text == RELEASE:
        raise ValueError(f"{path} holds {text!r}; expected an iteration number")
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise TrackerError(
            f"{path} holds {text[:40]!r}: not a checkpoint to load; allowed: an iteration "
            f"number above 0 whose iter_XXXXXXX folder exists, or {RELEASE!r} (Megatron-LM's "
            "release checkpoint)")
    return int(text)


def write_tracker(root: str, iteration: int) -> None:
    """Replace the tracker atomically and durably (write and fsync a temporary file, rename
    it over the tracker, fsync the folder)."""
    tmp = os.path.join(root, f".{TRACKER_FILENAME}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, TRACKER_FILENAME))
    except BaseException:  # the tracker is untouched: no half-written copy of it stays
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(root)


def fsync_dir(path: str) -> None:
    """Make the entries of folder `path` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as error:  # some file systems cannot fsync a folder: nothing to do there
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(top: str) -> None:
    """fsync every file under `top`, then every folder, deepest first, `top` last."""
    for dirpath, _dirnames, filenames in os.walk(top, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


#: the mode of a save folder this project creates (the umask applies too): weights and
#: optimizer state are the user's and their group's, nobody else's
SAVE_DIR_MODE = 0o750


def make_save_dirs(path: str, root: str) -> None:
    """Create `path` and its missing parents up to the save folder `root`. A new folder gets
    the save folder's mode when that existed already (the user's choice), else
    `SAVE_DIR_MODE` (`root` itself included), and the group of the folder it is created in
    (the save folder's group)."""
    root = os.path.abspath(root)
    path = os.path.abspath(path)
    mode = SAVE_DIR_MODE
    if os.path.isdir(root):
        mode = os.stat(root).st_mode & 0o7777
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, mode)
        except FileExistsError:  # another rank made it
            continue
        take_group(folder)


def take_group(path: str) -> None:
    """Give `path` the group of the folder it is in (where the folder's group is not the
    process's, e.g. a project group; nothing where that is not allowed)."""
    gid = os.stat(os.path.dirname(os.path.abspath(path))).st_gid
    try:
        if os.stat(path).st_gid != gid:
            os.chown(path, -1, gid)
    except OSError:
        pass


def save_file(obj: Any, path: str) -> None:
    """`torch.save` to `path` (the user's umask, the folder's group), then fsync it (the
    writer's own flush, which a shared file system needs before another node publishes the
    folder)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    take_group(path)


# --- a checkpoint that cannot be written -------------------------------------------------

#: A write that failed without an errno (torch's own file writer, given a path as Megatron-LM
#: gives it, reports none) is taken for a full file system when less than this is left on it.
FULL_BELOW_BYTES = 1 << 20
_SPACE_ERRNOS = {errno.ENOSPC: "file system full", errno.EDQUOT: "disk quota exceeded"}
#: what the RuntimeError of torch's zip writer says of a write that failed
_TORCH_WRITER_MARKERS = ("PytorchStreamWriter", "inline_container.cc", "iostream error")


def disk_space(folder: str) -> tuple[int, int] | None:
    """(free, total) bytes of the file system that holds `folder` (or its nearest existing
    parent); free as a user without root sees it (statvfs `f_bavail`). None where it cannot
    be read."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def write_failure_reason(error: BaseException, folder: str) -> str | None:
    """What stopped a checkpoint write under the save folder `folder`, when `error` is a
    failed write: "file system full" (ENOSPC, or torch's file writer failing without an
    errno while less than `FULL_BELOW_BYTES` is left), "disk quota exceeded" (EDQUOT), else
    the OS error's own text. None when `error` is no failed write (it goes on as it is).
    Ask before the partial files are removed: they hold the space the write ran out of."""
    chain = _chain(error)
    oserrors = [e for e in chain if isinstance(e, OSError)]
    for e in oserrors:
        if e.errno in _SPACE_ERRNOS:
            return _SPACE_ERRNOS[e.errno]
    if oserrors:
        return str(oserrors[0])
    if any(marker in str(e) for e in chain for marker in _TORCH_WRITER_MARKERS):
        space = disk_space(folder)
        if space is not None and space[0] < FULL_BELOW_BYTES:
            return _SPACE_ERRNOS[errno.ENOSPC]
        return f"torch could not write a file ({str(error).splitlines()[0][:200]})"
    return None


def full_folder_line(folder: str, reason: str) -> str:
    """`<folder>: <reason> (<free> bytes free of <total>)`: the save folder, what stopped a
    write there and the space its file system has left now (what a periodic save and a dump
    that failed say)."""
    return _folder_line(folder, reason, disk_space(folder))


def _folder_line(folder: str, reason: str, space: tuple[int, int] | None) -> str:
    left = "free space unknown" if space is None else f"{space[0]} bytes free of {space[1]}"
    return f"{folder}: {reason} ({left})"


class CheckpointWriteError(OSError):
    """A checkpoint (`what`: "checkpoint", a periodic save, or "dump") that could not be
    written under its save folder `root`: its partial files are removed, nothing of it was
    published, the tracker is untouched. The message (`<what> of iteration N not written:
    <root>: <reason>`) travels with the fault; `report` prints the one line with the space."""

    def __init__(self, what: str, iteration: int, root: str, reason: str) -> None:
        super().__init__(f"{what} of iteration {iteration} not written: {root}: {reason}")
        self.what, self.iteration, self.root, self.reason = what, iteration, root, reason

    def report(self, rank: int) -> str:
        """Print the one line that says it (stderr: the save folder, the space left on its
        file system and the checkpoint the tracker still names) and record a
        `checkpoint_failed` event; returns the line."""
        from mindspeed_tft.events import emit

        try:
            last = read_tracker(self.root)
        except (ValueError, CheckpointError):
            last = None
        kept = (f"the last checkpoint stays iteration {last} "
                f"({os.path.join(self.root, iteration_dir_name(last))})" if last is not None
                else f"there is no earlier checkpoint under {self.root}")
        space = disk_space(self.root)  # read once: the line and the event say the same
        line = (f"[mindspeed-tft] ERROR: {self.what} of iteration {self.iteration} not "
                f"written: {_folder_line(self.root, self.reason, space)}; nothing of it "
                f"was published, {kept}")
        print(line, file=sys.stderr, flush=True)
        emit("checkpoint_failed", rank, what=self.what, iteration=self.iteration,
             path=self.root, reason=self.reason, free=None if space is None else space[0],
             total=None if space is None else space[1], last=last)
        return line


def remove_quietly(*paths: str) -> None:
    """Remove files and folders, whatever is left of them (partial files of a failed write)."""
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def discard_unpublished(root: str, iteration: int) -> None:
    """Remove what a failed save of `iteration` left under `root`: its `iter_X_tmp`, and its
    `iter_X` unless the tracker names it (or cannot be read): a published checkpoint is never
    touched."""
    final = os.path.join(root, iteration_dir_name(iteration))
    remove_quietly(final + "_tmp")
    try:
        published = read_tracker(root)
    except (ValueError, CheckpointError):
        return
    if published != iteration:
        remove_quietly(final)


@contextlib.contextmanager
def checkpoint_writes(what: str, iteration: int, root: str,
                      cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """The writes of a checkpoint under the save folder `root`: a write that fails (an
    OSError, or the RuntimeError of torch's file writer: `write_failure_reason`) runs
    `cleanup` (it removes the partial files) and becomes a `CheckpointWriteError`; any other
    error goes on unchanged."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except (OSError, RuntimeError) as error:
        reason = write_failure_reason(error, root)
        if reason is None:
            raise
        for link in _chain(error):  # a writer held by a finished frame keeps its file open,
            traceback.clear_frames(link.__traceback__)  # and a removed open file its space
        if cleanup is not None:
            cleanup()
        raise CheckpointWriteError(what, iteration, root, reason) from error


@contextlib.contextmanager
def in_place_save_writes(root: str, iteration: int, rank_dir_name: str) -> Iterator[None]:
    """`checkpoint_writes` of a save that writes `iter_X` in place and then the tracker with
    a plain write (Megatron-LM's own, torch format). After a failed write: a tracker that the
    save's own write left damaged is put back to the iteration it named, and this rank's
    folder `iter_X/<rank_dir_name>` (it is its only writer) is removed, with `iter_X` once
    empty, unless the tracker names iteration X."""
    tracker = os.path.join(root, TRACKER_FILENAME)
    try:
        before: int | None = read_tracker(root)
        readable = True
    except (ValueError, CheckpointError):  # release, or damaged already: not this save's
        before, readable = None, False

    def cleanup() -> None:
        try:
            now = read_tracker(root)
        except ValueError:
            return
        except CheckpointError:
            if not readable:
                return
            with contextlib.suppress(OSError):
                if before is None:
                    os.unlink(tracker)
                else:
                    write_tracker(root, before)
            now = before
        if now != iteration:
            final = os.path.join(root, iteration_dir_name(iteration))
            remove_quietly(os.path.join(final, rank_dir_name))
            with contextlib.suppress(OSError):
                os.rmdir(final)

    with checkpoint_writes("checkpoint", iteration, root, cleanup):
        yield


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc: Any = None


def exchange_paths(a: str, b: str) -> bool:
    """Swap the names `a` and `b` in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`).

    False where the platform or file system cannot (nothing was changed then)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    renameat2 = getattr(_libc, "renameat2", None) if _libc else None
    if renameat2 is None:
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


#: tests set it to False to take the path of file systems without RENAME_EXCHANGE
USE_EXCHANGE = True


def publish_checkpoint(root: str, iteration: int) -> str:
    """Publish the complete `iter_X_tmp` under `root` as `iter_X` and point the tracker at it.

    Crash-safe (see the module docstring): fsync everything, then rename `iter_X_tmp` to
    `iter_X`, or exchange it with an existing `iter_X`, then write the tracker, then remove
    the old copy. `TFT_INJECT` items of phase publish fire at each point
    (`mindspeed_tft.faults.PUBLISH_POINTS`). Returns the published folder."""
    final = os.path.join(root, iteration_dir_name(iteration))
    tmp, old = final + "_tmp", final + "_old"
    if not os.path.isdir(tmp):
        raise FileNotFoundError(f"{tmp} does not exist: there is no checkpoint to publish")
    try:  # a crash between the renames of an earlier publish: repair it first
        resolve_checkpoint(root)
    except (ValueError, CheckpointError):  # a damaged tracker: this publish replaces it
        pass
    fire_publish_point(iteration, "written")
    fsync_tree(tmp)
    fsync_dir(root)
    fire_publish_point(iteration, "synced")
    if os.path.lexists(final):
        if os.path.lexists(old):  # left by an earlier publish, after its iter_X was complete
            shutil.rmtree(old)
        if USE_EXCHANGE and exchange_paths(tmp, final):
            os.replace(tmp, old)  # the old copy, out of the way of the next iter_X_tmp
        else:
            os.replace(final, old)
            fsync_dir(root)
            fire_publish_point(iteration, "aside")
            os.replace(tmp, final)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    fire_publish_point(iteration, "renamed")
    write_tracker(root, iteration)
    fire_publish_point(iteration, "tracker")
    shutil.rmtree(old, ignore_errors=True)  # published already: a leftover is removed next time
    return final


def resolve_checkpoint(root: str) -> tuple[int, str] | None:
    """The tracker's iteration under `root` and its folder; None without a tracker.

    A tracker whose `iter_X` is missing while `iter_X_old` exists was left by a crash
    between the two renames of a publish without RENAME_EXCHANGE: `iter_X_old`, complete,
    is renamed back (any number of ranks may call this at once). A tracker naming a folder
    that does not exist otherwise, or a tracker that holds no iteration number (but
    `release`: a ValueError), is a `TrackerError`."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    final = os.path.join(root, iteration_dir_name(iteration))
    if not os.path.isdir(final):
        old = final + "_old"
        try:  # every rank may try: one rename wins, the others find it done
            os.replace(old, final)
            fsync_dir(root)
        except OSError:
            pass
        if not os.path.isdir(final):
            raise TrackerError(
                f"{os.path.join(root, TRACKER_FILENAME)} names iteration {iteration}, but "
                f"{final} does not exist: the checkpoint directory was damaged or moved"
            )
    return iteration, final


#: What `model_optim_rng.pt` holds beyond tensors, containers and numbers: Megatron-LM's
#: `args` (an argparse.Namespace; the reference trainer's carries its `Features`, with their
#: `ParallelSizes`) and the numpy RNG state (an ndarray of uint32).
CHECKPOINT_SAFE_GLOBALS: tuple[Any, ...] = (
    argparse.Namespace,
    Features,
    ParallelSizes,
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    (getattr(np, "_core", None) or np.core).multiarray._reconstruct,
)


def load_file(path: str, safe_globals: Iterable[Any] = ()) -> Any:
    """`torch.load(path, weights_only=True)` on CPU with `safe_globals` allowed on top of
    torch's weights-only set; any failure is a `CheckpointError` naming `path`."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist")
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
        detail = next((line for line in lines if "GLOBAL" in line), lines[0])
        raise CheckpointError(
            f"{path} was refused: it holds something other than tensors and the allowed "
            f"types (weights-only load, nothing in it was run): "
            f"{detail.split('. ')[0].rstrip('.')}"
        ) from error
    except Exception as error:
        raise CheckpointError(
            f"{path} cannot be read (truncated or corrupt?): {type(error).__name__}: {error}"
        ) from error


def get_rng_state() -> dict[str, Any]:
    """Every RNG this process uses: python, numpy, torch, the model-parallel tracker."""
    from megatron.core import tensor_parallel

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    else:  # Megatron-LM's loader restores it unconditionally (on CPU: the CPU generator)
        state["cuda_rng_state"] = state["torch_rng_state"]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned."""
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
