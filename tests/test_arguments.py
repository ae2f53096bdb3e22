"""Tests of mindspeed_tft.arguments: the flags, HIGH_AVAILABILITY and the SPEC 10 refusals."""

from __future__ import annotations

import argparse
import logging
import tempfile

import pytest

from mindspeed_tft.arguments import (
    ARGUMENT_GROUP_TITLE,
    Features,
    TFTArgumentError,
    add_tft_args,
    parse_high_availability_env,
    validate_tft_args,
)
from mindspeed_tft.features import ParallelSizes
from tests.jobs import free_port

# A Megatron-like layout: 8 ranks = tensor 2 x pipeline 1 x context 1 x data 4, bf16,
# distributed optimizer.
LAYOUT = dict(
    world_size=8,
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    data_parallel_size=4,
    use_distributed_optimizer=True,
    bf16=True,
    fp16=False,
    save=tempfile.gettempdir(),  # where the dump goes (high availability needs it)
)
#: the parallel sizes of LAYOUT, as the features record them
SIZES = ParallelSizes(world_size=8, tensor=2, expert_tensor=2)
#: the environment `tft-run` gives its workers: a launcher that restarts failed workers
LAUNCHED = {"TFT_CONTROLLER_IN_LAUNCHER": "1"}


def make_args(argv: list[str], **layout: object) -> argparse.Namespace:
    parser = add_tft_args(argparse.ArgumentParser())
    args = parser.parse_args(argv)
    for name, value in {**LAYOUT, **layout}.items():
        setattr(args, name, value)
    return args


def on_layout(*switches: object, parallel: ParallelSizes = SIZES, **features: object) -> Features:
    """The features `validate_tft_args` records for LAYOUT (its sizes, the distributed
    optimizer) with these switches."""
    return Features(*switches, parallel=parallel, distributed_optimizer=True, **features)


def validate(argv: list[str], env: dict[str, str] | None = None, **layout: object):
    return validate_tft_args(make_args(argv, **layout), environ={**LAUNCHED, **(env or {})})


def error_of(argv: list[str], env: dict[str, str] | None = None, **layout: object) -> str:
    with pytest.raises(TFTArgumentError) as info:
        validate(argv, env, **layout)
    return str(info.value)


HA = ["--enable-high-availability"]


# --- the parser ------------------------------------------------------------------------------


def test_add_tft_args_returns_parser_with_group_and_defaults(monkeypatch):
    monkeypatch.delenv("TFT_EVENTS_FILE", raising=False)
    parser = argparse.ArgumentParser()
    assert add_tft_args(parser) is parser
    titles = [group.title for group in parser._action_groups]
    assert ARGUMENT_GROUP_TITLE in titles
    args = parser.parse_args([])
    assert vars(args) == {
        "enable_high_availability": False,
        "enable_hbmfault_repair": False,
        "enable_worker_reboot": False,
        "enable_elastic_training": False,
        "distributed_optimizer_no_replica": False,
        "optimizer_replica_num": 2,
        "tft_events_file": None,
        "tft_check_replicas_interval": 0,
        "tft_metrics_port": None,
    }


def test_all_flags_parse():
    args = add_tft_args(argparse.ArgumentParser()).parse_args(
        [
            "--enable-high-availability", "--enable-hbmfault-repair", "--enable-worker-reboot",
            "--distributed-optimizer-no-replica", "--optimizer-replica-num", "4",
            "--tft-events-file", "/tmp/ev.jsonl",
        ]
    )
    assert (args.enable_high_availability, args.enable_hbmfault_repair) == (True, True)
    assert (args.enable_worker_reboot, args.distributed_optimizer_no_replica) == (True, True)
    assert (args.optimizer_replica_num, args.tft_events_file) == (4, "/tmp/ev.jsonl")


def test_events_file_default_from_env(monkeypatch):
    monkeypatch.setenv("TFT_EVENTS_FILE", "/data/events.jsonl")
    args = add_tft_args(argparse.ArgumentParser()).parse_args([])
    assert args.tft_events_file == "/data/events.jsonl"


def test_help_says_sub_flags_need_high_availability():
    parser = argparse.ArgumentParser(
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=10_000)
    )
    flat = add_tft_args(parser).format_help()
    assert ARGUMENT_GROUP_TITLE in flat
    for flag in ("--enable-hbmfault-repair", "--enable-worker-reboot"):
        assert flag in flat
    assert flat.count("Takes effect only with --enable-high-availability") == 4
    assert "HIGH_AVAILABILITY=dump|retry|recover" in flat


# --- effective replica number and features ---------------------------------------------------


def test_high_availability_off_records_plain_features():
    args = validate([])
    assert args.tft_features.replica_num == 1
    assert args.tft_features == on_layout()
    assert args.tft_features.describe() == "mindspeed-tft: high availability off"


def test_high_availability_off_non_distributed_counts_every_copy():
    args = validate([], use_distributed_optimizer=False, bf16=False)
    assert args.tft_features.replica_num == 4


def test_default_two_replicas():
    args = validate(HA)
    assert args.tft_features.replica_num == 2
    assert args.tft_features == on_layout(True, False, False, False, 2, "command line")
    assert args.tft_features.describe() == (
        "mindspeed-tft: high availability on (dying-gasp checkpoint), hbmfault repair off, "
        "worker reboot off, optimizer replicas 2; set by command line"
    )


def test_no_replica_means_one():
    args = validate(HA + ["--distributed-optimizer-no-replica", "--enable-worker-reboot"])
    assert args.tft_features.replica_num == 1
    assert args.tft_features == on_layout(True, False, True, True, 1, "command line")
    assert args.tft_features.describe() == (
        "mindspeed-tft: high availability on (dying-gasp checkpoint), hbmfault repair off, "
        "worker reboot on, optimizer replicas 1 (no-replica: repair from the last checkpoint); "
        "set by command line"
    )


def test_no_replica_with_explicit_one_is_accepted():
    args = validate(HA + ["--distributed-optimizer-no-replica", "--optimizer-replica-num", "1"])
    assert args.tft_features.replica_num == 1


def test_replica_num_divisor_of_dp_cp():
    args = validate(HA + ["--optimizer-replica-num", "4"], data_parallel_size=4,
                    context_parallel_size=2, world_size=16)
    assert args.tft_features.replica_num == 4


def test_non_distributed_half_optimizer_every_rank_is_a_replica():
    args = validate(HA, use_distributed_optimizer=False, fp16=True, bf16=False)
    assert args.tft_features.replica_num == 4
    assert args.tft_features.replica_num == 4


def test_replica_num_ignored_by_non_distributed_optimizer():
    args = validate(HA + ["--optimizer-replica-num", "3"], use_distributed_optimizer=False)
    assert args.tft_features.replica_num == 4


def test_from_args_without_validation_reads_attributes():
    args = make_args(HA + ["--enable-hbmfault-repair", "--optimizer-replica-num", "4"])
    assert Features.from_args(args) == on_layout(True, True, False, False, 4, "command line")
    assert Features.from_args(argparse.Namespace()) == Features()


def test_namespace_without_tft_flags_is_accepted():
    args = argparse.Namespace(**LAYOUT)
    validate_tft_args(args, environ={})
    assert args.tft_features == on_layout()
    assert args.optimizer_replica_num == 2


# --- HIGH_AVAILABILITY ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, hbm, reboot",
    [
        ("dump", False, False),
        ("retry", True, False),
        ("recover", False, True),
        ("retry,recover", True, True),
        (" Dump , RETRY ", True, False),
        ("dump,retry,recover,dump", True, True),
    ],
)
def test_high_availability_env_switches_features_on(value, hbm, reboot):
    args = validate([], env={"HIGH_AVAILABILITY": value})
    features = args.tft_features
    assert (features.high_availability, features.hbm_repair, features.worker_reboot) == (
        True, hbm, reboot,
    )
    assert features.source == f"HIGH_AVAILABILITY={value.strip()}"
    assert args.enable_high_availability is True


def test_high_availability_env_wins_over_command_line(caplog):
    with caplog.at_level(logging.WARNING, logger="mindspeed_tft.arguments"):
        args = validate(HA + ["--enable-worker-reboot"], env={"HIGH_AVAILABILITY": "retry"})
    assert (args.enable_hbmfault_repair, args.enable_worker_reboot) == (True, False)
    assert caplog.messages == [
        "HIGH_AVAILABILITY='retry' wins over the command line: --enable-worker-reboot is "
        "switched off"
    ]


def test_high_availability_env_enables_sub_flags_given_without_master_switch():
    args = validate(["--distributed-optimizer-no-replica"], env={"HIGH_AVAILABILITY": "dump"})
    assert args.tft_features == on_layout(True, False, False, True, 1, "HIGH_AVAILABILITY=dump")


@pytest.mark.parametrize("value", ["", "   "])
def test_blank_high_availability_env_is_unset(value):
    assert parse_high_availability_env(value) == ()
    assert validate([], env={"HIGH_AVAILABILITY": value}).tft_features == on_layout()


@pytest.mark.parametrize(
    "value, bad",
    [("ttp", "ttp"), ("dump,foo", "foo"), ("dump,,retry", ""), ("dump;retry", "dump;retry")],
)
def test_bad_high_availability_env(value, bad):
    assert error_of([], env={"HIGH_AVAILABILITY": value}) == (
        f"HIGH_AVAILABILITY={value!r}: unknown mode {bad!r}; allowed: dump, retry, recover, "
        "elastic-training (comma-separated, case-insensitive)"
    )


def test_high_availability_env_checks_layout_too():
    assert error_of([], env={"HIGH_AVAILABILITY": "dump"}, data_parallel_size=1,
                    world_size=2) == (
        "--enable-high-availability needs a data-parallel size >= 2, got 1 (world size 2 = "
        "tensor 2 x pipeline 1 x context 1 x data 1); allowed: a parallel layout with "
        "data-parallel size >= 2"
    )


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], HA])
def test_replica_num_below_one(argv):
    assert error_of(argv + ["--optimizer-replica-num", "0"]) == (
        "--optimizer-replica-num 0 is invalid; allowed: an integer >= 1"
    )


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--enable-hbmfault-repair"], "--enable-hbmfault-repair takes"),
        (["--enable-worker-reboot"], "--enable-worker-reboot takes"),
        (["--distributed-optimizer-no-replica"], "--distributed-optimizer-no-replica takes"),
        (["--optimizer-replica-num", "4"], "--optimizer-replica-num 4 takes"),
    ],
)
def test_sub_flag_without_high_availability(argv, named):
    assert error_of(argv) == (
        f"{named} effect only with --enable-high-availability; allowed: add "
        "--enable-high-availability (or set HIGH_AVAILABILITY=dump|retry|recover|elastic-training) or remove it"
    )


def test_several_sub_flags_without_high_availability():
    assert error_of(["--enable-worker-reboot", "--enable-hbmfault-repair"]) == (
        "--enable-hbmfault-repair, --enable-worker-reboot take effect only with "
        "--enable-high-availability; allowed: add --enable-high-availability (or set "
        "HIGH_AVAILABILITY=dump|retry|recover|elastic-training) or remove them"
    )


def test_fp32_non_distributed_optimizer_refused():
    assert error_of(HA, use_distributed_optimizer=False, bf16=False) == (
        "--enable-high-availability needs the distributed optimizer or the fp16/bf16 "
        "optimizer, got the fp32 non-distributed optimizer; allowed: add "
        "--use-distributed-optimizer, --bf16 or --fp16"
    )


def test_fp32_distributed_optimizer_accepted():
    args = validate(HA, bf16=False)
    assert args.tft_features.replica_num == 2


def test_no_replica_needs_distributed_optimizer():
    assert error_of(HA + ["--distributed-optimizer-no-replica"],
                    use_distributed_optimizer=False) == (
        "--distributed-optimizer-no-replica needs --use-distributed-optimizer (the "
        "fp16/bf16 optimizer keeps a full copy on every data-parallel rank); allowed: add "
        "--use-distributed-optimizer or remove --distributed-optimizer-no-replica"
    )


def test_no_replica_contradicts_replica_num():
    assert error_of(HA + ["--distributed-optimizer-no-replica", "--optimizer-replica-num", "4"]) == (
        "--optimizer-replica-num 4 contradicts --distributed-optimizer-no-replica (1 replica); "
        "allowed: one of the two"
    )


def test_swap_optimizer_refused():
    assert error_of(HA, swap_optimizer=True) == (
        "--enable-high-availability cannot be combined with --swap-optimizer (it moves "
        "optimizer state off the device); allowed: remove one of the two"
    )


def test_disabled_gloo_process_groups_refused():
    assert error_of(HA, enable_gloo_process_groups=False) == (
        "--enable-high-availability cannot be combined with --disable-gloo-process-groups "
        "(recovery needs the gloo process groups); allowed: remove one of the two"
    )


def test_mindspeed_disable_gloo_group_refused():
    assert error_of(HA, disable_gloo_group=True) == (
        "--enable-high-availability cannot be combined with --disable-gloo-group "
        "(recovery needs the gloo process groups); allowed: remove one of the two"
    )


def test_refusals_do_not_apply_without_high_availability():
    args = validate([], swap_optimizer=True, enable_gloo_process_groups=False,
                    use_distributed_optimizer=False, bf16=False, data_parallel_size=1)
    assert args.tft_features == Features(replica_num=1, parallel=SIZES)


def test_data_parallel_size_one_refused():
    assert error_of(HA, data_parallel_size=1, tensor_model_parallel_size=4,
                    pipeline_model_parallel_size=2, world_size=8) == (
        "--enable-high-availability needs a data-parallel size >= 2, got 1 (world size 8 = "
        "tensor 4 x pipeline 2 x context 1 x data 1); allowed: a parallel layout with "
        "data-parallel size >= 2"
    )


def test_context_parallel_counts_toward_d():
    args = validate(HA + ["--distributed-optimizer-no-replica"], data_parallel_size=1,
                    context_parallel_size=2, world_size=4)
    assert args.tft_features.replica_num == 1


def test_replica_num_does_not_divide_d():
    assert error_of(HA + ["--optimizer-replica-num", "3"]) == (
        "--optimizer-replica-num 3 does not divide the data-parallel size 4; allowed: a "
        "divisor N of 4 with 1 <= N <= 4 (1, 2, 4)"
    )


@pytest.mark.parametrize("replica_num", [1, 2, 4])
def test_every_divisor_of_d_is_accepted(replica_num):
    args = validate(HA + ["--optimizer-replica-num", str(replica_num)])
    assert args.tft_features.replica_num == replica_num
    assert args.num_distributed_optimizer_instances == replica_num
    assert args.tft_features.replica_num == replica_num


def test_replica_num_equal_to_d_every_rank_holds_the_whole_state():
    # N = d: d optimizer instances of one rank each (the non-distributed optimizer's memory)
    args = validate(HA + ["--optimizer-replica-num", "4"])
    assert args.tft_features.replica_num == 4
    assert args.num_distributed_optimizer_instances == 4
    assert args.tft_features == on_layout(True, False, False, False, 4, "command line")


def test_default_replica_num_equals_d_two():
    # TP2 x PP2 x DP2: the defaults (N = 2 = d) are accepted
    args = validate(HA + ["--enable-worker-reboot"], world_size=8, tensor_model_parallel_size=2,
                    pipeline_model_parallel_size=2, data_parallel_size=2)
    assert args.tft_features.replica_num == 2
    assert args.num_distributed_optimizer_instances == 2
    assert args.tft_features == on_layout(True, False, True, False, 2, "command line",
                                          parallel=ParallelSizes(8, 2, 2, expert_tensor=2))


def test_replica_num_larger_than_d():
    assert error_of(HA + ["--optimizer-replica-num", "8"]) == (
        "--optimizer-replica-num 8 does not divide the data-parallel size 4; allowed: a "
        "divisor N of 4 with 1 <= N <= 4 (1, 2, 4)"
    )


def test_replica_num_larger_than_d_two():
    assert error_of(HA + ["--optimizer-replica-num", "4"], world_size=4,
                    data_parallel_size=2) == (
        "--optimizer-replica-num 4 does not divide the data-parallel size 2; allowed: a "
        "divisor N of 2 with 1 <= N <= 2 (1, 2)"
    )


def test_replica_num_larger_than_d_and_not_a_multiple():
    assert error_of(HA + ["--optimizer-replica-num", "6"]) == (
        "--optimizer-replica-num 6 does not divide the data-parallel size 4; allowed: a "
        "divisor N of 4 with 1 <= N <= 4 (1, 2, 4)"
    )


def test_default_replica_num_with_d_two_context_parallel():
    # d = data 1 x context 2 = 2: N = 2 = d
    args = validate(HA, data_parallel_size=1, context_parallel_size=2, world_size=4)
    assert args.tft_features.replica_num == 2
    assert args.num_distributed_optimizer_instances == 2


def test_replica_num_checked_against_d_times_cp():
    assert error_of(HA + ["--optimizer-replica-num", "3"], data_parallel_size=2,
                    context_parallel_size=4, world_size=16) == (
        "--optimizer-replica-num 3 does not divide the data-parallel x context-parallel size "
        "8; allowed: a divisor N of 8 with 1 <= N <= 8 (1, 2, 4, 8)"
    )


def test_replica_num_equal_to_d_times_cp():
    args = validate(HA + ["--optimizer-replica-num", "8"], data_parallel_size=2,
                    context_parallel_size=4, world_size=16)
    assert args.tft_features.replica_num == 8
    assert args.num_distributed_optimizer_instances == 8


# --- MoE: expert data parallelism ------------------------------------------------------------


def test_moe_expert_data_parallel_size_one_refused():
    # world 8, pipeline 1, expert 8, expert-tensor = tensor 1 -> expert-DP 1.
    assert error_of(HA, tensor_model_parallel_size=1, data_parallel_size=8,
                    expert_model_parallel_size=8, num_experts=8) == (
        "--enable-high-availability needs an expert-data-parallel size >= 2 for MoE, got 1 "
        "(world size 8 / (pipeline 1 x expert 8 x expert-tensor 1)); allowed: a parallel "
        "layout with expert-data-parallel size >= 2"
    )


def test_moe_replica_num_checked_against_expert_data_parallel():
    # world 8, tensor 2, data 4, expert 2, expert-tensor 2 -> expert-DP 2: N=4 divides d = 4
    # but not 2.
    assert error_of(HA + ["--optimizer-replica-num", "4"], expert_model_parallel_size=2,
                    expert_tensor_parallel_size=2, num_experts=4) == (
        "--optimizer-replica-num 4 does not divide the expert-data-parallel size 2; "
        "allowed: a divisor N of 2 with 1 <= N <= 2 (1, 2)"
    )


def test_moe_replica_num_equal_to_expert_data_parallel_meets_the_expert_parallel_refusal():
    # expert-DP 2: N = 2 passes the layout check and is refused for expert parallelism only.
    assert error_of(HA, expert_model_parallel_size=2, expert_tensor_parallel_size=2,
                    num_experts=4).startswith(
        "--optimizer-replica-num 2 cannot be combined with --expert-model-parallel-size 2: "
    )


def test_moe_expert_parallel_replicas_refused():
    # world 8, tensor 2, data 4, expert 2, expert-tensor 1 -> expert-DP 4: the layout is
    # fine, but megatron-core's partial distributed optimizer refuses expert parallelism.
    assert error_of(HA, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                    num_experts=4) == (
        "--optimizer-replica-num 2 cannot be combined with --expert-model-parallel-size 2: "
        "megatron-core 0.12.1's partial distributed optimizer (the replica engine) does not "
        "support expert parallelism; allowed: --distributed-optimizer-no-replica, or no "
        "expert parallelism"
    )


def test_moe_no_replica_needs_only_expert_dp_two():
    args = validate(HA + ["--distributed-optimizer-no-replica"], expert_model_parallel_size=2,
                    expert_tensor_parallel_size=2, num_experts=4)
    assert args.tft_features.replica_num == 1


# --- elastic training ------------------------------------------------------------------------


def test_elastic_training_env_is_worker_reboot_that_shrinks():
    args = validate([], env={"HIGH_AVAILABILITY": "elastic-training"})
    assert args.tft_features == on_layout(True, False, True, False, 2,
                                          "HIGH_AVAILABILITY=elastic-training", elastic=True)
    assert "worker reboot on, elastic training on," in args.tft_features.describe()


def test_elastic_training_flag_needs_worker_reboot_and_the_distributed_optimizer():
    assert validate(HA + ["--enable-worker-reboot", "--enable-elastic-training"]).tft_features.elastic
    assert error_of(HA + ["--enable-elastic-training"], use_distributed_optimizer=False) == (
        "--enable-elastic-training needs --enable-worker-reboot and --use-distributed-optimizer "
        "(a shrink is a worker reboot without a replacement, and re-shards the distributed "
        "optimizer); allowed: add --enable-worker-reboot and --use-distributed-optimizer or "
        "remove --enable-elastic-training")
    assert error_of(["--enable-elastic-training"]).startswith(
        "--enable-elastic-training takes effect only with --enable-high-availability")


def test_a_scale_change_replaces_the_features_and_megatrons_args_come_from_them():
    """DP4 (TP2, 8 ranks) with N = 4 shrinks to DP3 (N' = 3, the largest divisor <= 4) and
    grows back: the launch N comes back, and Megatron's sizes and instance count follow."""
    from mindspeed_tft.arguments import apply_scale
    from mindspeed_tft.elastic import replica_num_for

    args = validate(HA + ["--enable-worker-reboot", "--optimizer-replica-num", "4"])
    launched = args.tft_features
    shrunk = launched.scaled(6, replica_num_for(3, launched.launch_replica_num))
    apply_scale(args, shrunk, rank=5)
    assert args.tft_features is shrunk
    assert (args.rank, args.world_size, args.data_parallel_size) == (5, 6, 3)
    assert (shrunk.replica_num, shrunk.launch_replica_num) == (3, 4)
    assert args.num_distributed_optimizer_instances == 3
    assert shrunk.parallel == ParallelSizes(world_size=6, tensor=2, expert_tensor=2)
    grown = shrunk.scaled(8, replica_num_for(4, shrunk.launch_replica_num))
    apply_scale(args, grown, rank=7)
    assert grown == launched and args.num_distributed_optimizer_instances == 4
    assert (args.world_size, args.data_parallel_size) == (8, 4)


def test_features_cross_the_network_whole_and_checked():
    """What a backup controller receives (`to_dict`, msgpack-able plain data) and reads back."""
    features = on_layout(True, True, False, False, 2, "command line").scaled(6, 1)
    assert Features.from_dict(features.to_dict()) == features
    with pytest.raises(ValueError, match="parallel size world_size=0 is not a positive int"):
        Features.from_dict({"parallel": {"world_size": 0}})
    with pytest.raises(ValueError, match="feature parallel=8 is not a map of sizes"):
        Features.from_dict({"parallel": 8})


# --- set-ups whose first fault could only fail -----------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (HA, "--enable-high-availability needs --save DIR: the dying-gasp checkpoint is written "
         "there, and without it the first fault ends the job with nothing saved; allowed: add "
         "--save DIR"),
    (HA + ["--enable-worker-reboot", "--enable-elastic-training"],
     "--enable-elastic-training needs --save DIR: a shrink continues from the dying-gasp "
     "checkpoint written there, and without it the first lost worker ends the job with "
     "nothing saved; allowed: add --save DIR"),
])
def test_high_availability_without_save_is_refused(argv, message):
    assert error_of(argv, save=None) == message


def test_an_unwritable_save_folder_is_refused(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert error_of(HA, save=str(a_file)) == (
        f"--save {a_file}: it is a file, not a folder, so the dying-gasp checkpoint could not "
        "be written there; allowed: a folder this process can create and write")
    assert error_of(HA, save=str(a_file / "ckpt")).startswith(
        f"--save {a_file / 'ckpt'}: {a_file} is a file, not a folder")
    validate(HA, save=str(tmp_path / "new" / "ckpt"))  # created at the first save
    assert not (tmp_path / "new").exists()


def test_worker_reboot_without_a_restarting_launcher_is_refused():
    message = ("--enable-worker-reboot needs a launcher that restarts failed workers, and this "
               "one never does (a killed worker would leave the others waiting for it until "
               "the launcher kills them, with nothing saved); allowed: launch with tft-run "
               "(torchrun's arguments) or a torchrun patched by scripts/patch_torchrun.sh, or "
               "remove worker reboot")
    args = make_args(HA + ["--enable-worker-reboot"])
    with pytest.raises(TFTArgumentError) as info:
        validate_tft_args(args, environ={})  # plain torchrun: no TFT_CONTROLLER_IN_LAUNCHER
    assert str(info.value) == message
    args = make_args([])
    with pytest.raises(TFTArgumentError) as info:
        validate_tft_args(args, environ={"HIGH_AVAILABILITY": "recover"})
    assert str(info.value).startswith("worker reboot (HIGH_AVAILABILITY=recover) needs a "
                                      "launcher that restarts failed workers")
    # in-place repairs need no restart (the port: rank 0 would host the controller)
    validate_tft_args(make_args(HA + ["--enable-hbmfault-repair"]),
                      environ={"TTP_PORT": str(free_port())})
