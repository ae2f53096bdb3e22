"""Checksummed checkpoints: a manifest beside Megatron's own files, verified before a load.

Every model-parallel folder a save or a dump writes (``iter_X/mp_rank_XX/``) gets a
``tft_manifest.json`` beside ``model_optim_rng.pt`` and ``distrib_optim.pt``. Megatron-LM's
loader does not look at it, so plain Megatron-LM still loads the checkpoint. The manifest
holds, for every file of the folder, its size and the XXH3-128 digest (the `xxhash`
library) of every byte, cut into records: a torch file is a zip archive with one member per
tensor storage, and each member's bytes are a record of their own (named after the
member), the bytes between them (zip headers, the pickled structure) records too. One pass
over the file computes them all, and a mismatch says which member, hence which tensor.

`verify_folder` (called on every load, by both hosts, before any tensor of the folder is
read) recomputes the records and compares. A mismatch is a `ManifestMismatch` naming the
checkpoint, the file and the tensor(s) whose bytes changed (found by reading the file's
pickled structure with a placeholder unpickler that builds nothing and runs nothing: it only
maps storage keys to the paths of the tensors that use them). A folder without a manifest
(a checkpoint of plain Megatron-LM, or one written before manifests) is reported as
unverified and loaded as before.

`verify_for_load` is the collective start-up check: data-parallel rank 0 of each
model-parallel position verifies its folder, the verdict is all-reduced, and every rank
exits with code 2 when one folder failed (the failing ranks print one line each, naming
the file, the tensor and the checkpoint, and the previous checkpoint when one exists). A
repair that reloads a checkpoint raises instead (the repair fails and the job dumps).
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import re
import struct
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from mindspeed_tft.events import emit
from mindspeed_tft.process_exit import exit_without_teardown, print_error
from mindspeed_tft.recovery.layout import (
    TRACKER_FILENAME,
    CheckpointError,
    TrackerError,
    iteration_dir_name,
    resolve_checkpoint,
    take_group,
)

MANIFEST_FILENAME = "tft_manifest.json"
MANIFEST_FORMAT = "mindspeed-tft-manifest"
MANIFEST_VERSION = 1
ALGORITHM = "xxh3_128"
#: exit code of every rank when `--load` finds a checkpoint whose bytes differ from its manifest
CORRUPT_CHECKPOINT_EXIT_CODE = 2
#: at most this many tensors are named in one message
_NAMED = 3
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_ITER_DIR = re.compile(r"iter_(\d{7})")


class ManifestMismatch(CheckpointError):
    """A checkpoint file's bytes differ from its manifest (the message names file, tensor
    and checkpoint)."""


def _digest(data: Any) -> str:
    import xxhash

    return str(xxhash.xxh3_128_hexdigest(data))


@dataclass
class _Record:
    name: str
    offset: int
    length: int


def _zip_records(path: str, size: int) -> list[_Record] | None:
    """The file cut into records: each zip member's stored bytes, and the bytes between
    them; None when the file is not a zip archive (one record then) or a member is
    compressed (torch stores them uncompressed)."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = sorted(archive.infolist(), key=lambda i: i.header_offset)
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    records: list[_Record] = []
    position = 0
    with open(path, "rb") as f:
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            f.seek(info.header_offset)
            header = f.read(_LOCAL_HEADER.size)
            if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                return None
            fields = _LOCAL_HEADER.unpack(header)
            start = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
            if start < position or start + info.compress_size > size:
                return None
            if start > position:
                records.append(_Record(f"<zip header before {info.filename}>", position,
                                       start - position))
            records.append(_Record(info.filename, start, info.compress_size))
            position = start + info.compress_size
    if position < size:
        records.append(_Record("<zip directory>", position, size - position))
    return records


def file_digests(path: str) -> dict[str, Any]:
    """The manifest entry of one file: its size and the digest of each record."""
    size = os.path.getsize(path)
    records = _zip_records(path, size) or [_Record("<file>", 0, size)]
    digests: list[list[Any]] = []
    with open(path, "rb") as f:
        if size == 0:
            view = memoryview(b"")
            mapped = None
        else:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(mapped)
        try:
            for record in records:
                piece = view[record.offset:record.offset + record.length]
                digests.append([record.name, record.offset, record.length, _digest(piece)])
                piece.release()
        finally:
            view.release()
            if mapped is not None:
                mapped.close()
    return {"size": size, "records": digests}


def _folder_files(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder)
                  if name != MANIFEST_FILENAME and not name.startswith(".")
                  and os.path.isfile(os.path.join(folder, name)))


def write_manifest(folder: str, iteration: int, files: list[str] | None = None) -> str:
    """Write `folder`'s manifest (every file in it, or `files`), fsynced; returns its path.
    Written through a temporary name, so a folder never holds a half-written manifest."""
    started = time.perf_counter()
    names = files if files is not None else _folder_files(folder)
    digests = {name: file_digests(os.path.join(folder, name)) for name in names}
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                "algorithm": ALGORITHM, "iteration": iteration, "files": digests}
    path = os.path.join(folder, MANIFEST_FILENAME)
    tmp = path + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    take_group(tmp)
    os.replace(tmp, path)
    emit("manifest_written", _rank(), folder=folder, iteration=iteration,
         bytes=sum(entry["size"] for entry in digests.values()),
         seconds=round(time.perf_counter() - started, 6))
    return path


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    return int(dist.get_rank()) if dist is not None and dist.is_initialized() else 0


def remove_manifest(folder: str) -> None:
    """Drop `folder`'s manifest before its files are written again (a stale one would refuse
    the new files)."""
    try:
        os.remove(os.path.join(folder, MANIFEST_FILENAME))
    except FileNotFoundError:
        pass


def _read_manifest(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, MANIFEST_FILENAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as error:
        raise ManifestMismatch(f"{path} cannot be read: {error}") from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(files, dict) or manifest.get("format") != MANIFEST_FORMAT
            or manifest.get("algorithm") != ALGORITHM):
        raise ManifestMismatch(f"{path} is not a {MANIFEST_FORMAT} of algorithm {ALGORITHM}")
    return manifest


# --- naming the tensors of a damaged member -------------------------------------------------


class _StorageRef:
    def __init__(self, key: str) -> None:
        self.key = key


class _TensorRef:
    def __init__(self, key: str) -> None:
        self.key = key


class _Stub:
    """Whatever a pickle names: nothing is imported or run; its state is kept to walk."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.stub_args = args

    def __setstate__(self, state: Any) -> None:
        self.stub_state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("stub_items", {})[key] = value

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("stub_list", []).append(value)

    def extend(self, values: Any) -> None:
        self.__dict__.setdefault("stub_list", []).extend(values)


def _rebuild(*args: Any, **kwargs: Any) -> Any:
    for arg in args:
        if isinstance(arg, (_StorageRef, _TensorRef)):
            return _TensorRef(arg.key)
    return _Stub(*args)


class _PlaceholderUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return dict
        if module.startswith("torch") and name.startswith("_rebuild"):
            return _rebuild
        return type(name, (_Stub,), {})

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage":
            return _StorageRef(str(pid[2]))
        return _Stub(pid)


def _walk(obj: Any, path: str, out: dict[str, list[str]], depth: int = 0) -> None:
    if depth > 64:
        return
    if isinstance(obj, _TensorRef):
        out.setdefault(obj.key, []).append(path or "<root>")
        return
    if isinstance(obj, dict):
        items: Iterator[tuple[Any, Any]] = iter(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = iter(enumerate(obj))
    elif isinstance(obj, _Stub):
        items = iter({k: v for k, v in vars(obj).items()}.items())
    else:
        return
    for key, value in items:
        name = key if isinstance(key, (str, int)) else type(key).__name__
        if isinstance(obj, _Stub) and key in ("stub_args", "stub_state", "stub_items",
                                              "stub_list"):
            _walk(value, path, out, depth + 1)
        else:
            _walk(value, f"{path}/{name}" if path else str(name), out, depth + 1)


def tensor_names(path: str) -> dict[str, list[str]]:
    """Zip member name -> the paths of the tensors stored in it, from the file's pickled
    structure (read with placeholders only); empty when it cannot be read."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            if len(pickles) != 1:
                return {}
            prefix = pickles[0][: -len("data.pkl")]
            structure = _PlaceholderUnpickler(archive.open(pickles[0])).load()
    except Exception:  # a damaged structure names no tensor: the member names stay
        return {}
    keys: dict[str, list[str]] = {}
    _walk(structure, "", keys)
    return {f"{prefix}data/{key}": paths for key, paths in keys.items()}


# --- verification ----------------------------------------------------------------------------


def _describe_members(path: str, members: list[str]) -> str:
    names = tensor_names(path)
    parts = []
    for member in members[:_NAMED]:
        tensors = names.get(member)
        if tensors:
            parts.append(f"tensor {', '.join(tensors[:2])} (zip member {member})")
        elif member.endswith("data.pkl"):
            parts.append(f"its pickled structure ({member})")
        else:
            parts.append(f"{member}")
    if len(members) > _NAMED:
        parts.append(f"and {len(members) - _NAMED} more")
    return "; ".join(parts)


def check_file(path: str, entry: Any) -> str | None:
    """None when `path` matches its manifest `entry`, else what differs."""
    if not os.path.isfile(path):
        return "the file is missing"
    if not isinstance(entry, dict) or not isinstance(entry.get("records"), list):
        return "its manifest entry is malformed"
    size = os.path.getsize(path)
    if size != entry.get("size"):
        return f"it has {size} bytes, the manifest says {entry.get('size')} (truncated?)"
    now = file_digests(path)["records"]
    expected = entry["records"]
    by_range = {(r[1], r[2]): r for r in now}
    damaged = []
    for record in expected:
        if not isinstance(record, list) or len(record) != 4:
            return "its manifest entry is malformed"
        name, offset, length, digest = record
        current = by_range.get((offset, length))
        if current is None or current[3] != digest:
            damaged.append(str(name))
    if not damaged:
        return None
    return "bytes differ from the manifest in " + _describe_members(path, damaged)


@dataclass
class FolderVerdict:
    """What `verify_folder` found: `problem` (None: verified, or unverified without a
    manifest) and `verified`."""

    verified: bool
    problem: str | None = None


def verify_folder(folder: str) -> FolderVerdict:
    """Check every file of `folder` against its manifest; raises nothing."""
    try:
        manifest = _read_manifest(folder)
    except ManifestMismatch as error:
        return FolderVerdict(False, str(error))
    if manifest is None:
        return FolderVerdict(False)
    files = manifest["files"]
    for name in sorted(set(_folder_files(folder)) | set(files)):
        if name not in files:
            if name.endswith(".pt"):
                return FolderVerdict(False, f"{os.path.join(folder, name)}: not in its manifest")
            continue
        problem = check_file(os.path.join(folder, name), files[name])
        if problem is not None:
            return FolderVerdict(False, f"{os.path.join(folder, name)}: {problem}")
    return FolderVerdict(True)


def previous_checkpoint(root: str, iteration: int) -> str | None:
    """The newest published checkpoint folder under `root` older than `iteration`."""
    try:
        names = os.listdir(root)
    except OSError:
        return None
    older = sorted((int(m.group(1)), name) for name in names
                   if (m := _ITER_DIR.fullmatch(name)) and int(m.group(1)) < iteration
                   and os.path.isdir(os.path.join(root, name)))
    return os.path.join(root, older[-1][1]) if older else None


def refusal(root: str, iteration: int, problem: str) -> str:
    """What a refused checkpoint is told with: the error line at start-up (`print_error`),
    the `ManifestMismatch` in a repair."""
    checkpoint = os.path.join(root, iteration_dir_name(iteration))
    line = f"checkpoint {checkpoint} is corrupt, not loaded: {problem}; "
    previous = previous_checkpoint(root, iteration)
    if previous is None:
        return line + "there is no earlier checkpoint under " + root
    number = int(os.path.basename(previous)[len("iter_"):])
    return line + (f"the previous checkpoint is {previous}: to resume from it, write {number} "
                   f"into {os.path.join(root, TRACKER_FILENAME)}")


def _distributed() -> bool:
    """Whether torch.distributed's default group exists in this process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _collective_max(flag: int) -> int:
    import torch
    import torch.distributed as dist

    if not _distributed():
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([flag], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def refuse_at_startup(message: str) -> NoReturn:
    """`--load` refused: this rank prints `message` in one line and exits with
    `CORRUPT_CHECKPOINT_EXIT_CODE` (without interpreter teardown once process groups exist)."""
    print_error(message)
    if _distributed():  # no interpreter teardown: it can abort the process (SIGABRT)
        exit_without_teardown(CORRUPT_CHECKPOINT_EXIT_CODE)
    sys.exit(CORRUPT_CHECKPOINT_EXIT_CODE)


def resolve_for_load(root: str, *, startup: bool) -> tuple[int, str] | None:
    """`layout.resolve_checkpoint(root)`, a bad tracker refused (a `TrackerError`: no
    iteration number, or one without its folder): at start-up (`startup`) every rank prints
    the one line and exits 2 (each reads the same file, before any collective); in a repair
    the error is raised (the repair fails). A ValueError for `release` passes to the caller."""
    try:
        return resolve_checkpoint(root)
    except TrackerError as error:
        if not startup:
            raise
        refuse_at_startup(f"--load {root}: {error}")


def verify_for_load(root: str | None, rank_dir_name: str, verifier: bool, rank: int, *,
                    startup: bool) -> None:
    """Verify this rank's folder of the checkpoint `--load` (or a repair) will read, before
    any of its tensors is used. Collective over the default group when it exists.

    `verifier`: this rank checks (data-parallel rank 0 of its model-parallel position).
    A mismatch anywhere: at start-up (`startup`) every rank exits with
    `CORRUPT_CHECKPOINT_EXIT_CODE`, the failing ones after printing one line; in a repair a
    `ManifestMismatch` is raised. A bad tracker: `resolve_for_load`. Without a manifest,
    rank 0 prints that the checkpoint is unverified."""
    try:
        found = resolve_for_load(root, startup=startup) if root else None
    except ValueError:  # a tracker naming no iteration ("release"): Megatron-LM's to read
        found = None
    if found is None or root is None:
        return
    iteration, directory = found
    folder = os.path.join(directory, rank_dir_name)
    verdict = FolderVerdict(True)
    if verifier and os.path.isdir(folder):
        started = time.perf_counter()
        verdict = verify_folder(folder)
        emit("manifest_verified", rank, folder=folder, iteration=iteration,
             verified=verdict.verified, problem=verdict.problem,
             seconds=round(time.perf_counter() - started, 6))
    failed = _collective_max(int(verdict.problem is not None))
    if verdict.problem is not None:
        message = refusal(root, iteration, verdict.problem)
        if not startup:
            raise ManifestMismatch(message)
        refuse_at_startup(message)
    if failed:
        if not startup:
            raise ManifestMismatch(f"checkpoint {directory} is corrupt (another rank's folder "
                                   "differs from its manifest)")
        if _distributed():  # no interpreter teardown: it can abort the process (SIGABRT)
            exit_without_teardown(CORRUPT_CHECKPOINT_EXIT_CODE)
        sys.exit(CORRUPT_CHECKPOINT_EXIT_CODE)
    if rank == 0 and verifier and not verdict.verified:
        print(f"[mindspeed-tft] checkpoint {directory} has no {MANIFEST_FILENAME} in "
              f"{rank_dir_name} (not written by mindspeed-tft): loaded unverified", flush=True)


# --- the hosts' hook points ------------------------------------------------------------------


def _verifier() -> bool:
    """Whether this rank writes and checks its model-parallel folder (data-parallel rank 0,
    megatron-core's writer)."""
    from megatron.core import parallel_state as ps

    return bool(ps.get_data_parallel_rank() == 0)


def before_save(root: str | None, iteration: int) -> None:
    """A host is about to write the checkpoint of `iteration` under `root` in place (Megatron-LM
    writes into `iter_X` itself): drop a manifest a previous save of it left."""
    from mindspeed_tft.recovery.layout import make_save_dirs, this_rank_dir_name

    if root:  # a save folder Megatron-LM would create 0755 (its folders in it follow umask)
        make_save_dirs(root, root)
    if root and _verifier():
        remove_manifest(os.path.join(root, iteration_dir_name(iteration), this_rank_dir_name()))


def after_save(root: str | None, iteration: int) -> None:
    """A host wrote the checkpoint of `iteration` under `root` (every rank's files are in
    place): the manifest of this rank's folder, when this rank is its writer."""
    from mindspeed_tft.recovery.layout import this_rank_dir_name

    if not root or not _verifier():
        return
    folder = os.path.join(root, iteration_dir_name(iteration), this_rank_dir_name())
    if os.path.isdir(folder):
        write_manifest(folder, iteration)


def before_load(root: str | None, *, startup: bool) -> None:
    """`verify_for_load` of this rank's folder of the checkpoint under `root`."""
    import torch.distributed as dist

    from mindspeed_tft.recovery.layout import this_rank_dir_name

    rank = dist.get_rank() if dist.is_initialized() else 0
    verify_for_load(root, this_rank_dir_name(), _verifier(), rank, startup=startup)


# --- the mindio_ttp route: a dump the host's own handlers wrote, its load in Megatron-LM ----


def write_dump_manifests(folder: str, iteration: int) -> list[str]:
    """The manifests of a dump a host's save handlers wrote into `folder` (`iter_X_tmp`):
    one per `mp_rank_*` folder in it, or one for `folder` itself when its files lie in it
    directly; returns their paths (none when `folder` does not exist)."""
    if not os.path.isdir(folder):
        return []
    ranks = sorted(name for name in os.listdir(folder) if name.startswith("mp_rank_")
                   and os.path.isdir(os.path.join(folder, name)))
    folders = [os.path.join(folder, name) for name in ranks]
    if _folder_files(folder):
        folders.append(folder)
    return [write_manifest(path, iteration) for path in folders]


def install_load_verify() -> None:
    """The `sdk-load-verify` moment of `mindspeed_tft.patches`: Megatron-LM's
    `_load_base_checkpoint` (every `load_checkpoint` reads the checkpoint through it)
    verifies the folder first (`before_load`): at start-up (the main thread) a mismatch or
    a bad tracker exits 2 in one line; in a repair (a handler's thread) it raises. Nothing
    where Megatron-LM's checkpointing is not imported."""
    module: Any = sys.modules.get("megatron.training.checkpointing")
    if module is None:
        return
    import functools
    import threading

    original = module._load_base_checkpoint

    @functools.wraps(original)
    def _load_base_checkpoint(load_dir: Any, args: Any, rank0: bool = False, *rest: Any,
                              **kwargs: Any) -> Any:
        if not rank0:  # rank0=True: the args of the checkpoint only, before the groups exist
            startup = threading.current_thread() is threading.main_thread()
            before_load(load_dir, startup=startup)
        return original(load_dir, args, rank0, *rest, **kwargs)

    module._load_base_checkpoint = _load_base_checkpoint
