"""Replica planner: how many optimizer replicas N fit on the device, and what they buy.

    tft-plan --params 7B --tensor-model-parallel-size 2 \\
        --data-parallel-size 8 --grad-dtype bf16 --device-memory 64GiB \\
        --save-interval 500 --step-time 6

For a model (``--params``, a preset of configs/models/ with ``--preset``, or Megatron-LM's
model flags) on a TP x PP x CP x DP layout it prints, per row - native (megatron-core's
distributed optimizer, high availability off), no-replica (``--enable-high-availability
--distributed-optimizer-no-replica``) and every admissible N >= 2 (``--enable-high-availability
--optimizer-replica-num N``) - the bytes of training state per parameter on one device, the
GiB per device, whether that fits the device next to the activations, and the work a fault
loses; then the largest N that fits. ``--json`` prints one JSON object instead.

Bytes per parameter on one rank (`bytes_per_param`; bf16 params, Adam, distributed optimizer
sharded over d = DP x CP ranks, each shard held by N of them; docs/design.md section 2, the
usage guide's Table 1):

    bf16 grads (--grad-reduce-in-bf16):   4 + 16 N / d   (bf16 param + bf16 grad; fp32 main
                                                          param, m, v and main grad over d/N)
    fp32 grads (Megatron-LM's default):   6 + 12 N / d   (bf16 param + fp32 grad; main param,
                                                          m, v over d/N)

Native and no-replica are N = 1. `bench/memory.py` measures these figures on real jobs and
imports `bytes_per_param` from here. The parameters on one device are taken as the model's
parameters / (TP x PP) (embeddings and layers assumed evenly spread over the pipeline).
Which N is admissible is decided by the plugin's own validation
(`mindspeed_tft.arguments.validate_tft_args`): N divides d, d >= 2.

Work lost per fault (``--save-interval`` steps, ``--step-time`` seconds): without replicas
(native, no-replica) training goes back to the last periodic checkpoint, on average half a
save interval of steps, plus the reload (``--reload-time``, default 0: not counted). With
replicas a repair copies the lost shard from a peer and loses at most the step in flight.

``python -m mindspeed_tft.plan`` is the same command.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GRADS = ("bf16", "fp32")
#: bench/memory.py's names: "off" = native, "no-replica" = N = 1 with HA on, "on" = N replicas
HA_MODES = ("off", "no-replica", "on")
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
DEFAULT_ACTIVATION_SHARE = 0.25
GIB = 2**30

_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_MEMORY_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_NUMBER = r"([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)"


# --- the formula -----------------------------------------------------------------------------


def bytes_per_param(d: int, n: int, grad: str, ha: str = "on") -> float:
    """Bytes of training state per model parameter on one rank (bf16 params, Adam).

    ``d``: the size of the group the distributed optimizer shards over (DP x CP); ``n``: the
    copies of each shard (1 for native and no-replica); ``grad``: "bf16" or "fp32";
    ``ha``: "off" (native), "no-replica" or "on". Raises ValueError on a combination that
    cannot exist (n not dividing d, n != 1 without replicas).
    """
    if grad not in GRADS:
        raise ValueError(f"grad {grad!r}: allowed: {', '.join(GRADS)}")
    if ha not in HA_MODES:
        raise ValueError(f"ha {ha!r}: allowed: {', '.join(HA_MODES)}")
    if d < 1 or n < 1 or d % n:
        raise ValueError(f"d = {d}, N = {n}: allowed: d >= 1 and N a divisor of d")
    if ha != "on" and n != 1:
        raise ValueError(f"ha {ha!r} has N = 1, got N = {n}")
    if grad == "bf16":
        return 4 + 16 * n / d
    return 6 + 12 * n / d


# --- parsing ---------------------------------------------------------------------------------


def parse_count(text: str) -> int:
    """A parameter count: ``7e9``, ``7B``, ``1.3b``, ``350M``, ``7000000000`` (K, M, B or G,
    T: powers of 1000). Raises ValueError unless it is a positive number."""
    match = re.fullmatch(_NUMBER + r"\s*([kmbgt]?)", text.strip().lower())
    if not match:
        raise ValueError(f"{text!r} is not a count; allowed: e.g. 7e9, 7B, 1.3B, 350M")
    value = round(float(match.group(1)) * _COUNT_SUFFIXES[match.group(2)])
    if value < 1:
        raise ValueError(f"{text!r}: allowed: a count >= 1")
    return value


def parse_memory(text: str) -> int:
    """Bytes from ``64GiB``, ``80GB``, ``512MiB``, ``1.5TiB`` (kB/MB/GB/TB: powers of 1000,
    KiB/MiB/GiB/TiB: powers of 1024; case-insensitive). The unit is required."""
    match = re.fullmatch(_NUMBER + r"\s*([kmgt]?i?b)", text.strip().lower())
    if not match or match.group(2) not in _MEMORY_UNITS:
        raise ValueError(
            f"{text!r} is not a memory size; allowed: a number and a unit, e.g. 64GiB, 80GB "
            "(units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    value = round(float(match.group(1)) * _MEMORY_UNITS[match.group(2)])
    if value < 1:
        raise ValueError(f"{text!r}: allowed: a size > 0")
    return value


def _argtype(parse: Any) -> Any:
    """An argparse ``type`` from a parser raising ValueError (message kept)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0 or math.isinf(value):
            raise ValueError(f"{text!r}: allowed: a positive {kind.__name__}")
        return value

    return _argtype(parse)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: a number of seconds >= 0")
    return value


def _activation_memory(text: str) -> tuple[str, float]:
    """``25%`` (of the device memory) or a memory size."""
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            share = float(stripped[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 <= share < 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: allowed: a share of the device memory from 0% to below 100%, "
                "or a size such as 8GiB"
            )
        return "share", share
    return "bytes", float(_argtype(parse_memory)(text))


# --- the model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTShape:
    """The flags of Megatron-LM's GPT model that decide its parameter count."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    padded_vocab_size: int
    max_position_embeddings: int
    position_embedding_type: str = "learned_absolute"
    normalization: str = "LayerNorm"
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padded vocabulary: a multiple of ``divisible_by x tp``."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def gpt_param_count(shape: GPTShape) -> int:
    """The parameters of megatron-core's GPTModel, layer by layer (Megatron-LM's
    theoretical-memory formula counts the same tensors, with LayerNorm norms throughout)."""
    h = shape.hidden_size
    norm = h if shape.normalization == "RMSNorm" else 2 * h
    bias = shape.add_bias_linear
    q = shape.num_attention_heads * shape.kv_channels
    kv = shape.num_query_groups * shape.kv_channels
    fc1 = shape.ffn_hidden_size * (2 if shape.swiglu else 1)
    attention = h * (q + 2 * kv) + q * h + bias * (q + 2 * kv + h)
    mlp = h * fc1 + shape.ffn_hidden_size * h + bias * (fc1 + h)
    layer = 2 * norm + attention + mlp
    embedding = shape.padded_vocab_size * h
    position = shape.max_position_embeddings * h
    return (
        embedding * (2 if shape.untie_embeddings_and_output_weights else 1)
        + (position if shape.position_embedding_type == "learned_absolute" else 0)
        + shape.num_layers * layer
        + norm
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's model flags that decide the parameter count, with its names and defaults
    (tests/test_plan.py checks them against the reference trainer's parser)."""
    g = parser.add_argument_group("model (Megatron-LM flags; instead of --params)")
    positive = _positive(int)
    for flag in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads",
                 "kv-channels", "seq-length", "max-position-embeddings", "vocab-size"):
        g.add_argument(f"--{flag}", type=positive, default=None, metavar="N")
    g.add_argument("--num-query-groups", type=positive, default=1, metavar="N")
    g.add_argument("--make-vocab-size-divisible-by", type=positive, default=128, metavar="N")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--tokenizer-type", default=None,
                   help="NullTokenizer adds its end-of-document token to --vocab-size")


def read_preset(name: str) -> list[str]:
    """The MODEL_ARGS flags of a preset: a name in configs/models/ (``tiny``, ``llama2-7b``)
    or a path to such a file; ``${VAR:-default}`` takes the default. Raises ValueError."""
    path = Path(name) if name.endswith(".sh") else PRESET_DIR / f"{name}.sh"
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.sh"))
        raise ValueError(f"{name!r}: no preset there; allowed: {', '.join(known) or 'none'}, "
                         "or a path to a .sh file defining MODEL_ARGS")
    match = re.search(r'^MODEL_ARGS="(.*?)"', path.read_text(encoding="utf-8"), re.S | re.M)
    if not match:
        raise ValueError(f"{path}: defines no MODEL_ARGS")
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", match.group(1))
    if "$" in text:
        raise ValueError(f"{path}: MODEL_ARGS uses a variable without a default")
    return shlex.split(text)


def model_shape(args: argparse.Namespace) -> GPTShape:
    """Megatron-LM's derived model values (ffn size, kv channels, query groups, padded
    vocabulary) from the flags. Raises ValueError naming a missing flag."""
    missing = [f"--{name.replace('_', '-')}" for name in
               ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
               if getattr(args, name) is None]
    max_pos = args.max_position_embeddings or args.seq_length
    if args.position_embedding_type == "learned_absolute" and max_pos is None:
        missing.append("--seq-length (or --max-position-embeddings)")
    if missing:
        raise ValueError(f"the model needs {', '.join(missing)} (or give --params)")
    h = args.hidden_size
    ffn = args.ffn_hidden_size
    if ffn is None:
        ffn = int((4 * h * 2 / 3) / 64) * 64 if args.swiglu else 4 * h
    vocab = args.vocab_size + (1 if args.tokenizer_type == "NullTokenizer" else 0)
    heads = args.num_attention_heads
    return GPTShape(
        num_layers=args.num_layers,
        hidden_size=h,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels or h // heads,
        padded_vocab_size=padded_vocab_size(
            vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
        ),
        max_position_embeddings=max_pos or 0,
        position_embedding_type=args.position_embedding_type,
        normalization=args.normalization,
        swiglu=args.swiglu,
        add_bias_linear=args.add_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
    )


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    cp: int
    dp: int

    @property
    def d(self) -> int:
        """The group the distributed optimizer shards over: DP x CP."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


def _plugin_args(layout: Layout, n: int, no_replica: bool) -> argparse.Namespace:
    import tempfile

    return argparse.Namespace(  # a --save the plugin can write: the layout is what is checked
        save=tempfile.gettempdir(), enable_high_availability=True,
        use_distributed_optimizer=True, bf16=True,
        distributed_optimizer_no_replica=no_replica, optimizer_replica_num=n,
        data_parallel_size=layout.dp, context_parallel_size=layout.cp,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        world_size=layout.world_size,
    )


def check_replicas(layout: Layout, n: int, no_replica: bool = False) -> str | None:
    """None if the plugin accepts N replicas (or no-replica) on this layout, else its
    refusal (`mindspeed_tft.arguments.validate_tft_args`, with an empty environment)."""
    from mindspeed_tft.arguments import TFTArgumentError, validate_tft_args

    try:
        validate_tft_args(_plugin_args(layout, n, no_replica), environ={})
    except TFTArgumentError as error:
        return str(error)
    return None


def admissible_replicas(layout: Layout) -> list[int]:
    """Every N >= 2 the plugin accepts on this layout, ascending."""
    return [n for n in range(2, layout.d + 1)
            if layout.d % n == 0 and check_replicas(layout, n) is None]


@dataclass(frozen=True)
class Budget:
    """The device memory and the share of it the activations are assumed to take."""

    device_bytes: int | None
    activation_bytes: float

    def fits(self, state_bytes: float) -> bool | None:
        if self.device_bytes is None:
            return None
        return state_bytes + self.activation_bytes <= self.device_bytes


@dataclass(frozen=True)
class FaultCost:
    """Seconds of work a fault loses (None where --save-interval / --step-time are missing)."""

    save_interval: int | None
    step_time: float | None
    reload_time: float

    def lost_steps(self, replicas: bool) -> float | None:
        """At most the step in flight with replicas; else half a save interval on average."""
        if replicas:
            return 1.0
        return None if self.save_interval is None else self.save_interval / 2

    def lost_seconds(self, replicas: bool) -> float | None:
        steps = self.lost_steps(replicas)
        if steps is None or self.step_time is None:
            return None
        return steps * self.step_time + (0.0 if replicas else self.reload_time)


def plan_rows(params_per_device: float, layout: Layout, grad: str, budget: Budget,
              cost: FaultCost, replicas: Sequence[int]) -> list[dict[str, Any]]:
    """One row per setting: native, no-replica (where HA is possible), each N in replicas."""
    settings = [("native", 1, "off")]
    if check_replicas(layout, 1, no_replica=True) is None:
        settings.append(("no-replica", 1, "no-replica"))
    settings += [(f"N={n}", n, "on") for n in replicas]
    rows = []
    for name, n, ha in settings:
        per_param = bytes_per_param(layout.d, n, grad, ha)
        state = per_param * params_per_device
        rows.append({
            "row": name, "d": layout.d, "n": n, "grad": grad, "ha": ha,
            "formula": per_param,
            "state_gib": state / GIB,
            "total_gib": (state + budget.activation_bytes) / GIB,
            "fits": budget.fits(state),
            "lost_steps": cost.lost_steps(ha == "on"),
            "lost_seconds": cost.lost_seconds(ha == "on"),
        })
    return rows


def recommend(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest N that fits; else no-replica or native if they fit."""
    fitting = [r for r in rows if r["fits"]]
    replicated = [r for r in fitting if r["ha"] == "on"]
    if replicated:
        best = max(replicated, key=lambda r: r["n"])
        flags = f"--enable-high-availability --optimizer-replica-num {best['n']}"
        return {"row": best["row"], "n": best["n"], "flags": flags}
    by_name = {r["row"]: r for r in fitting}
    if "no-replica" in by_name:
        flags = "--enable-high-availability --distributed-optimizer-no-replica"
        return {"row": "no-replica", "n": 1, "flags": flags}
    if "native" in by_name:
        return {"row": "native", "n": 1, "flags": ""}
    return {"row": None, "n": None, "flags": None}


# --- the command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tft-plan", allow_abbrev=False,
        description=__doc__.splitlines()[0],
        epilog="Formula, assumptions: the module docstring (mindspeed_tft/tools/plan.py).",
    )
    size = parser.add_argument_group("model size")
    size.add_argument("--params", type=_argtype(parse_count), default=None,
                      help="parameter count: 7e9, 7B, 350M (instead of the model flags)")
    size.add_argument("--preset", default=None,
                      help="a model preset: tiny, llama2-7b (configs/models/NAME.sh) or a .sh "
                      "path; flags given here override it")
    add_model_arguments(parser)
    par = parser.add_argument_group("parallelism")
    positive = _positive(int)
    par.add_argument("--tensor-model-parallel-size", type=positive, default=1, metavar="TP")
    par.add_argument("--pipeline-model-parallel-size", type=positive, default=1, metavar="PP")
    par.add_argument("--context-parallel-size", type=positive, default=1, metavar="CP")
    par.add_argument("--data-parallel-size", type=positive, default=None, metavar="DP")
    par.add_argument("--world-size", type=positive, default=None,
                     help="instead of --data-parallel-size: DP = world / (TP x PP x CP)")
    opt = parser.add_argument_group("optimizer and device")
    opt.add_argument("--grad-dtype", choices=GRADS, default="fp32",
                     help="bf16: --grad-reduce-in-bf16; fp32 (default): Megatron-LM's default "
                     "with --bf16")
    opt.add_argument("--optimizer-replica-num", type=positive, action="append", default=None,
                     metavar="N", help="only this N (repeatable; default: every admissible N)")
    opt.add_argument("--device-memory", type=_argtype(parse_memory), default=None,
                     help="memory of one device: 64GiB, 80GB")
    opt.add_argument("--activation-memory", type=_activation_memory, default=None,
                     help="kept for activations and workspace: a size (8GiB) or a share of "
                     f"--device-memory (default {DEFAULT_ACTIVATION_SHARE * 100:g}%%)")
    lost = parser.add_argument_group("work lost per fault")
    lost.add_argument("--save-interval", type=positive, default=None, metavar="STEPS",
                      help="periodic checkpoint every STEPS iterations")
    lost.add_argument("--step-time", type=_positive(float), default=None, metavar="S",
                      help="seconds per training step")
    lost.add_argument("--reload-time", type=_non_negative_float, default=0.0, metavar="S",
                      help="seconds to restart and load the checkpoint (default 0: not counted)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Layout:
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    dp = args.data_parallel_size
    if args.world_size is not None:
        if args.world_size % (tp * pp * cp):
            parser.error(f"--world-size {args.world_size} is not a multiple of TP x PP x CP = "
                         f"{tp * pp * cp}; allowed: a multiple of it")
        from_world = args.world_size // (tp * pp * cp)
        if dp is not None and dp != from_world:
            parser.error(f"--data-parallel-size {dp} contradicts --world-size "
                         f"{args.world_size} (DP = {from_world}); allowed: one of the two")
        dp = from_world
    if dp is None:
        parser.error("the layout needs --data-parallel-size or --world-size")
    return Layout(tp=tp, pp=pp, cp=cp, dp=dp)


def megatron_defaults() -> dict[str, Any]:
    """Megatron-LM's defaults of the model flags (`add_model_arguments`)."""
    model = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_model_arguments(model)
    return vars(model.parse_args([]))


def _flag(dest: str) -> str:
    return "--disable-bias-linear" if dest == "add_bias_linear" else f"--{dest.replace('_', '-')}"


def _params(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.params is not None:
        given = [_flag(f) for f, default in megatron_defaults().items()
                 if getattr(args, f) != default]
        if given or args.preset:
            parser.error(f"--params {args.params} and {' '.join(given) or '--preset'}: give "
                         "the parameter count or the model flags / --preset, not both")
        return args.params
    try:
        return gpt_param_count(model_shape(args))
    except ValueError as error:
        parser.error(str(error))


def _budget(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Budget:
    kind, value = args.activation_memory or ("share", DEFAULT_ACTIVATION_SHARE)
    device = args.device_memory
    if device is None:
        if args.activation_memory is not None:
            parser.error("--activation-memory needs --device-memory")
        return Budget(None, 0.0)
    return Budget(device, device * value if kind == "share" else value)


def _replicas(parser: argparse.ArgumentParser, args: argparse.Namespace,
              layout: Layout) -> list[int]:
    if args.optimizer_replica_num is None:
        return admissible_replicas(layout)
    for n in args.optimizer_replica_num:
        refusal = check_replicas(layout, n)
        if refusal is not None:
            parser.error(refusal)
    return sorted({n for n in args.optimizer_replica_num if n > 1})


def parse(
    argv: Sequence[str] | None = None, model_args: Sequence[str] = ()
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the parsed command line (usage errors exit 2).

    The model flags of ``--preset``, then of ``model_args`` (Megatron-LM flags, a whole
    training command line is fine: the other flags are ignored), become defaults that
    ``argv`` overrides.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    tokens = list(model_args)
    if args.preset:
        try:
            tokens = read_preset(args.preset) + tokens
        except ValueError as error:
            parser.error(f"--preset {error}")
    if tokens:
        model = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        add_model_arguments(model)
        parser.set_defaults(**vars(model.parse_known_args(tokens)[0]))
        args = parser.parse_args(argv)
    return parser, args


def make_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The plan of parsed arguments (see `parse`) as one JSON-able object; a usage error
    (inadmissible N, missing flag) exits 2 through ``parser``."""
    layout = _layout(parser, args)
    params = _params(parser, args)
    budget = _budget(parser, args)
    replicas = _replicas(parser, args, layout)
    cost = FaultCost(args.save_interval, args.step_time, args.reload_time)
    per_device = params / (layout.tp * layout.pp)
    rows = plan_rows(per_device, layout, args.grad_dtype, budget, cost, replicas)
    ha_refusal = check_replicas(layout, 1, no_replica=True)
    return {
        "params": params,
        "params_per_device": per_device,
        "layout": {**asdict(layout), "d": layout.d, "world_size": layout.world_size},
        "grad": args.grad_dtype,
        "device_memory_bytes": budget.device_bytes,
        "activation_memory_bytes": budget.activation_bytes,
        "save_interval": args.save_interval,
        "step_time": args.step_time,
        "reload_time": args.reload_time,
        "rows": rows,
        "recommendation": recommend(rows) if budget.device_bytes is not None else None,
        "high_availability_refused": ha_refusal,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(plan: dict[str, Any]) -> str:
    """The plan as a table with its assumptions."""
    lay = plan["layout"]
    lines = [
        f"model: {plan['params']:,} parameters; TP {lay['tp']} x PP {lay['pp']} x CP "
        f"{lay['cp']} x DP {lay['dp']} = {lay['world_size']} device(s); "
        f"{plan['params_per_device']:,.0f} parameters per device (params / (TP x PP)); "
        f"d = DP x CP = {lay['d']}; {plan['grad']} grads",
        "",
        f"{'row':<10} {'HA':<10} {'N':>3} {'bytes/param':>11} {'state GiB':>10} "
        f"{'+act GiB':>9} {'fits':>4} {'lost/fault':>15}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in plan["rows"]:
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "no")
        lost = "-"
        if r["lost_steps"] is not None:
            lost = f"{'<=' if r['ha'] == 'on' else '~'}{r['lost_steps']:g} st"
            if r["lost_seconds"] is not None:
                lost += f" {r['lost_seconds']:.0f} s"
        total = None if r["fits"] is None else r["total_gib"]
        lines.append(
            f"{r['row']:<10} {r['ha']:<10} {r['n']:>3} {r['formula']:>11.4f} "
            f"{r['state_gib']:>10.2f} {_fmt(total, '.2f'):>9} {fits:>4} {lost:>15}"
        )
    lines += ["", *_notes(plan)]
    return "\n".join(lines)


def _notes(plan: dict[str, Any]) -> list[str]:
    notes = [
        "bytes/param: bf16 grads 4 + 16 N / d, fp32 grads 6 + 12 N / d (bf16 params, Adam, "
        "distributed optimizer); state: params, grads and optimizer state only.",
    ]
    if plan["device_memory_bytes"] is not None:
        notes.append(
            f"fits: state + {plan['activation_memory_bytes'] / GIB:.2f} GiB kept for "
            f"activations and workspace (--activation-memory) <= "
            f"{plan['device_memory_bytes'] / GIB:.2f} GiB per device."
        )
    interval = plan["save_interval"]
    notes.append(
        "lost/fault (st: steps): without replicas back to the last periodic checkpoint, half "
        f"the save interval ({interval if interval is not None else '--save-interval'} steps) "
        f"on average, plus a {plan['reload_time']:g} s reload (--reload-time); with replicas "
        "at most the step in flight."
    )
    if plan["high_availability_refused"]:
        notes.append(f"high availability refused: {plan['high_availability_refused']}")
    rec = plan["recommendation"]
    if rec is not None:
        if rec["row"] is None:
            notes.append("recommendation: nothing fits; raise TP / PP or the device memory.")
        elif rec["row"] == "native":
            notes.append("recommendation: only native fits (no high availability).")
        else:
            notes.append(f"recommendation: {rec['row']} ({rec['flags']})")
    return notes


def main(argv: Sequence[str] | None = None) -> int:
    parser, args = parse(argv)
    plan = make_plan(parser, args)
    print(json.dumps(plan) if args.json else render(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
