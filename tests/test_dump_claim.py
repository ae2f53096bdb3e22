"""The claim on a dump's folder (`mindspeed_tft.recovery.dump.claim`): the two sides of a
network partition may each order the dump of one lock step into one shared save folder; one
side writes it, the other writes nothing. Unit tests, no processes: the real partitions are
tests/test_hosts.py's cut-off cases."""

from __future__ import annotations

import os
import time

import pytest

from mindspeed_tft.recovery.dump import (
    CLAIM_FILENAME,
    DumpError,
    claim,
    claimant_of,
    discard_position,
    publish,
    tmp_dir,
)
from mindspeed_tft.recovery.layout import MODEL_FILENAME

A, B = "controller 10.0.0.1:8000 epoch 0", "controller 10.0.0.2:41000 epoch 1"


def test_the_first_side_claims_and_the_other_writes_nothing(tmp_path) -> None:
    root = str(tmp_path)
    assert claim(root, 4, A, stale_after=180) is None
    assert claim(root, 4, A, stale_after=180) is None  # every rank of A's side
    assert claimant_of(tmp_dir(root, 4)) == A
    with pytest.raises(DumpError, match=r"iter_0000004_tmp is being written by controller "
                                        r"10\.0\.0\.1:8000 epoch 0 .*this side writes nothing"):
        claim(root, 4, B, stale_after=180)


def test_a_step_published_by_one_side_is_not_written_again(tmp_path) -> None:
    root = str(tmp_path)
    claim(root, 4, A, stale_after=180)
    rank_dir = os.path.join(tmp_dir(root, 4), "mp_rank_00")
    os.makedirs(rank_dir)
    open(os.path.join(rank_dir, MODEL_FILENAME), "wb").close()
    publish(root, 4, ["mp_rank_00"], A)
    assert claim(root, 4, B, stale_after=180) == A  # nothing to write: A published it
    assert not os.path.exists(tmp_dir(root, 4))


def test_publish_refuses_a_folder_claimed_by_the_other_side(tmp_path) -> None:
    root = str(tmp_path)
    claim(root, 4, B, stale_after=180)
    with pytest.raises(DumpError, match="is claimed by controller 10.0.0.2:41000 epoch 1"):
        publish(root, 4, [], A)


def test_a_dead_dumps_claim_is_taken_over(tmp_path) -> None:
    root = str(tmp_path)
    claim(root, 4, A, stale_after=180)
    old = time.time() - 200
    os.utime(os.path.join(tmp_dir(root, 4), CLAIM_FILENAME), (old, old))
    assert claim(root, 4, B, stale_after=180) is None
    assert claimant_of(tmp_dir(root, 4)) == B


def test_a_failed_dump_leaves_no_claim_behind(tmp_path, monkeypatch) -> None:
    from mindspeed_tft.recovery import dump

    monkeypatch.setattr(dump, "this_rank_dir_name", lambda: "mp_rank_00")  # no process groups
    root = str(tmp_path)
    claim(root, 4, A, stale_after=180)
    os.makedirs(os.path.join(tmp_dir(root, 4), "mp_rank_00"))
    discard_position(root, 4)
    assert not os.path.exists(tmp_dir(root, 4))
