"""A checkpoint that cannot be written (`mindspeed_tft.recovery.layout`): what stopped it, the
one line that names the save folder and its free space, the partial files removed and the
published checkpoint and tracker left alone. Unit tests, no processes: the real jobs (a
periodic save and a dump on a full tmpfs, both hosts) are tests/test_hosts_disk.py."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from mindspeed_tft import events
from mindspeed_tft.recovery import layout
from mindspeed_tft.recovery.layout import (
    TRACKER_FILENAME,
    CheckpointWriteError,
    checkpoint_writes,
    discard_unpublished,
    full_folder_line,
    in_place_save_writes,
    save_file,
    write_failure_reason,
    write_tracker,
)

#: the RuntimeError of torch's zip writer given a path (no errno; seen on a full tmpfs)
TORCH_PATH_WRITER = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


class _Statvfs:
    def __init__(self, free: int, total: int) -> None:
        self.f_frsize, self.f_bavail, self.f_blocks = 4096, free // 4096, total // 4096


def _space(monkeypatch: pytest.MonkeyPatch, free: int, total: int = 1 << 20) -> None:
    monkeypatch.setattr(layout.os, "statvfs", lambda path: _Statvfs(free, total))


def _raised_while(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise outer  # noqa: B904 (an implicit __context__, as torch's writer leaves it)
    except BaseException as error:
        return error


def test_the_reason_names_a_full_file_system_a_quota_or_the_error_itself(tmp_path):
    folder = str(tmp_path)
    assert write_failure_reason(OSError(errno.ENOSPC, "No space left on device"),
                                folder) == "file system full"
    assert write_failure_reason(OSError(errno.EDQUOT, "Disk quota exceeded"),
                                folder) == "disk quota exceeded"
    # torch's writer given a file object: its RuntimeError, raised while the OSError was
    wrapped = _raised_while(RuntimeError(TORCH_PATH_WRITER),
                            OSError(errno.ENOSPC, "No space left on device"))
    assert write_failure_reason(wrapped, folder) == "file system full"
    denied = PermissionError(errno.EACCES, "Permission denied", f"{folder}/x.pt")
    assert write_failure_reason(denied, folder) == f"[Errno 13] Permission denied: '{folder}/x.pt'"
    # not a failed write: it goes on as it is
    assert write_failure_reason(RuntimeError("Connection closed by peer"), folder) is None
    assert write_failure_reason(ValueError("bad"), folder) is None


def test_torch_s_path_writer_without_errno_is_full_only_when_the_space_is_gone(
        tmp_path, monkeypatch):
    _space(monkeypatch, free=8192)
    assert write_failure_reason(RuntimeError(TORCH_PATH_WRITER), str(tmp_path)) == \
        "file system full"
    _space(monkeypatch, free=64 << 20, total=1 << 30)
    assert write_failure_reason(RuntimeError(TORCH_PATH_WRITER), str(tmp_path)) == (
        f"torch could not write a file ({TORCH_PATH_WRITER})")


def test_the_line_names_the_folder_and_its_free_space(tmp_path, monkeypatch):
    _space(monkeypatch, free=8192)
    missing = tmp_path / "ckpt" / "not-yet"  # its nearest existing parent's file system
    assert full_folder_line(str(missing), "file system full") == (
        f"{missing}: file system full (8192 bytes free of 1048576)")

    def unreadable(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(layout.os, "statvfs", unreadable)
    assert full_folder_line(str(tmp_path), "file system full") == (
        f"{tmp_path}: file system full (free space unknown)")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_real_enospc_of_save_file_becomes_a_checkpoint_write_error():
    removed = []
    with pytest.raises(CheckpointWriteError) as raised:
        with checkpoint_writes("checkpoint", 3, "/dev", lambda: removed.append(True)):
            save_file({"t": torch.ones(10_000)}, "/dev/full")  # every write: ENOSPC
    assert str(raised.value) == "checkpoint of iteration 3 not written: /dev: file system full"
    assert isinstance(raised.value, OSError) and raised.value.reason == "file system full"
    assert removed == [True]


def test_other_errors_pass_unchanged_and_leave_the_files_alone(tmp_path):
    removed = []
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        with checkpoint_writes("dump", 7, str(tmp_path), lambda: removed.append(True)):
            raise RuntimeError("Connection closed by peer")
    already = CheckpointWriteError("dump", 7, str(tmp_path), "file system full")
    with pytest.raises(CheckpointWriteError) as raised:
        with checkpoint_writes("dump", 7, str(tmp_path), lambda: removed.append(True)):
            raise already
    assert raised.value is already and removed == []


def test_the_report_is_one_line_and_one_event(tmp_path, monkeypatch, capsys):
    _space(monkeypatch, free=8192)
    monkeypatch.delenv(events.EVENTS_FILE_ENV, raising=False)
    events_file = tmp_path / "events.jsonl"
    events.configure_events(str(events_file))
    root = tmp_path / "ckpt"
    (root / "iter_0000005").mkdir(parents=True)
    write_tracker(str(root), 5)
    try:
        line = CheckpointWriteError("dump", 10, str(root), "file system full").report(rank=3)
        CheckpointWriteError("checkpoint", 5, str(tmp_path / "new"),
                             "disk quota exceeded").report(rank=0)
    finally:
        events.configure_events(None)
    assert line == (f"[mindspeed-tft] ERROR: dump of iteration 10 not written: {root}: file "
                    "system full (8192 bytes free of 1048576); nothing of it was published, "
                    f"the last checkpoint stays iteration 5 ({root}/iter_0000005)")
    assert capsys.readouterr().err.splitlines() == [line, (
        f"[mindspeed-tft] ERROR: checkpoint of iteration 5 not written: {tmp_path}/new: disk "
        "quota exceeded (8192 bytes free of 1048576); nothing of it was published, there is "
        f"no earlier checkpoint under {tmp_path}/new")]
    recorded = [json.loads(x) for x in events_file.read_text().splitlines()]
    assert [{k: v for k, v in e.items() if k != "time"} for e in recorded] == [
        {"event": "checkpoint_failed", "rank": 3, "what": "dump", "iteration": 10,
         "path": str(root), "reason": "file system full", "free": 8192, "total": 1 << 20,
         "last": 5},
        {"event": "checkpoint_failed", "rank": 0, "what": "checkpoint", "iteration": 5,
         "path": str(tmp_path / "new"), "reason": "disk quota exceeded", "free": 8192,
         "total": 1 << 20, "last": None}]


def _folders(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_failed_save_removes_its_own_folders_and_never_the_published_one(tmp_path):
    root = tmp_path / "ckpt"
    for name in ("iter_0000005/mp_rank_00", "iter_0000010_tmp/mp_rank_00",
                 "iter_0000010/mp_rank_00"):
        (root / name).mkdir(parents=True)
    write_tracker(str(root), 5)
    discard_unpublished(str(root), 10)  # iter_10 complete but not published: goes too
    assert _folders(root) == ["iter_0000005", "iter_0000005/mp_rank_00", TRACKER_FILENAME]
    (root / "iter_0000005_tmp" / "mp_rank_00").mkdir(parents=True)
    discard_unpublished(str(root), 5)  # a save of the published iteration: its tmp only
    assert _folders(root) == ["iter_0000005", "iter_0000005/mp_rank_00", TRACKER_FILENAME]


def test_a_failed_tracker_write_leaves_the_old_tracker_and_no_temporary_file(
        tmp_path, monkeypatch):
    write_tracker(str(tmp_path), 5)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(layout.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_tracker(str(tmp_path), 10)
    assert os.listdir(tmp_path) == [TRACKER_FILENAME]
    assert (tmp_path / TRACKER_FILENAME).read_text() == "5"


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def _megatron_save(root: Path, iteration: int, *, tracker: str | None = None,
                   error: BaseException | None = None) -> None:
    """What Megatron-LM's own save does, in place: its rank folder, then (rank 0) the
    tracker with a plain write; `error` raised where it stops."""
    with in_place_save_writes(str(root), iteration, "mp_rank_00"):
        folder = root / f"iter_{iteration:07d}" / "mp_rank_00"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model_optim_rng.pt").write_bytes(b"partial")
        if tracker is not None:
            (root / TRACKER_FILENAME).write_text(tracker)
        if error is not None:
            raise error


def test_megatron_lms_in_place_save_that_fails_keeps_the_last_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    (root / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    write_tracker(str(root), 5)
    kept = ["iter_0000005", "iter_0000005/mp_rank_00", TRACKER_FILENAME]
    # a rank's file runs out of space: its folder goes, with iter_X once empty
    with pytest.raises(CheckpointWriteError, match="checkpoint of iteration 10 not written"):
        _megatron_save(root, 10, error=_enospc())
    assert _folders(root) == kept
    # another position's folder (another rank writes it) stays, and so does iter_X
    (root / "iter_0000010" / "mp_rank_01").mkdir(parents=True)
    with pytest.raises(CheckpointWriteError):
        _megatron_save(root, 10, error=_enospc())
    assert _folders(root) == ["iter_0000005", "iter_0000005/mp_rank_00", "iter_0000010",
                              "iter_0000010/mp_rank_01", TRACKER_FILENAME]
    (root / "iter_0000010" / "mp_rank_01").rmdir()
    # rank 0's own tracker write truncated it and ran out of space: put back to 5
    with pytest.raises(CheckpointWriteError):
        _megatron_save(root, 10, tracker="", error=_enospc())
    assert (root / TRACKER_FILENAME).read_text() == "5"
    assert _folders(root) == kept
    # the tracker already names the new iteration: published, nothing is removed
    with pytest.raises(CheckpointWriteError):
        _megatron_save(root, 10, tracker="10", error=_enospc())
    assert (root / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_megatron_lms_first_save_that_fails_leaves_no_empty_tracker(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    with pytest.raises(CheckpointWriteError):
        _megatron_save(root, 5, tracker="", error=_enospc())
    assert os.listdir(root) == []


def test_tft_report_tells_the_failed_write_with_the_free_space():
    from mindspeed_tft.tools import report

    t0 = 1000.0
    story = [
        {"time": t0, "event": "fault_detected", "rank": -1, "ranks": [0], "kind": "unknown",
         "message": "CheckpointWriteError: checkpoint of iteration 10 not written: /c: file "
                    "system full", "incident": 1},
        {"time": t0 + 0.1, "event": "state", "rank": -1, "state": "ABNORMAL",
         "prev": "NORMAL", "reason": "unknown on rank 0"},
        {"time": t0 + 0.5, "event": "checkpoint_failed", "rank": 1, "what": "dump",
         "iteration": 10, "path": "/c", "reason": "file system full", "free": 4096,
         "total": 1 << 20, "last": 5},
        {"time": t0 + 0.6, "event": "exit", "rank": -1, "code": 1, "reason": "dump failed",
         "incident": 1},
        {"time": t0 + 0.7, "event": "state", "rank": -1, "state": "FINAL", "prev": "EXIT",
         "reason": "dump failed"},
    ]
    (incident,) = report.incidents(story)
    assert ("  +   0.50 s  rank 1: dump of iteration 10 not written: /c: file system full "
            "(4096 bytes free of 1048576)") in report.describe_incident(incident)
