"""Command-line switches of mindspeed-tft and their validation (SPEC 1, 2 and 10).

A user turns the plugin on with four flags in the pretrain script (SPEC 1)::

    --enable-high-availability          master switch; TTP (dying-gasp checkpoint)
    --enable-hbmfault-repair            UCE: repair on-chip memory faults online
    --enable-worker-reboot              ARF: restart only the failed worker(s)
    --enable-elastic-training           shrink by a DP replica when no replacement comes
    --distributed-optimizer-no-replica  N = 1: repair from the last periodic checkpoint

plus ``--optimizer-replica-num`` (N, default 2), ``--tft-events-file`` and
``--tft-metrics-port``.

`add_tft_args` is a Megatron-LM ``extra_args_provider``: it adds the argument group
"mindspeed-tft high availability" and returns the parser. `validate_tft_args` runs after
Megatron's own validation (it needs ``data_parallel_size`` and friends) and:

1. refuses ``--optimizer-replica-num`` below 1;
2. applies the environment variable ``HIGH_AVAILABILITY`` (see `parse_high_availability_env`),
   which wins over the command line: when it is set, it alone decides the three switches
   ``--enable-high-availability``, ``--enable-hbmfault-repair`` and ``--enable-worker-reboot``
   (a command-line switch it leaves off is turned off, with a warning);
3. refuses the sub-feature flags (``--enable-hbmfault-repair``, ``--enable-worker-reboot``,
   ``--distributed-optimizer-no-replica``, a non-default ``--optimizer-replica-num``) without
   high availability: they would have no effect;
4. with high availability on, enforces SPEC 10 (optimizer kind, data-parallel sizes, the
   replica number, no ``--swap-optimizer``, gloo process groups kept) and refuses the
   set-ups whose first fault could only fail (`check_first_fault_can_succeed`): no
   ``--save`` folder (or one this process cannot write) for the dump, which elastic training
   goes through too; worker reboot under a launcher that never restarts a worker (anything
   but ``tft-run`` or a torchrun with the hook: `launched_by_tft`);
5. records the result on ``args`` (`apply_features`, the one writer of what Megatron reads
   from ``args`` that the features decide):

   - ``args.tft_features``: a frozen `Features`, the one summary the rest of the plugin
     reads (``describe()`` gives the startup log line), with the parallel sizes and
     ``replica_num``: how many copies of each optimizer-state shard exist across the
     data-parallel (x context-parallel) group. With high availability on: 1 with
     ``--distributed-optimizer-no-replica``, ``--optimizer-replica-num`` N with the
     distributed optimizer (a divisor of d, 1 <= N <= d; N = d: every rank holds the whole
     optimizer state, as with the non-distributed optimizer), d (every rank holds a full
     copy) with the non-distributed fp16/bf16 optimizer. With it off no replica groups are
     built: 1 with the distributed optimizer, d without it.
   - ``args.num_distributed_optimizer_instances``: megatron-core's replica engine (SPEC 2),
     N with high availability and the distributed optimizer, else 1.

6. writes ``--tft-metrics-port P`` to ``TFT_METRICS_PORT`` in the environment
   (`export_metrics_port`; the flag wins over the variable): the control plane reads its
   settings from the environment only (`ControlConfig.from_env`), and `tft-run` does the
   same with the training command's flag before it starts its controller;
7. reads the environment the plugin will use (`check_environment`): a bad ``TFT_INJECT`` or
   ``TTP_*`` / ``TFT_METRICS_*`` value stops the start here, before the model is built.

Every refusal is a `TFTArgumentError` (a ValueError) whose message names the flag or value and
says what is allowed.

Here d is the size of the group the optimizer is sharded over: ``data_parallel_size`` times
``context_parallel_size`` (Megatron-LM's ``data_parallel_size`` excludes context parallelism).
For MoE models the expert-data-parallel size ``world_size / (pipeline x expert x
expert-tensor)`` is checked the same way (encoder pipelines are not taken into account).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, MutableMapping

from mindspeed_tft.events import EVENTS_FILE_ENV, events_file_from_env
from mindspeed_tft.features import DEFAULT_OPTIMIZER_REPLICA_NUM, Features

#: the Stable API of this module (a Megatron `extra_args_provider`); the rest is internal
__all__ = ["add_tft_args"]

logger = logging.getLogger(__name__)

ARGUMENT_GROUP_TITLE = "mindspeed-tft high availability"
HIGH_AVAILABILITY_ENV = "HIGH_AVAILABILITY"
#: set by `tft-run` (and a torchrun with the hook) in every worker under high availability:
#: the controller runs in the launcher, which restarts failed workers (worker reboot)
CONTROLLER_IN_LAUNCHER_ENV = "TFT_CONTROLLER_IN_LAUNCHER"

#: HIGH_AVAILABILITY modes -> (hbmfault repair, worker reboot, elastic training); every mode
#: turns HA on. elastic-training (MindIO's and MindSpeed-LLM's name) is worker reboot that
#: shrinks when no replacement comes.
HIGH_AVAILABILITY_MODES: dict[str, tuple[bool, bool, bool]] = {
    "dump": (False, False, False),
    "retry": (True, False, False),
    "recover": (False, True, False),
    "elastic-training": (False, True, True),
}
_MODE_NAMES = ", ".join(HIGH_AVAILABILITY_MODES)


class TFTArgumentError(ValueError):
    """A mindspeed-tft command-line or environment setting that cannot be used."""


def _metrics_port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a port (allowed: 1..65535; 0: no metrics endpoint)")
    return port


def add_tft_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the mindspeed-tft argument group to ``parser``.

    Usable as Megatron-LM's ``extra_args_provider``. The default of ``--tft-events-file`` is
    the ``TFT_EVENTS_FILE`` environment variable at the time of this call. The values are
    checked later, before the model is built (a bad one stops the start with exit code 2).

    Args:
        parser: the training script's argument parser.

    Returns:
        The same parser, with the group "mindspeed-tft high availability" added.
    """
    group = parser.add_argument_group(title=ARGUMENT_GROUP_TITLE)
    group.add_argument(
        "--enable-high-availability",
        action="store_true",
        help="Master switch of mindspeed-tft: enables TTP, the dying-gasp checkpoint written "
        "at the last consistent step when a fault hits. Also switched on by the environment "
        "variable HIGH_AVAILABILITY=dump|retry|recover|elastic-training, which wins over the "
        "command line.",
    )
    group.add_argument(
        "--enable-hbmfault-repair",
        action="store_true",
        help="UCE: repair on-chip memory faults online and recompute the step. Takes effect "
        "only with --enable-high-availability (refused without it).",
    )
    group.add_argument(
        "--enable-worker-reboot",
        action="store_true",
        help="ARF: restart only the failed worker(s) and continue training. Takes effect only "
        "with --enable-high-availability (refused without it).",
    )
    group.add_argument(
        "--enable-elastic-training",
        action="store_true",
        help="Elastic training: when a failed worker gets no replacement (no spare, the "
        "restart budget spent, the node gone), the data-parallel replicas holding a failed "
        "rank leave and the others continue with the same global batch and sample order; "
        "needs --enable-worker-reboot and the distributed optimizer.",
    )
    group.add_argument(
        "--distributed-optimizer-no-replica",
        action="store_true",
        help="No optimizer replicas (N = 1): no extra memory; repairs load the last periodic "
        "checkpoint instead of copying from a peer. Takes effect only with "
        "--enable-high-availability (refused without it) and the distributed optimizer.",
    )
    group.add_argument(
        "--optimizer-replica-num",
        type=int,
        default=DEFAULT_OPTIMIZER_REPLICA_NUM,
        metavar="N",
        help="Number of copies N of every distributed-optimizer shard (default "
        f"{DEFAULT_OPTIMIZER_REPLICA_NUM}); N must divide the data-parallel size d (1 <= N <= d; "
        "N = d: every data-parallel rank holds the whole optimizer state). "
        "Takes effect only with --enable-high-availability and the distributed optimizer.",
    )
    _add_observability_args(group)
    return parser


def _add_observability_args(group: argparse._ArgumentGroup) -> None:
    """The events file, the replica check and the metrics endpoint (`add_tft_args`)."""
    group.add_argument(
        "--tft-events-file",
        default=events_file_from_env(),
        metavar="PATH",
        help="Append the JSON Lines event stream (faults, states, strategies, dumps, "
        f"iterations) to PATH. Default: the {EVENTS_FILE_ENV} environment variable.",
    )
    group.add_argument(
        "--tft-check-replicas-interval",
        type=int,
        default=0,
        metavar="K",
        help="Every K iterations, check that all holders of each optimizer shard hold "
        "bit-identical copies (CRC-32 of main params, moments and step, compared across the "
        "replica group) and record a replica_check event; a mismatch stops training with an "
        "error. 0 (default): never.",
    )
    group.add_argument(
        "--tft-metrics-port",
        type=_metrics_port,
        default=None,
        metavar="PORT",
        help="Serve the controller's metrics (OpenMetrics / Prometheus text: state, ranks, "
        "incidents, time to recover, iterations lost, goodput) on PORT of TFT_METRICS_ADDR "
        "(default 127.0.0.1), from rank 0 or tft-run's node-0 launcher. Sets TFT_METRICS_PORT "
        "(the flag wins over it); 0: off. Needs --enable-high-availability and "
        "pip install mindspeed-tft[metrics].",
    )


def export_metrics_port(args: argparse.Namespace, environ: MutableMapping[str, str]) -> None:
    """``--tft-metrics-port P`` -> ``TFT_METRICS_PORT=P`` in ``environ``, where the control
    plane reads it (and processes started from here inherit it); nothing without the flag."""
    from mindspeed_tft.control.wire.config import METRICS_PORT_ENV

    port = getattr(args, "tft_metrics_port", None)
    if port is not None:
        environ[METRICS_PORT_ENV] = str(port)


def parse_high_availability_env(value: str) -> tuple[str, ...]:
    """The modes of a ``HIGH_AVAILABILITY`` value, in order, without repeats.

    A comma-separated list of dump, retry, recover, elastic-training; case-insensitive;
    whitespace around items is ignored. An empty or blank value means "not set" (returns
    ``()``). Any other item, an empty one included, raises `TFTArgumentError`.
    """
    if not value.strip():
        return ()
    modes: list[str] = []
    for raw in value.split(","):
        mode = raw.strip().lower()
        if mode not in HIGH_AVAILABILITY_MODES:
            raise TFTArgumentError(
                f"{HIGH_AVAILABILITY_ENV}={value!r}: unknown mode {raw.strip()!r}; "
                f"allowed: {_MODE_NAMES} (comma-separated, case-insensitive)"
            )
        if mode not in modes:
            modes.append(mode)
    return tuple(modes)


def validate_tft_args(
    args: argparse.Namespace, environ: MutableMapping[str, str] | None = None
) -> argparse.Namespace:
    """Check the mindspeed-tft settings in ``args`` and record the outcome on it.

    Call after Megatron's own argument validation. ``environ`` defaults to ``os.environ``
    (with high availability, ``--tft-metrics-port`` is written to it). Raises
    `TFTArgumentError`; returns ``args`` with ``tft_features`` and
    ``num_distributed_optimizer_instances`` set (`apply_features`).
    """
    environ = os.environ if environ is None else environ
    _ensure_defaults(args)

    if getattr(args, "tft_check_replicas_interval", 0) < 0:
        raise TFTArgumentError(
            f"--tft-check-replicas-interval {args.tft_check_replicas_interval} is invalid; "
            "allowed: 0 (never) or a positive number of iterations"
        )
    if args.optimizer_replica_num < 1:
        raise TFTArgumentError(
            f"--optimizer-replica-num {args.optimizer_replica_num} is invalid; "
            "allowed: an integer >= 1"
        )

    _apply_high_availability_env(args, high_availability_env(environ))

    if not args.enable_high_availability:
        ignored = []
        if args.enable_hbmfault_repair:
            ignored.append("--enable-hbmfault-repair")
        if args.enable_worker_reboot:
            ignored.append("--enable-worker-reboot")
        if args.enable_elastic_training:
            ignored.append("--enable-elastic-training")
        if args.distributed_optimizer_no_replica:
            ignored.append("--distributed-optimizer-no-replica")
        if args.optimizer_replica_num != DEFAULT_OPTIMIZER_REPLICA_NUM:
            ignored.append(f"--optimizer-replica-num {args.optimizer_replica_num}")
        if getattr(args, "tft_metrics_port", None):
            ignored.append(f"--tft-metrics-port {args.tft_metrics_port}")
        if ignored:
            verb, pronoun = ("takes", "it") if len(ignored) == 1 else ("take", "them")
            raise TFTArgumentError(
                f"{', '.join(ignored)} {verb} effect only with --enable-high-availability; "
                f"allowed: add --enable-high-availability (or set {HIGH_AVAILABILITY_ENV}="
                f"{_MODE_NAMES.replace(', ', '|')}) or remove {pronoun}"
            )
        replica_num = 1 if args.use_distributed_optimizer else _dp_size(args)
    else:
        replica_num = _validate_high_availability(args)
    apply_features(args, Features.from_args(args, replica_num))
    if args.enable_high_availability:
        check_first_fault_can_succeed(args, environ)
        export_metrics_port(args, environ)
    check_environment(args, environ)
    return args


def apply_features(args: argparse.Namespace, features: Features) -> None:
    """Write what Megatron reads from ``args`` that ``features`` decide: ``tft_features``
    itself and megatron-core's ``num_distributed_optimizer_instances`` (the replica engine,
    SPEC 2: one distributed-optimizer instance per replica, each sharding the state over d/N
    ranks; `Features.optimizer_instances`)."""
    args.tft_features = features
    args.num_distributed_optimizer_instances = features.optimizer_instances


def apply_scale(args: argparse.Namespace, features: Features, rank: int) -> None:
    """A scale change (elastic training): ``features`` of the new world (`apply_features`)
    and the world Megatron sees, ``world_size`` and ``data_parallel_size`` from them, with
    this process's new ``rank``."""
    apply_features(args, features)
    args.rank = rank
    args.world_size, args.data_parallel_size = features.parallel.world_size, features.parallel.data


def high_availability_env(environ: Mapping[str, str]) -> str:
    """The value of ``HIGH_AVAILABILITY`` in `environ` ("" when unset); read here only."""
    return environ.get(HIGH_AVAILABILITY_ENV, "")


def launched_by_tft(environ: Mapping[str, str]) -> bool:
    """This worker was started by `tft-run` (or a torchrun with the hook) under high
    availability: the controller runs in its launcher, which restarts failed workers."""
    return environ.get(CONTROLLER_IN_LAUNCHER_ENV) == "1"


def check_save_dir(args: argparse.Namespace) -> None:
    """The dying-gasp checkpoint is written under ``--save``: refuse a high-availability job
    without one (elastic training shrinks through the dump, so it names that flag first), or
    with one this process cannot create or write. Raises `TFTArgumentError`."""
    save = getattr(args, "save", None)
    if not save:
        if getattr(args, "enable_elastic_training", False):
            raise TFTArgumentError(
                "--enable-elastic-training needs --save DIR: a shrink continues from the "
                "dying-gasp checkpoint written there, and without it the first lost worker ends "
                "the job with nothing saved; allowed: add --save DIR")
        raise TFTArgumentError(
            "--enable-high-availability needs --save DIR: the dying-gasp checkpoint is written "
            "there, and without it the first fault ends the job with nothing saved; allowed: "
            "add --save DIR")
    problem = _unwritable(os.path.abspath(save))
    if problem:
        raise TFTArgumentError(
            f"--save {save}: {problem}, so the dying-gasp checkpoint could not be written there; "
            "allowed: a folder this process can create and write")


def _unwritable(path: str) -> str | None:
    """Why this process could not write checkpoints under `path` (None: it can)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "it is a file, not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else "the folder is not writable"
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"it does not exist and {parent} is not writable"
    return None


def check_first_fault_can_succeed(args: argparse.Namespace,
                                  environ: Mapping[str, str]) -> None:
    """Refuse the high-availability set-ups whose first fault could only fail (see the module
    docstring); raises `TFTArgumentError` naming the flag and the fix."""
    check_save_dir(args)
    if args.enable_worker_reboot and not launched_by_tft(environ):
        flag = ("--enable-worker-reboot" if args.tft_features_source == "command line"
                else f"worker reboot ({args.tft_features_source})")
        raise TFTArgumentError(
            f"{flag} needs a launcher that restarts failed workers, and this one never does "
            "(a killed worker would leave the others waiting for it until the launcher kills "
            "them, with nothing saved); allowed: launch with tft-run (torchrun's arguments) or a "
            "torchrun patched by scripts/patch_torchrun.sh, or remove worker reboot")


def check_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Read every environment variable the plugin will use, now, before anything expensive
    (model build, checkpoint load): ``TFT_INJECT`` and its companions always, the control
    plane's ``TTP_*`` with high availability. Raises `TFTArgumentError` naming the variable.
    The plugin reads them again where it uses them, with the same readers."""
    from mindspeed_tft.control.wire.config import ControlConfig, ControlConfigError
    from mindspeed_tft.control.wire.transport import check_bind
    from mindspeed_tft.faults import FaultInjector, FaultSpecError, check_ranks, items_from_env

    try:
        FaultInjector.from_env(getattr(args, "rank", 0) or 0, environ, store=None)
        world = getattr(args, "world_size", None)
        if isinstance(world, int) and world > 0:  # an item outside the job never fires
            check_ranks(items_from_env(environ), world)
        if args.enable_high_availability:
            config = ControlConfig.from_env(environ)
            if getattr(args, "rank", 0) == 0:  # rank 0 may host the controller (torchrun)
                check_bind(config, config.controller_addr, "the controller")
                if config.metrics_port:  # and its metrics endpoint: prometheus_client
                    from mindspeed_tft.control.controller.metrics import prometheus

                    prometheus()
    except (FaultSpecError, ControlConfigError) as error:
        raise TFTArgumentError(str(error)) from None


# --- internals -------------------------------------------------------------------------------


def _ensure_defaults(args: argparse.Namespace) -> None:
    """Fill in the attributes `add_tft_args` would have added, for a parser without them."""
    for name, default in (
        ("enable_high_availability", False),
        ("enable_hbmfault_repair", False),
        ("enable_worker_reboot", False),
        ("enable_elastic_training", False),
        ("distributed_optimizer_no_replica", False),
        ("optimizer_replica_num", DEFAULT_OPTIMIZER_REPLICA_NUM),
        ("tft_events_file", None),
    ):
        if not hasattr(args, name):
            setattr(args, name, default)
    if not hasattr(args, "tft_features_source"):
        args.tft_features_source = "command line"


def _apply_high_availability_env(args: argparse.Namespace, value: str) -> None:
    modes = parse_high_availability_env(value)
    if not modes:
        return
    hbm_repair = any(HIGH_AVAILABILITY_MODES[m][0] for m in modes)
    worker_reboot = any(HIGH_AVAILABILITY_MODES[m][1] for m in modes)
    elastic = any(HIGH_AVAILABILITY_MODES[m][2] for m in modes)
    for flag, attr, wanted in (
        ("--enable-hbmfault-repair", "enable_hbmfault_repair", hbm_repair),
        ("--enable-worker-reboot", "enable_worker_reboot", worker_reboot),
        ("--enable-elastic-training", "enable_elastic_training", elastic),
    ):
        if getattr(args, attr) and not wanted:
            logger.warning(
                "%s=%r wins over the command line: %s is switched off",
                HIGH_AVAILABILITY_ENV, value, flag,
            )
    args.enable_high_availability = True
    args.enable_hbmfault_repair = hbm_repair
    args.enable_worker_reboot = worker_reboot
    args.enable_elastic_training = elastic
    args.tft_features_source = f"{HIGH_AVAILABILITY_ENV}={value.strip()}"


def _dp_size(args: argparse.Namespace) -> int:
    """d: the size of the data-parallel x context-parallel group."""
    return int(args.data_parallel_size) * int(getattr(args, "context_parallel_size", 1) or 1)


def _dp_label(args: argparse.Namespace) -> str:
    if int(getattr(args, "context_parallel_size", 1) or 1) > 1:
        return "data-parallel x context-parallel size"
    return "data-parallel size"


def _divisors(n: int) -> str:
    """The divisors of ``n``, ascending, comma-separated."""
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def _check_replica_num(replica_num: int, group_size: int, label: str) -> None:
    """Refuse an N that does not divide ``group_size`` (N > ``group_size`` included)."""
    if group_size % replica_num:
        raise TFTArgumentError(
            f"--optimizer-replica-num {replica_num} does not divide the {label} {group_size}; "
            f"allowed: a divisor N of {group_size} with 1 <= N <= {group_size} "
            f"({_divisors(group_size)})"
        )


def _expert_dp_size(args: argparse.Namespace) -> tuple[int, str] | None:
    """(expert-data-parallel size, how it was computed) for MoE models, else None."""
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    if ep <= 1 and not getattr(args, "num_experts", None):
        return None
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    etp = int(getattr(args, "expert_tensor_parallel_size", None) or tp)
    world = getattr(args, "world_size", None)
    if world is None:
        world = _dp_size(args) * tp * pp
    world = int(world)
    how = f"world size {world} / (pipeline {pp} x expert {ep} x expert-tensor {etp})"
    return world // (pp * ep * etp), how


def _refuse_with_high_availability(args: argparse.Namespace) -> None:
    """The flags high availability cannot be combined with (SPEC 10)."""
    if getattr(args, "swap_optimizer", False):
        raise TFTArgumentError(
            "--enable-high-availability cannot be combined with --swap-optimizer (it moves "
            "optimizer state off the device); allowed: remove one of the two"
        )
    if getattr(args, "enable_gloo_process_groups", True) is False:
        raise TFTArgumentError(
            "--enable-high-availability cannot be combined with --disable-gloo-process-groups "
            "(recovery needs the gloo process groups); allowed: remove one of the two"
        )
    if getattr(args, "disable_gloo_group", False):
        raise TFTArgumentError(
            "--enable-high-availability cannot be combined with --disable-gloo-group "
            "(recovery needs the gloo process groups); allowed: remove one of the two"
        )


def _checked_data_parallel(args: argparse.Namespace) -> tuple[int, str, tuple[int, str] | None]:
    """(d, its name, the expert-DP size and how it was derived or None), each at least 2
    (SPEC 10) or a `TFTArgumentError`."""
    dp = _dp_size(args)
    label = _dp_label(args)
    if dp < 2:
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        cp = int(getattr(args, "context_parallel_size", 1) or 1)
        world = getattr(args, "world_size", None)
        world = dp * tp * pp if world is None else int(world)
        raise TFTArgumentError(
            f"--enable-high-availability needs a {label} >= 2, got {dp} (world size {world} = "
            f"tensor {tp} x pipeline {pp} x context {cp} x data {args.data_parallel_size}); "
            f"allowed: a parallel layout with {label} >= 2"
        )
    expert = _expert_dp_size(args)
    if expert is not None and expert[0] < 2:
        raise TFTArgumentError(
            "--enable-high-availability needs an expert-data-parallel size >= 2 for MoE, got "
            f"{expert[0]} ({expert[1]}); allowed: a parallel layout with expert-data-parallel "
            "size >= 2"
        )
    return dp, label, expert


def _validate_high_availability(args: argparse.Namespace) -> int:
    """SPEC 10 with HA on; returns the effective replica number."""
    distributed = bool(getattr(args, "use_distributed_optimizer", False))
    half = bool(getattr(args, "fp16", False) or getattr(args, "bf16", False))
    if not distributed and not half:
        raise TFTArgumentError(
            "--enable-high-availability needs the distributed optimizer or the fp16/bf16 "
            "optimizer, got the fp32 non-distributed optimizer; allowed: add "
            "--use-distributed-optimizer, --bf16 or --fp16"
        )
    if args.distributed_optimizer_no_replica and not distributed:
        raise TFTArgumentError(
            "--distributed-optimizer-no-replica needs --use-distributed-optimizer (the "
            "fp16/bf16 optimizer keeps a full copy on every data-parallel rank); allowed: add "
            "--use-distributed-optimizer or remove --distributed-optimizer-no-replica"
        )
    if args.distributed_optimizer_no_replica and args.optimizer_replica_num not in (
        1,
        DEFAULT_OPTIMIZER_REPLICA_NUM,
    ):
        raise TFTArgumentError(
            f"--optimizer-replica-num {args.optimizer_replica_num} contradicts "
            "--distributed-optimizer-no-replica (1 replica); allowed: one of the two"
        )
    if args.enable_elastic_training and not (args.enable_worker_reboot and distributed):
        missing = [flag for flag, on in (("--enable-worker-reboot", args.enable_worker_reboot),
                                         ("--use-distributed-optimizer", distributed)) if not on]
        raise TFTArgumentError(
            f"--enable-elastic-training needs {' and '.join(missing)} (a shrink is a worker "
            "reboot without a replacement, and re-shards the distributed optimizer); allowed: "
            f"add {' and '.join(missing)} or remove --enable-elastic-training"
        )
    _refuse_with_high_availability(args)
    dp, label, expert = _checked_data_parallel(args)

    if not distributed:
        return dp
    if args.distributed_optimizer_no_replica:
        return 1
    replica_num = int(args.optimizer_replica_num)
    _check_replica_num(replica_num, dp, label)
    if expert is not None:
        _check_replica_num(replica_num, expert[0], "expert-data-parallel size")
    expert_parallel = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    if expert_parallel > 1 and replica_num > 1:
        raise TFTArgumentError(
            f"--optimizer-replica-num {replica_num} cannot be combined with "
            f"--expert-model-parallel-size {expert_parallel}: "
            "megatron-core 0.12.1's partial distributed optimizer (the replica engine) does not "
            "support expert parallelism; allowed: --distributed-optimizer-no-replica, or no "
            "expert parallelism"
        )
    return replica_num
