"""The one object that says which fault-tolerance features a job switched on.

Decided once at start-up from the flags and ``HIGH_AVAILABILITY``
(`mindspeed_tft.arguments.validate_tft_args` records it as ``args.tft_features``) and read
by every layer: the plugin (what to start), the controller (which strategy a fault gets,
SPEC 6; a backup receives it with the rank table), the launcher (whether to restart
workers). It depends on nothing, so every layer may import it.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_OPTIMIZER_REPLICA_NUM = 2


@dataclass(frozen=True)
class Features:
    """What the plugin does in this job, decided once at startup by `validate_tft_args`.

    ``replica_num`` is the effective number of copies of each optimizer-state shard (see the
    module docstring); ``source`` says what switched the features on: ``"command line"`` or
    ``"HIGH_AVAILABILITY=<value>"``.
    """

    high_availability: bool = False
    hbm_repair: bool = False
    worker_reboot: bool = False
    no_replica: bool = False
    replica_num: int = 1
    source: str = "command line"
    #: shrink by the data-parallel replicas of a lost rank when no replacement comes
    elastic: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Features:
        """Read the features from ``args`` (missing attributes count as off).

        ``replica_num`` is ``args.optimizer_replica_num_effective`` as set by
        `validate_tft_args`; on unvalidated args it falls back to 1 without high availability
        or with no-replica, else to ``--optimizer-replica-num``.
        """
        high_availability = bool(getattr(args, "enable_high_availability", False))
        no_replica = bool(getattr(args, "distributed_optimizer_no_replica", False))
        replica_num = getattr(args, "optimizer_replica_num_effective", None)
        if replica_num is None:
            replica_num = getattr(args, "optimizer_replica_num", DEFAULT_OPTIMIZER_REPLICA_NUM)
            if no_replica or not high_availability:
                replica_num = 1
        return cls(
            high_availability=high_availability,
            hbm_repair=bool(getattr(args, "enable_hbmfault_repair", False)),
            worker_reboot=bool(getattr(args, "enable_worker_reboot", False)),
            elastic=bool(getattr(args, "enable_elastic_training", False)),
            no_replica=no_replica,
            replica_num=int(replica_num),
            source=getattr(args, "tft_features_source", "command line"),
        )

    def describe(self) -> str:
        """One line for the startup log."""
        if not self.high_availability:
            return "mindspeed-tft: high availability off"

        def on_off(flag: bool) -> str:
            return "on" if flag else "off"

        return (
            "mindspeed-tft: high availability on (dying-gasp checkpoint), "
            f"hbmfault repair {on_off(self.hbm_repair)}, "
            f"worker reboot {on_off(self.worker_reboot)}, "
            f"{'elastic training on, ' if self.elastic else ''}"
            f"optimizer replicas {self.replica_num}"
            f"{' (no-replica: repair from the last checkpoint)' if self.no_replica else ''}; "
            f"set by {self.source}"
        )

    @classmethod
    def from_names(cls, names: str) -> Features:
        """From `dump,retry,recover,no_replica` (any subset; empty: dump only), as the
        standalone controller's `--features` takes them; high availability is on."""
        words = {w.strip().lower() for w in names.split(",") if w.strip()}
        unknown = words - {"dump", "retry", "recover", "no_replica"}
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)} (allowed: dump, retry, "
                             "recover, no_replica)")
        return cls(True, "retry" in words, "recover" in words, "no_replica" in words)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what a backup controller is sent)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Features:
        """Inverse of `to_dict`, for data from the network: unknown keys are ignored, a
        value of the wrong type is a ValueError naming it."""
        values: dict[str, Any] = {}
        for name, field in cls.__dataclass_fields__.items():
            if name not in data:
                continue
            value, kind = data[name], {"bool": bool, "int": int, "str": str}[str(field.type)]
            if type(value) is not kind:
                raise ValueError(f"feature {name}={value!r} is not a {kind.__name__}")
            values[name] = value
        return cls(**values)
