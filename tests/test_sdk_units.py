"""The parts of this project's `mindio_ttp` (sdk/) that need no job: the SDK's names and enum
values, fault classification by message, replica layouts, and the translation of this
control plane's repair and dump orders into the SDK's handler arguments."""

from __future__ import annotations

import os

import mindio_ttp.framework_ttp as ft
import pytest
from mindio_ttp import _translate as tr
from mindio_ttp import _zit
from mindio_ttp._faults import FaultTable
from mindio_ttp.framework_ttp import ttp_decorator
from mindio_ttp.utils import uce_utils

from mindspeed_tft.control.wire.order_types import DumpOrder, DumpShard, RepairOrder

#: every name MindSpeed-LLM 2.3.0 / master imports from mindio_ttp (core/high_availability)
MINDSPEED_LLM_NAMES = {
    ft: ["tft_exception_handler", "tft_init_controller", "tft_start_controller",
         "tft_init_processor", "tft_start_processor", "tft_register_rename_handler",
         "set_mindio_export_version", "tft_register_save_ckpt_handler",
         "tft_set_optimizer_replica", "tft_set_dp_group_info", "tft_register_stop_handler",
         "tft_register_clean_handler", "tft_register_repair_handler",
         "tft_register_rollback_handler", "tft_register_rebuild_group_handler",
         "tft_is_reboot_node", "tft_register_stream_sync_handler",
         "tft_register_exception_handler", "tft_register_zit_downgrade_rebuild_handler",
         "tft_register_zit_upgrade_rollback_handler", "tft_register_zit_upgrade_repair_handler",
         "tft_register_zit_upgrade_rebuild_handler", "tft_start_updating_os",
         "tft_end_updating_os", "tft_pause_train", "tft_report_error",
         "tft_destroy_controller", "tft_destroy_processor", "OptimizerType", "RepairType",
         "ReportState", "Action"],
    ttp_decorator: ["tft_get_repair_type", "tft_report_load_ckpt_step",
                    "get_mindio_export_version", "get_device"],
}


def test_every_name_mindspeed_llm_imports_exists():
    import mindio_ttp.utils as utils

    for module, names in MINDSPEED_LLM_NAMES.items():
        assert [n for n in names if not hasattr(module, n)] == []
    assert callable(utils.tft_set_update_start_time) and callable(utils.tft_set_update_end_time)
    assert set(ft.__all__) <= set(dir(ft))


def test_enum_values_are_the_sdks():
    """The values of Huawei's 7.3.0 (its SWIG constants, read from the wheel)."""
    assert {m.name: m.value for m in ft.ReportState} == {
        "RS_NORMAL": 0, "RS_RETRY": 1, "RS_UCE": 2, "RS_UCE_CORRUPTED": 3, "RS_HCCL_FAILED": 4,
        "RS_UNKNOWN": 8, "RS_INIT_FINISH": 5, "RS_PREREPAIR_FINISH": 6, "RS_STEP_FINISH": 7}
    assert {m.name: m.value for m in ft.RepairType} == {
        "RT_SEND": 0, "RT_UCE_HIGHLEVEL": 1, "RT_UCE_LOWLEVEL": 2, "RT_ROLLBACK": 4,
        "RT_RECV_REPAIR": 3, "RT_LOAD_CKPT": 5, "RT_LOAD_REBUILD": 6}
    assert [(m.name, m.value) for m in ft.OptimizerType] == [("ATTENTION", 0), ("MOE", 1)]
    assert [(m.name, m.value) for m in ft.Action] == [("RETRY", 0), ("EXIT", 1)]


@pytest.mark.parametrize("message,retry,expected", [
    ("UCE ERROR on device 3", True, ("UCE ERROR", "RS_UCE")),
    ("UCE ERROR on device 3", False, ("OTHER", "RS_UNKNOWN")),
    ("FORCE STOP. By mindio-ttp BeginUpdating", True, ("FORCE STOP", "RS_NORMAL")),
    ("ARF FINISH", True, ("ARF FINISH", "RS_PREREPAIR_FINISH")),
    ("HCCL OP RETRY FAILED x", True, ("HCCL OP RETRY FAILED", "RS_HCCL_FAILED")),
    ("SUSPECT REMOTE ERROR", True, ("SUSPECT REMOTE ERROR", "RS_HCCL_FAILED")),
    ("UB LINK ERROR", False, ("OTHER", "RS_UNKNOWN")),
    ("HCCS LINK ERROR", True, ("HCCS LINK ERROR", "RS_HCCL_FAILED")),
    ("something else", True, ("OTHER", "RS_UNKNOWN")),
])
def test_fault_patterns(message, retry, expected):
    key, state = FaultTable(lambda: retry).classify(message)
    assert (key, state.name) == expected


def test_hbm_ecc_is_repairable_only_after_or_during_an_update():
    table = FaultTable(lambda: True)
    uce_utils.tft_set_update_start_time(1000)
    uce_utils.tft_set_update_end_time(2000)
    assert table.classify("HBM MULTI BIT ECC time us=2500")[1] is ft.ReportState.RS_UCE
    assert table.classify("HBM MULTI BIT ECC time us=1500")[1] is ft.ReportState.RS_UCE
    assert table.classify("HBM MULTI BIT ECC time us=500")[1] is ft.ReportState.RS_UCE_CORRUPTED
    assert table.classify("HBM MULTI BIT ECC")[1] is ft.ReportState.RS_UCE_CORRUPTED


def test_registered_pattern_and_bad_registrations():
    table = FaultTable(lambda: True)
    table.register("PRECISION ERROR", "RS_RETRY", lambda message: "PRECISION ERROR")
    assert table.classify("PRECISION ERROR load ckpt step=40") == ("PRECISION ERROR",
                                                                   ft.ReportState.RS_RETRY)
    table.register("ODD", "RS_UNKNOWN", lambda message: "no such key")
    assert table.classify("ODD")[1] is ft.ReportState.RS_UNKNOWN
    with pytest.raises(ValueError, match="RS_NOPE"):
        table.register("X", "RS_NOPE", lambda m: "X")
    with pytest.raises(TypeError, match="callable"):
        table.register("X", "RS_UCE", "not callable")
    with pytest.raises(ValueError, match="non-empty"):
        table.register("", "RS_UCE", lambda m: "X")


def test_replica_layout_cuts_the_dp_group_into_copies():
    layout, groups = tr.replica_layout(6, [{"rank_list": [0, 2, 4, 6], "replica_cnt": 2,
                                            "replica_shift": 0}])
    assert layout == {"dense": {"dp_index": 3, "dp_size": 4, "replica_num": 2, "shard": 1,
                                "holders": [2, 6]}}
    assert groups == {"dense": [0, 2, 4, 6]}
    full, _ = tr.replica_layout(1, [{"rank_list": [1, 3], "replica_cnt": 2, "replica_shift": 0},
                                    {"rank_list": [1, 3], "replica_cnt": 1, "replica_shift": 0}])
    assert full["dense"]["holders"] == [1, 3] and full["moe"]["holders"] == [1]
    for bad in ([{"rank_list": [0, 2], "replica_cnt": 3, "replica_shift": 0}],
                [{"rank_list": [2, 4], "replica_cnt": 2, "replica_shift": 0}],
                [{"rank_list": [0, 2], "replica_cnt": 2, "replica_shift": 1}],
                [{"rank_list": [0, "2"], "replica_cnt": 2, "replica_shift": 0}], []):
        with pytest.raises(ValueError, match="set_optimizer_replica|replica_info"):
            tr.replica_layout(0, bad)


REPAIR = {"incident": 1, "strategy": "retry", "lock_step": 7, "source": "replica",
          "faulty": [1], "new_ranks": [], "involved": [1, 3]}


def _repair(**fields: object) -> RepairOrder:
    return RepairOrder.from_wire({**REPAIR, **fields})


def test_repair_calls_of_a_uce_receiver_and_its_source():
    [receive] = tr.repair_calls(_repair(**{"receive": [{"optimizer": "dense", "shard": 0,
                                                        "from": 3}], "send": []}), 1, 4, True,
                                ["dense"])
    assert (receive.step, receive.need_rebuild, receive.error_ranks) == (7, True, [1])
    assert receive.repair_info == {"type": [0], "repair_type": 1, "src": [3], "dst": [1],
                                   "rank_list": [1, 3]}
    [send] = tr.repair_calls(_repair(**{"receive": [], "send": [{"optimizer": "dense",
                                                                 "shard": 0, "to": 1}]}),
                             3, 4, False, ["dense"])
    assert (send.need_rebuild, send.error_ranks, send.repair_info["repair_type"],
            send.repair_info["src"]) == (False, [1], 0, [3])
    # a restarted worker (not a UCE) receives with RT_RECV_REPAIR; a bystander gets no call
    [arf] = tr.repair_calls(_repair(**{"receive": [{"optimizer": "dense", "shard": 0,
                                                    "from": 0}], "send": []}), 1, 4, False, [])
    assert (arf.repair_info["repair_type"], arf.need_rebuild) == (3, False)
    assert tr.repair_calls(_repair(receive=[], send=[]), 0, 4, False, ["dense"]) == []


def test_repair_calls_from_the_checkpoint():
    payload = _repair(source="checkpoint", receive=[], send=[])
    [plain] = tr.repair_calls(payload, 2, 4, False, ["dense", "moe"])
    assert plain.repair_info == {"type": [0, 1], "repair_type": 5, "src": [2, 2],
                                 "dst": [2, 2], "rank_list": [0, 1, 2, 3]}
    [damaged] = tr.repair_calls(payload, 1, 4, True, ["dense"])
    assert (damaged.repair_info["repair_type"], damaged.need_rebuild) == (6, True)


def test_save_info_names_the_writers_of_the_rank_s_group():
    payload = DumpOrder.from_wire({"incident": 1, "lock_step": 5, "strategy": "dump", "shards": [
        {"optimizer": "dense", "shard": 1, "holders": [2, 6]}], "writers": [0, 2, 5, 7]})
    assert tr.save_info(payload, 2, {"dense": [0, 2, 4, 6]}) == [{"type": 0, "ranks": [0, 2]}]
    alone = DumpOrder(1, 5, (DumpShard("rank", 3, (3,)),), ())
    assert tr.save_info(alone, 3, {}) == [{"type": 0, "ranks": [3]}]


def _shards(ranks: list[int], count: int, rank: int) -> _zit.Shards:
    """The shards rank `rank` registered with `tft_set_optimizer_replica`."""
    layout, groups = tr.replica_layout(rank, [{"rank_list": ranks, "replica_cnt": count,
                                               "replica_shift": 0}])
    return _zit.Shards(groups, layout)


@pytest.mark.parametrize(("lost", "world", "dp_size"), [
    (0, [1, 2, 3], 3), (1, [0, 2, 3], 3), (2, [0, 1, 3], 3), (3, [0, 1, 2], 3)])
def test_zit_downgrade_keeps_every_rank_that_stays(lost, world, dp_size):
    """DP4: whichever rank is lost, the other three stay, as the SDK's controller keeps
    every rank outside the lost DP indices (MindSpeed-LLM's handler takes every rank
    missing from new_dp_ranks for a lost one); TP2 x DP2 (DP groups [0, 2] and [1, 3]):
    losing rank 3 loses DP replica 1, and ranks 0 and 1 stay at DP 1."""
    staying = [r for r in range(4) if r != lost]
    assert _zit.downgrade(staying, _zit.DpLayout([0, 1, 2, 3])) == (world, dp_size)
    tp2 = _zit.DpLayout([1, 3])
    assert [tp2.dp_index(r) for r in range(4)] == [0, 0, 1, 1]
    assert _zit.downgrade([0, 1], tp2) == ([0, 1], 1)
    assert tp2.dp_group(2, [0, 1, 2, 3]) == [0, 2]
    with pytest.raises(ValueError, match="rank order"):
        _zit.DpLayout([0, 1, 3])


def test_zit_shards_after_a_shrink_are_the_launch_shards_held_by_who_stays():
    """MindSpeed-LLM's replica groups at DP4 ([0, 1] and [2, 3]): shard 0 is held by 0 and
    2, shard 1 by 1 and 3. Without rank 1, rank 3 holds shard 1 alone; without ranks 1 and
    3 no rank holds it, and the shrink is refused, naming the shard."""
    shards = _shards([0, 1, 2, 3], 2, 3)
    assert [shards.holders("dense", s) for s in (0, 1)] == [[0, 2], [1, 3]]
    layout, groups = shards.layout_in(3, [0, 2, 3])
    assert layout == {"dense": {"dp_index": 2, "dp_size": 3, "replica_num": 1, "shard": 1,
                                "holders": [3]}}
    assert groups == {"dense": [0, 2, 3]}
    layout, _ = _shards([0, 1, 2, 3], 2, 2).layout_in(2, [0, 2, 3])
    assert layout["dense"] == {"dp_index": 1, "dp_size": 3, "replica_num": 2, "shard": 0,
                               "holders": [0, 2]}
    assert shards.missing([0, 2]) == ["dense shard 1 (held by ranks [1, 3] at launch)"]
    with pytest.raises(_zit.MissingShard, match=r"new world \[0, 2\] holds dense shard 1"):
        _shards([0, 1, 2, 3], 2, 0).layout_in(0, [0, 2])


def test_zit_upgrade_repairs_pair_each_returning_rank_with_a_holder_of_its_shard():
    """Full replicas (every rank holds the whole state): the k-th returning rank from the
    (k mod n)-th rank that stayed. MindSpeed-LLM's replica groups: each returning rank from
    the rank that stayed holding its shard."""
    layout, world = _zit.DpLayout([0, 1, 2, 3]), [0, 1, 2, 3]
    full = _shards(world, 4, 0)
    [send] = _zit.upgrade_repairs(1, world, [2, 3], 8, layout, full)
    assert (send.step, send.need_rebuild, send.error_ranks) == (8, False, [3])
    assert send.repair_info == {"type": [0], "repair_type": ft.RepairType.RT_SEND.value,
                                "src": [1], "dst": [3], "rank_list": world}
    [receive] = _zit.upgrade_repairs(2, world, [2, 3], 8, layout, full)
    assert receive.repair_info["repair_type"] == ft.RepairType.RT_RECV_REPAIR.value
    assert (receive.repair_info["src"], receive.error_ranks) == ([0], [2])
    # one rank stayed: it sends to both
    [send] = _zit.upgrade_repairs(0, world, [1, 2, 3], 8, layout, full)
    assert send.repair_info["dst"] == [1, 2, 3] and send.repair_info["src"] == [0, 0, 0]
    with pytest.raises(_zit.MissingShard, match="no rank that kept"):
        _zit.upgrade_repairs(0, [2, 3], [2, 3], 8, layout, full)
    # replica groups [0, 1] and [2, 3]: ranks 0 and 3 stayed, 1 and 2 return
    halves = _shards(world, 2, 0)
    [send] = _zit.upgrade_repairs(3, world, [1, 2], 8, layout, halves)
    assert (send.repair_info["src"], send.repair_info["dst"]) == ([3], [1])
    [receive] = _zit.upgrade_repairs(2, world, [1, 2], 8, layout, halves)
    assert receive.repair_info["src"] == [0]
    with pytest.raises(_zit.MissingShard, match="holders: \\[1, 3\\]"):
        _zit.upgrade_repairs(0, world, [1, 3], 8, layout, halves)


def test_repair_type_names():
    assert [tr.repair_type_name(s) for s in ("retry", "load_checkpoint", "recover", "dump",
                                             None)] == ["retry", "retry", "recover", "dump",
                                                        "unknow"]


def test_calls_before_the_processor_starts_say_so():
    with pytest.raises(RuntimeError, match="tft_start_processor"):
        ft.tft_start_updating_os()
    with pytest.raises(SystemExit) as refused:  # the SDK's refusal: the process ends with 2
        ft.tft_init_processor(4, 4, False)
    assert refused.value.code == 2
    with pytest.raises(SystemExit):
        ft.tft_init_processor(0, 4, True)
    with pytest.raises(ValueError, match="allowed: MindSpeed, MindSpeed-LLM"):
        ft.set_mindio_export_version("Megatron")
    with pytest.raises(TypeError, match="callable"):
        ft.tft_register_stop_handler("stop")


def test_pause_train_blocks_while_paused_and_reboot_is_told_once(tmp_path):
    """The operator pauses the job after iteration 2: that iteration's `tft_pause_train`
    blocks until the resume 1 s later, the others do not; `tft_is_reboot_node` is False for
    a process that was not restarted (one process, world size 1)."""
    import json
    import subprocess
    import sys

    from tests.jobs import REPO, free_port

    out = subprocess.run([sys.executable, str(REPO / "tests" / "sdk_compat" / "pause_probe.py"),
                          str(free_port())], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "TTP_LOG_PATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    blocked = {int(k): v for k, v in result["blocked"].items()}
    assert blocked[2] >= 0.6, blocked
    assert all(v < 0.3 for k, v in blocked.items() if k != 2), blocked
    assert result["reboot"] == [False, False]


def test_no_controller_under_mindx_says_why(tmp_path):
    """With MINDX_TASK_ID set MindSpeed-LLM starts no controller; without mindspeed-tft's
    launcher nobody hosts one: the registration fails within TTP_REGISTER_TIMEOUT, saying
    so, instead of waiting silently."""
    import subprocess
    import sys

    from tests.jobs import free_port

    program = ("import mindio_ttp.framework_ttp as ft\n"
               "ft.tft_init_processor(0, 2, False, False, '', True, False)\n"
               f"ft.tft_start_processor('127.0.0.1', {free_port()})\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "MINDX_TASK_ID": "7",
                                          "TTP_REGISTER_TIMEOUT": "1",
                                          "TTP_LOG_PATH": str(tmp_path)})
    assert out.returncode == 1
    assert "MINDX_TASK_ID is set" in out.stderr and "tft-run" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("args,error,words", [
    ((-2, 4, False), ValueError, "init controller failed, error num:1"),
    ((4, 4, False), ValueError, "init controller failed, error num:1"),
    ((0, 0, False), ValueError, "init controller failed, error num:1"),
    ((0, 100001, False), ValueError, "init controller failed, error num:1"),
    ((0, 4, True), ValueError, "init controller failed, error num:1"),
    (("0", 4, False), TypeError, "in method 'init_controller', argument 1 of type 'int'"),
    ((0, 4.0, False), TypeError, "in method 'init_controller', argument 2 of type 'int'"),
])
def test_init_controller_refuses_in_the_sdks_words(args, error, words):
    """The SDK's refusals and their words (tests/test_sdk_compat.py runs both SDKs on the
    same arguments); rank -1 (a controller outside every rank) is accepted."""
    from mindio_ttp._runtime import Runtime

    with pytest.raises(error) as refused:
        Runtime().init_controller(*args, False, False)
    assert str(refused.value).startswith(words), refused.value
    for accepted in ((-1, 4, False), (-1, 1, False), (0, 100000, False), (True, 4, False)):
        Runtime().init_controller(*accepted, False, False)


def test_get_device_on_cpu_is_the_sdks_index():
    """On CPU the SDK answers device index 0 (its MindSpore path's `device_id`, the PyTorch
    path's `torch.npu.current_device()` where no device was chosen)."""
    from mindio_ttp._runtime import Runtime, _current_device

    assert Runtime().device == 0 and _current_device() == 0


def test_token_file_is_private_and_refused_otherwise(tmp_path, monkeypatch):
    """The job token a controller publishes is in a 0700 folder of this user, mode 0600;
    a processor of the same user reads it, a file others could read is refused, a missing
    one is None."""
    import os
    import stat
    import tempfile

    from mindio_ttp import _token

    from mindspeed_tft.control import ControlConfigError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TTP_JOB_TOKEN", raising=False)
    token, path = _token.publish("127.0.0.1", 45123)
    assert os.environ["TTP_JOB_TOKEN"] == token and len(token) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert _token.read("127.0.0.1", 45123) == token
    assert _token.read("127.0.0.1", 45124) is None
    path.chmod(0o644)
    with pytest.raises(ControlConfigError, match="only this user can read"):
        _token.read("127.0.0.1", 45123)
    _token.withdraw(path)
    assert _token.read("127.0.0.1", 45123) is None
    path.parent.chmod(0o755)
    with pytest.raises(ControlConfigError, match="folder"):
        _token.publish("127.0.0.1", 45123)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as user nobody")
def test_another_user_cannot_read_the_token(monkeypatch):
    """User nobody, on the same host, cannot open the token file of a controller (in a
    temporary folder that nobody may enter): the only way to the token is being this user
    (or its processes' environment)."""
    import shutil
    import subprocess
    import tempfile

    from mindio_ttp import _token

    base = tempfile.mkdtemp(prefix="tft-token-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        monkeypatch.setattr(tempfile, "tempdir", base)
        monkeypatch.delenv("TTP_JOB_TOKEN", raising=False)  # restored unset afterwards
        _, path = _token.publish("127.0.0.1", 45125)
        for target in (path, path.parent):
            probe = subprocess.run(["cat" if target == path else "ls", str(target)],
                                   user="nobody", capture_output=True, text=True, timeout=30)
            assert probe.returncode != 0 and "Permission denied" in probe.stderr, probe.stderr
        path.parent.chmod(0o711)  # even a folder others may pass through: the file is 0600
        probe = subprocess.run(["cat", str(path)], user="nobody", capture_output=True,
                               text=True, timeout=30)
        assert probe.returncode != 0 and "Permission denied" in probe.stderr, probe.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_group_names_carry_the_repair_id(monkeypatch):
    """torch 2.13 restarts its group counter when every group is destroyed: a group rebuilt
    on the same store gets an old group's name (and so its store keys, `<name>/...`). With
    the `group-names` moment that `tft_init_processor` installs, as Huawei's SDK does, the
    names of a repair's groups carry its id and never meet an earlier repair's."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from mindspeed_tft.recovery import group_names

    def generation() -> list[str]:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            groups = [dist.group.WORLD, dist.new_group([0]), dist.new_group([0]),
                      dist.new_group([0], use_local_synchronization=True)]
            return [c10d._world.pg_names[g] for g in groups]
        finally:
            dist.destroy_process_group()

    plain = [generation(), generation()]
    assert plain[0] == plain[1] and plain[0][:3] == ["0", "1", "2"]  # the hazard
    monkeypatch.setattr(group_names, "_repair_id", 0)
    monkeypatch.setattr(c10d, "_process_group_name", group_names.process_group_name)
    first = generation()
    group_names.set_repair_id(1)
    second = generation()
    assert first[:3] == ["0__", "0_0", "1_0"] and second[:3] == ["1__", "0_1", "1_1"]
    assert first[3].endswith("_0") and second[3].endswith("_1")
    assert not set(first) & set(second)
    with pytest.raises(ValueError, match="repair id"):
        group_names.set_repair_id(-1)


def test_a_token_file_is_withdrawn_only_while_it_is_ours(tmp_path, monkeypatch):
    """A controller replaces the token file an earlier one left (and the scratch file an
    earlier process of its pid left), and when it ends deletes its own, but not a later
    controller's on the same address and port."""
    import tempfile

    from mindio_ttp import _token

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TTP_JOB_TOKEN", raising=False)
    stale = _token.token_path("127.0.0.1", 45126)
    for left in (stale, stale.with_name(f".{stale.name}.{os.getpid()}")):
        left.write_text("0" * 64)
        left.chmod(0o600)
    first, path = _token.publish("127.0.0.1", 45126)
    assert path == stale and _token.read("127.0.0.1", 45126) == first != "0" * 64
    second, again = _token.publish("127.0.0.1", 45126)
    assert again == path and first != second
    _token.withdraw(path, first)
    assert _token.read("127.0.0.1", 45126) == second
    _token.withdraw(path, second)
    assert _token.read("127.0.0.1", 45126) is None


#: a controller of its own process on `sys.argv[1]` (a port), made as `tft_init_controller(-1,
#: ...)` and `tft_start_controller` make it; then it ends as `sys.argv[2]` says: "exit" as a
#: rank after a dump (exit 75, which skips atexit), or waits (60 s at most) for a signal
TOKEN_HOLDER = """
import sys, time
from mindio_ttp._runtime import RUNTIME
from mindspeed_tft.process_exit import exit_without_teardown
RUNTIME.init_controller(-1, 2, False, False, False)
RUNTIME.start_controller("127.0.0.1", int(sys.argv[1]))
print("started", flush=True)
if sys.argv[2] == "exit":
    exit_without_teardown(75)
time.sleep(60)
"""


@pytest.mark.parametrize("end", ["exit", "SIGTERM", "SIGHUP"])
def test_a_controller_removes_its_token_file_however_it_ends(tmp_path, end):
    """A controller that made the job's token deletes its file when its process ends through
    a dump's exit (75, no atexit) or of SIGTERM or SIGHUP (and still dies of the signal), so
    the next job on its port never finds it."""
    import signal
    import stat
    import subprocess
    import sys

    from tests.jobs import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTP_", "TFT_"))}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", TOKEN_HOLDER, str(port), end], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "started\n"
        path = tmp_path / f"mindio_ttp-{os.getuid()}" / f"controller-127.0.0.1-{port}.token"
        if end != "exit":
            assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 64
            proc.send_signal(getattr(signal, end))
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
        output = proc.communicate()[0]
    assert code == (75 if end == "exit" else -getattr(signal, end)), output
    assert not path.exists() and os.listdir(path.parent) == [], output
