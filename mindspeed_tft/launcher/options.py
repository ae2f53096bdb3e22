"""What one launch asks for: torchrun's arguments, the launcher's own, and the features that
the training command's arguments (or `HIGH_AVAILABILITY`) switch on.

The launcher accepts every torchrun argument (`torch.distributed.run.get_args_parser`) plus:

| option / variable | meaning | default |
| --- | --- | --- |
| `--tft-spares-per-node K` | warm spare worker processes kept ready on this node | 0 |
| `--max-restarts N` | torchrun's: how many times this node's launcher restarts failed workers (see below) | 8 with worker reboot, else torchrun's 0 |
| `TFT_MAX_WORKER_RESTARTS` | the same budget from the environment, with worker reboot | |

`--max-restarts N` keeps torchrun's meaning, the number of restarts of failed workers this
node's launcher makes before the job fails (`restart_budget`, the one place the budget is
decided). With worker reboot a restart is of the failed worker only, while the others keep
training (and the whole group is never restarted); without it torch restarts the whole worker
group, as torchrun does. `--max-restarts` (or torchrun's own `PET_MAX_RESTARTS`) and
`TFT_MAX_WORKER_RESTARTS` set the same number: given both, they must agree.

With high availability, the training command's `--tft-metrics-port P` is written to
`TFT_METRICS_PORT` in the launcher's environment (`mindspeed_tft.arguments.
export_metrics_port`, as the trainer does), so node 0's controller serves its metrics there
(`mindspeed_tft.control.controller.metrics`); the workers inherit it.

The features are read from the training script's own arguments with the trainer's parser
group (`mindspeed_tft.arguments.add_tft_args`) and the trainer's rule for
`HIGH_AVAILABILITY` (it wins over the command line), so launcher and trainer always agree:

- high availability: `--enable-high-availability` or `HIGH_AVAILABILITY` set; node 0's
  launcher then hosts the controller;
- worker reboot (ARF): `--enable-worker-reboot` with `--enable-high-availability`, or
  `HIGH_AVAILABILITY` containing `recover`; the launcher then restarts only failed workers.

With high availability the training command's set-ups whose first fault could only fail are
refused here too, with the trainer's own check and message (`arguments.check_save_dir`: no
``--save`` folder for the dump, or one that cannot be written).

Every refusal is a `LauncherError` (a ValueError) naming the value and what is allowed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

SPARES_OPTION = "--tft-spares-per-node"
MAX_RESTARTS_OPTION = "--max-restarts"
MAX_WORKER_RESTARTS_ENV = "TFT_MAX_WORKER_RESTARTS"
#: the budget with worker reboot when neither `--max-restarts` nor the variable gives one
#: (torchrun's own default, 0, would leave worker reboot nothing to do)
DEFAULT_MAX_WORKER_RESTARTS = 8
#: torchrun's environment form of `--max-restarts` (its `env` argparse action)
PET_MAX_RESTARTS_ENV = "PET_MAX_RESTARTS"
MAX_RESTARTS_HELP = (
    "Maximum number of restarts of failed workers this node's launcher makes before the job "
    "fails (torchrun's meaning). mindspeed-tft: with worker reboot (--enable-high-availability "
    "--enable-worker-reboot in the training command) each restart restarts only the failed "
    f"worker, the others keep training; default {DEFAULT_MAX_WORKER_RESTARTS} there, or "
    f"{MAX_WORKER_RESTARTS_ENV}. Without worker reboot: the whole worker group, as torchrun; "
    "default 0.")


class LauncherError(ValueError):
    """A launcher setting that cannot be used (the message names it and what is allowed)."""


@dataclass(frozen=True)
class LaunchOptions:
    """The decisions of one launch (see the module docstring)."""

    high_availability: bool
    worker_reboot: bool
    spares_per_node: int
    #: `restart_budget`: with worker reboot, restarts of failed workers only; without, torch's
    #: restarts of the whole worker group (`torch_max_restarts`)
    max_restarts: int
    #: the training command's mindspeed-tft flags, `HIGH_AVAILABILITY` folded in
    tft_args: argparse.Namespace
    #: this node's `--node-rank` (the static rendezvous' group rank)
    node_rank: int

    @property
    def torch_max_restarts(self) -> int:
        """torch's `--max-restarts` (whole-group restarts): none with worker reboot, where
        this launcher restarts the failed workers themselves."""
        return 0 if self.worker_reboot else self.max_restarts

    @property
    def elastic(self) -> bool:
        """Elastic training: a worker that gets no replacement may leave the job."""
        return self.worker_reboot and bool(getattr(self.tft_args, "enable_elastic_training",
                                                   False))

    def describe(self) -> str:
        """One line for the launcher's log."""
        if not self.high_availability:
            return "high availability off: launching exactly like torchrun"
        parts = ["high availability on (controller in node 0's launcher)"]
        if self.worker_reboot:
            parts.append(f"worker reboot on (at most {self.max_restarts} restarts of "
                         f"failed workers on this node: {MAX_RESTARTS_OPTION})")
            if self.spares_per_node:
                parts.append(f"{self.spares_per_node} warm spare(s) per node")
            if self.elastic:
                parts.append("elastic training on (without a replacement the job shrinks)")
        else:
            parts.append("worker reboot off (a failed worker stops the node, like torchrun)")
        return "; ".join(parts)


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a whole number >= 0 (allowed: 0, 1, 2, ...)")
    return number


def add_launcher_args(parser: argparse.ArgumentParser,
                      environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Add the launcher's own options to a torchrun argument parser and give its
    `--max-restarts` this launcher's meaning and default (None: not given, see
    `restart_budget`); returns it."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        if MAX_RESTARTS_OPTION in action.option_strings:
            action.help = MAX_RESTARTS_HELP
            if PET_MAX_RESTARTS_ENV not in environ:
                action.default = None
    parser.add_argument(
        SPARES_OPTION, "--tft_spares_per_node", dest="tft_spares_per_node",
        type=_non_negative_int, default=0, metavar="K",
        help="mindspeed-tft: keep K warm spare worker processes per node (started ahead of "
        "time with the training command, waiting in "
        "mindspeed_tft.launcher.spare.wait_for_assignment()); a failed worker's rank is "
        "handed to a spare instead of a cold restart. Needs worker reboot. Default 0.")
    return parser


def restart_budget(given: int | None, worker_reboot: bool,
                   environ: Mapping[str, str] | None = None) -> int:
    """How many times this node's launcher restarts failed workers (see the module
    docstring): `--max-restarts` (`given`; None when not on the command line), else, with
    worker reboot, `TFT_MAX_WORKER_RESTARTS` or 8; without worker reboot torchrun's 0 (the
    variable is read with worker reboot only). A variable that is not a whole number >= 0,
    or one that contradicts `--max-restarts`, is an error."""
    environ = os.environ if environ is None else environ
    if given is not None and given < 0:
        raise LauncherError(f"{MAX_RESTARTS_OPTION} {given} is not a whole number >= 0; "
                            "allowed: 0 (never restart), 1, 2, ...")
    raw = environ.get(MAX_WORKER_RESTARTS_ENV, "").strip() if worker_reboot else ""
    from_env: int | None = None
    if raw:
        try:
            from_env = int(raw)
        except ValueError:
            from_env = -1
        if from_env < 0:
            raise LauncherError(
                f"{MAX_WORKER_RESTARTS_ENV}={environ[MAX_WORKER_RESTARTS_ENV]!r} is not a whole "
                f"number >= 0; allowed: 0 (never restart), 1, 2, ... (default "
                f"{DEFAULT_MAX_WORKER_RESTARTS} with worker reboot)")
    if given is not None and from_env is not None and given != from_env:
        raise LauncherError(
            f"{MAX_RESTARTS_OPTION} {given} contradicts {MAX_WORKER_RESTARTS_ENV}={from_env}: "
            "both set how many times this node's launcher restarts failed workers; allowed: "
            f"one of the two, or the same number")
    if given is not None:
        return given
    if from_env is not None:
        return from_env
    return DEFAULT_MAX_WORKER_RESTARTS if worker_reboot else 0


def training_features(script_args: Sequence[str],
                      environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The mindspeed-tft flags of a training command, `HIGH_AVAILABILITY` folded in exactly
    as the trainer folds it (`enable_high_availability`, `enable_worker_reboot`, ...)."""
    from mindspeed_tft.arguments import (
        TFTArgumentError,
        _apply_high_availability_env,
        add_tft_args,
        high_availability_env,
    )

    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_tft_args(parser)
    parser.add_argument("--save", default=None)  # where the dump goes (`check_save_dir`)
    try:
        tft_args, _ = parser.parse_known_args([str(a) for a in script_args])
    except argparse.ArgumentError as e:
        raise LauncherError(f"training script arguments: {e}") from None
    try:
        _apply_high_availability_env(tft_args, high_availability_env(environ))
    except TFTArgumentError as e:
        raise LauncherError(str(e)) from None
    return tft_args


def launch_options(args: argparse.Namespace,
                   environ: MutableMapping[str, str] | None = None) -> LaunchOptions:
    """Decide what the launch does from parsed launcher arguments (torchrun's + ours);
    with high availability, `--tft-metrics-port` goes to `environ` (default `os.environ`)."""
    from mindspeed_tft.arguments import TFTArgumentError, check_save_dir, export_metrics_port

    environ = os.environ if environ is None else environ
    tft_args = training_features(getattr(args, "training_script_args", []) or [], environ)
    high_availability = bool(tft_args.enable_high_availability)
    if high_availability:
        try:
            check_save_dir(tft_args)
        except TFTArgumentError as e:
            raise LauncherError(str(e)) from None
        export_metrics_port(tft_args, environ)
    worker_reboot = high_availability and bool(tft_args.enable_worker_reboot)
    spares = int(getattr(args, "tft_spares_per_node", 0) or 0)
    if spares and not worker_reboot:
        raise LauncherError(
            f"{SPARES_OPTION} {spares} needs worker reboot; allowed: add "
            "--enable-high-availability --enable-worker-reboot to the training command (or set "
            f"HIGH_AVAILABILITY=recover), or use {SPARES_OPTION} 0")
    restarts = restart_budget(getattr(args, "max_restarts", None), worker_reboot, environ)
    return LaunchOptions(
        high_availability=high_availability,
        worker_reboot=worker_reboot,
        spares_per_node=spares,
        max_restarts=restarts,
        tft_args=tft_args,
        node_rank=int(getattr(args, "node_rank", 0) or 0),
    )


def torch_run_functions() -> tuple[Any, Any]:
    """torch's own `torch.distributed.run.run` and `get_args_parser`, whatever the torchrun
    hook installed later."""
    import torch.distributed.run as torch_run

    return (getattr(torch_run, "_mindspeed_tft_original_run", torch_run.run),
            getattr(torch_run, "_mindspeed_tft_original_get_args_parser",
                    torch_run.get_args_parser))


def get_args_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser with the launcher's options added."""
    return add_launcher_args(torch_run_functions()[1]())

