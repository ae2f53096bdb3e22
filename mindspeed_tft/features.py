"""The one object that says which fault-tolerance features a job switched on, with how many
optimizer replicas, in which parallel layout.

Decided once at start-up from the flags and ``HIGH_AVAILABILITY``
(`mindspeed_tft.arguments.validate_tft_args` records it as ``args.tft_features``) and read
by every layer: the plugin (what to start, the replica layout it builds), the controller
(which strategy a fault gets, SPEC 6; a backup receives it with the rank table), the
launcher (whether to restart workers). It is the one home of the replica number and the
parallel sizes: a scale change (elastic training) replaces it with `Features.scaled`, and
`mindspeed_tft.arguments.apply_features` writes what Megatron reads from ``args`` out of it.
It depends on nothing, so every layer may import it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the type of `from_args`'s argument only
    import argparse

DEFAULT_OPTIMIZER_REPLICA_NUM = 2


@dataclass(frozen=True)
class ParallelSizes:
    """The job's parallel layout, in Megatron's sizes: its ranks and the model-parallel
    sizes; the data-parallel size follows from them."""

    world_size: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    #: Megatron's ``--expert-tensor-parallel-size`` (its default: the tensor size)
    expert_tensor: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ParallelSizes:
        """Megatron's sizes on ``args`` (a missing or unset size counts as 1)."""
        def size(name: str, default: int = 1) -> int:
            return int(getattr(args, name, None) or default)

        tensor = size("tensor_model_parallel_size")
        return cls(world_size=size("world_size"), tensor=tensor,
                   pipeline=size("pipeline_model_parallel_size"),
                   context=size("context_parallel_size"),
                   expert=size("expert_model_parallel_size"),
                   expert_tensor=size("expert_tensor_parallel_size", tensor))

    @property
    def data(self) -> int:
        """The data-parallel size (Megatron's ``data_parallel_size``, without context
        parallelism)."""
        return self.world_size // (self.tensor * self.pipeline * self.context)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelSizes:
        """From `asdict` data off the network: unknown keys are ignored, a size that is not
        a positive int is a ValueError naming it."""
        values: dict[str, int] = {}
        for name in cls.__dataclass_fields__:
            if name in data:
                value = data[name]
                if type(value) is not int or value < 1:
                    raise ValueError(f"parallel size {name}={value!r} is not a positive int")
                values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class Features:
    """What the plugin does in this job, decided once at startup by `validate_tft_args`.

    ``replica_num`` is the effective number of copies of each optimizer-state shard across
    the data-parallel (x context-parallel) group, as `validate_tft_args` decides it (1 without
    replicas, d with full copies); ``source`` says what switched the features on:
    ``"command line"`` or ``"HIGH_AVAILABILITY=<value>"``.
    """

    high_availability: bool = False
    hbm_repair: bool = False
    worker_reboot: bool = False
    no_replica: bool = False
    replica_num: int = 1
    source: str = "command line"
    #: shrink by the data-parallel replicas of a lost rank when no replacement comes
    elastic: bool = False
    #: the job's parallel layout now (a scale change replaces it: `scaled`)
    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    #: megatron-core's distributed optimizer (``--use-distributed-optimizer``): replicas
    #: shard its state; without it every rank holds a whole copy
    distributed_optimizer: bool = False
    #: the replica number the job started with (0: ``replica_num``): a scale change re-forms
    #: the replicas from it (`mindspeed_tft.elastic.replica_num_for`)
    launch_replica_num: int = 0

    def __post_init__(self) -> None:
        if not self.launch_replica_num:
            object.__setattr__(self, "launch_replica_num", self.replica_num)

    @classmethod
    def from_args(cls, args: argparse.Namespace, replica_num: int | None = None) -> Features:
        """Read the features from ``args`` (missing attributes count as off).

        ``replica_num`` is what `validate_tft_args` decided; without it (unvalidated args)
        it is 1 without high availability or with no-replica, else ``--optimizer-replica-num``.
        """
        high_availability = bool(getattr(args, "enable_high_availability", False))
        no_replica = bool(getattr(args, "distributed_optimizer_no_replica", False))
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
            parallel=ParallelSizes.from_args(args),
            distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        )

    def scaled(self, world_size: int, replica_num: int) -> Features:
        """The features of the same job in a world of `world_size` ranks with `replica_num`
        optimizer replicas (a scale change; the model-parallel sizes stay)."""
        return replace(self, parallel=replace(self.parallel, world_size=world_size),
                       replica_num=replica_num)

    @property
    def optimizer_instances(self) -> int:
        """megatron-core's ``num_distributed_optimizer_instances``: the replica engine (SPEC
        2) runs one distributed-optimizer instance per replica with high availability; else
        one."""
        replicated = self.high_availability and self.distributed_optimizer
        return self.replica_num if replicated else 1

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
        for name, spec in cls.__dataclass_fields__.items():
            if name not in data:
                continue
            value = data[name]
            if spec.type == "ParallelSizes":
                if not isinstance(value, dict):
                    raise ValueError(f"feature {name}={value!r} is not a map of sizes")
                values[name] = ParallelSizes.from_dict(value)
                continue
            kind = {"bool": bool, "int": int, "str": str}[str(spec.type)]
            if type(value) is not kind:
                raise ValueError(f"feature {name}={value!r} is not a {kind.__name__}")
            values[name] = value
        return cls(**values)
