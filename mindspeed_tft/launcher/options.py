"""What one launch asks for: torchrun's arguments, the launcher's own, and the features that
the training command's arguments (or `HIGH_AVAILABILITY`) switch on.

The launcher accepts every torchrun argument (`torch.distributed.run.get_args_parser`) plus:

| option / variable | meaning | default |
| --- | --- | --- |
| `--tft-spares-per-node K` | warm spare worker processes kept ready on this node | 0 |
| `TFT_MAX_WORKER_RESTARTS` | restarts of failed workers this node's launcher may make | 8 |

With high availability, the training command's `--tft-metrics-port P` is written to
`TFT_METRICS_PORT` in the launcher's environment (`mindspeed_tft.arguments.
export_metrics_port`, as the trainer does), so node 0's controller serves its metrics there
(`mindspeed_tft.control.metrics`); the workers inherit it.

The features are read from the training script's own arguments with the trainer's parser
group (`mindspeed_tft.arguments.add_tft_args`) and the trainer's rule for
`HIGH_AVAILABILITY` (it wins over the command line), so launcher and trainer always agree:

- high availability: `--enable-high-availability` or `HIGH_AVAILABILITY` set; node 0's
  launcher then hosts the controller;
- worker reboot (ARF): `--enable-worker-reboot` with `--enable-high-availability`, or
  `HIGH_AVAILABILITY` containing `recover`; the launcher then restarts only failed workers.

Every refusal is a `LauncherError` (a ValueError) naming the value and what is allowed.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

SPARES_OPTION = "--tft-spares-per-node"
MAX_WORKER_RESTARTS_ENV = "TFT_MAX_WORKER_RESTARTS"
DEFAULT_MAX_WORKER_RESTARTS = 8


class LauncherError(ValueError):
    """A launcher setting that cannot be used (the message names it and what is allowed)."""


@dataclass(frozen=True)
class LaunchOptions:
    """The decisions of one launch (see the module docstring)."""

    high_availability: bool
    worker_reboot: bool
    spares_per_node: int
    max_worker_restarts: int
    #: the training command's mindspeed-tft flags, `HIGH_AVAILABILITY` folded in
    tft_args: argparse.Namespace
    #: this node's `--node-rank` (the static rendezvous' group rank)
    node_rank: int

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
            parts.append(f"worker reboot on (at most {self.max_worker_restarts} restarts of "
                         f"failed workers on this node)")
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


def add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the launcher's own options to a torchrun argument parser; returns it."""
    parser.add_argument(
        SPARES_OPTION, "--tft_spares_per_node", dest="tft_spares_per_node",
        type=_non_negative_int, default=0, metavar="K",
        help="mindspeed-tft: keep K warm spare worker processes per node (started ahead of "
        "time with the training command, waiting in "
        "mindspeed_tft.launcher.spare.wait_for_assignment()); a failed worker's rank is "
        "handed to a spare instead of a cold restart. Needs worker reboot. Default 0.")
    return parser


def max_worker_restarts(environ: Mapping[str, str] | None = None) -> int:
    """`TFT_MAX_WORKER_RESTARTS` (default 8); a value that is not a whole number >= 0 is an
    error."""
    environ = os.environ if environ is None else environ
    raw = environ.get(MAX_WORKER_RESTARTS_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_WORKER_RESTARTS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise LauncherError(
            f"{MAX_WORKER_RESTARTS_ENV}={environ[MAX_WORKER_RESTARTS_ENV]!r} is not a whole "
            f"number >= 0; allowed: 0 (never restart), 1, 2, ... (default "
            f"{DEFAULT_MAX_WORKER_RESTARTS})")
    return value


def training_features(script_args: Sequence[str],
                      environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The mindspeed-tft flags of a training command, `HIGH_AVAILABILITY` folded in exactly
    as the trainer folds it (`enable_high_availability`, `enable_worker_reboot`, ...)."""
    from mindspeed_tft.arguments import (
        HIGH_AVAILABILITY_ENV,
        TFTArgumentError,
        _apply_high_availability_env,
        add_tft_args,
    )

    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_tft_args(parser)
    try:
        tft_args, _ = parser.parse_known_args([str(a) for a in script_args])
    except argparse.ArgumentError as e:
        raise LauncherError(f"training script arguments: {e}") from None
    try:
        _apply_high_availability_env(tft_args, environ.get(HIGH_AVAILABILITY_ENV, ""))
    except TFTArgumentError as e:
        raise LauncherError(str(e)) from None
    return tft_args


def launch_options(args: argparse.Namespace,
                   environ: MutableMapping[str, str] | None = None) -> LaunchOptions:
    """Decide what the launch does from parsed launcher arguments (torchrun's + ours);
    with high availability, `--tft-metrics-port` goes to `environ` (default `os.environ`)."""
    from mindspeed_tft.arguments import export_metrics_port

    environ = os.environ if environ is None else environ
    tft_args = training_features(getattr(args, "training_script_args", []) or [], environ)
    high_availability = bool(tft_args.enable_high_availability)
    if high_availability:
        export_metrics_port(tft_args, environ)
    worker_reboot = high_availability and bool(tft_args.enable_worker_reboot)
    spares = int(getattr(args, "tft_spares_per_node", 0) or 0)
    if spares and not worker_reboot:
        raise LauncherError(
            f"{SPARES_OPTION} {spares} needs worker reboot; allowed: add "
            "--enable-high-availability --enable-worker-reboot to the training command (or set "
            f"HIGH_AVAILABILITY=recover), or use {SPARES_OPTION} 0")
    restarts = max_worker_restarts(environ) if worker_reboot else 0
    return LaunchOptions(
        high_availability=high_availability,
        worker_reboot=worker_reboot,
        spares_per_node=spares,
        max_worker_restarts=restarts,
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

