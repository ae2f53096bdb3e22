"""What one simulated run does: its layout, its network and its faults, from a seed.

A `Schedule` is plain data (printable, replayable): `generate(seed, world)` draws one from
the seed alone; `shrink` removes faults and simplifies what is left while a predicate (the
run still fails) holds, so a failure is reported with the shortest schedule that shows it.
`to_text` / `from_text` give the schedule a one-line form for the replay command.

Faults (`Fault.kind`): kill (SIGKILL of a worker), uce (an uncorrectable memory error on
`target`: param, optimizer, grad or activation: the names the plugin reports), comm (a communication error), hang (the
training thread stops), raise (an unknown error), node (a whole node lost: its workers and
its launcher), launcher (a node's launcher dies; its workers die with it), net (the rank's
connection is cut and comes back). Each fires at a point (`Fault.point`): of a step (start,
allreduce, update: before the optimizer update, inside: half-way through it, end) at
`Fault.step`, or of a recovery: when its rank receives an order
(hold, stop, clean, repair, rollback, resume, dump, rename, scale_in, scale_out), of the
`Fault.incident`-th incident (faults during recovery, several at once).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

KINDS = ("kill", "uce", "comm", "hang", "raise", "node", "launcher", "net")
UCE_TARGETS = ("param", "optimizer", "grad", "activation")
STEP_POINTS = ("start", "allreduce", "update", "inside", "end")
ORDER_POINTS = ("hold", "stop", "clean", "repair", "rollback", "resume", "dump", "rename",
                "scale_in", "scale_out")
#: how a launcher replaces a lost worker: restart, a warm spare (fast), late (after the
#: incident stopped waiting), never (it reports that it will not)
REPLACEMENTS = ("restart", "warm", "late", "never")


@dataclass(frozen=True)
class Layout:
    """The job's parallel layout: W = dp x tp x pp ranks, `ranks_per_node` to a node."""

    dp: int
    tp: int = 1
    pp: int = 1
    #: optimizer replicas (N copies of the optimizer state over DP); 1: a single copy
    replicas: int = 2
    elastic: bool = False
    #: the global batch in micro-batches (elastic training splits it over DP)
    micro_batches: int = 8
    ranks_per_node: int = 4
    #: periodic checkpoints (a repair without replicas reloads the last one)
    checkpoint_every: int = 4
    hbm_repair: bool = True
    worker_reboot: bool = True
    #: a backup controller in node 1's launcher (the active one is in node 0's)
    backup: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def nodes(self) -> int:
        return -(-self.world // self.ranks_per_node)


@dataclass(frozen=True)
class Fault:
    """One fault (see the module docstring)."""

    kind: str
    #: a rank (kill, uce, comm, hang, raise, net) or a node (node, launcher)
    target: int
    point: str = "start"
    step: int = 3
    #: for an order point: which incident's order (1: the first incident)
    incident: int = 1
    #: uce: the memory it hit
    detail: str = ""


@dataclass(frozen=True)
class Schedule:
    """One run's whole input besides the code (see the module docstring)."""

    seed: int
    layout: Layout
    faults: tuple[Fault, ...] = ()
    #: per node: how its launcher replaces a lost worker (`REPLACEMENTS`)
    replacement: tuple[str, ...] = ()
    steps: int = 8
    delay: tuple[float, float] = (0.0005, 0.02)
    extra: dict[str, float] = field(default_factory=dict)

    def to_text(self) -> str:
        data = asdict(self)
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        data = json.loads(text)
        return cls(seed=data["seed"], layout=Layout(**data["layout"]),
                   faults=tuple(Fault(**f) for f in data["faults"]),
                   replacement=tuple(data["replacement"]), steps=data["steps"],
                   delay=tuple(data["delay"]), extra=dict(data.get("extra", {})))


def _layout(rng: random.Random, world: int) -> Layout:
    shapes = [(dp, tp, pp) for dp in range(1, world + 1) for tp in (1, 2, 4) for pp in (1, 2)
              if dp * tp * pp == world]
    dp, tp, pp = rng.choice(shapes)
    replicas = rng.choice([n for n in (1, 2, dp) if dp % n == 0])
    elastic = rng.random() < 0.4 and dp > 1
    micro = dp * rng.choice((1, 2, 3))
    per_node = rng.choice([n for n in (1, 2, 4, 8) if n <= world])
    return Layout(dp, tp, pp, replicas, elastic, micro, ranks_per_node=per_node,
                  checkpoint_every=rng.choice((2, 3, 4)),
                  hbm_repair=rng.random() < 0.8, worker_reboot=rng.random() < 0.8)


def _fault(rng: random.Random, layout: Layout, steps: int) -> Fault:
    kind = rng.choice(KINDS)
    target = rng.randrange(layout.nodes if kind in ("node", "launcher") else layout.world)
    if rng.random() < 0.6:
        point, incident = rng.choice(STEP_POINTS), 1
    else:
        point, incident = rng.choice(ORDER_POINTS), rng.choice((1, 1, 2))
    return Fault(kind, target, point, rng.randint(2, steps - 1), incident,
                 rng.choice(UCE_TARGETS) if kind == "uce" else "")


def generate(seed: int, world: int) -> Schedule:
    """The schedule of `seed` at world size `world` (a function of both alone)."""
    rng = random.Random(seed * 1_000_003 + world)
    layout = _layout(rng, world)
    steps = rng.randint(5, 9)
    count = rng.choice((0, 1, 1, 1, 2, 2, 3))
    faults = tuple(_fault(rng, layout, steps) for _ in range(count))
    replacement = tuple(rng.choice(REPLACEMENTS) for _ in range(layout.nodes))
    hi = rng.choice((0.002, 0.02, 0.3))
    # drawn last: the schedules of the seeds before backups were simulated stay the same
    layout = replace(layout, backup=layout.nodes >= 2 and rng.random() < 0.3)
    schedule = Schedule(seed, layout, faults, replacement, steps, (0.0005, hi))
    if layout.elastic and rng.random() < 0.5:
        schedule = _scaling(rng, schedule)
    if schedule.layout.replicas >= 3 and rng.random() < 0.3:
        schedule = _two_holders(rng, schedule)
    return schedule


def holders(layout: Layout, rank: int) -> list[int]:
    """The ranks holding the same optimizer shard as `rank` (itself included), in DP order."""
    tp_i, dp_i, pp_i = rank % layout.tp, (rank // layout.tp) % layout.dp, rank // (
        layout.tp * layout.dp)
    chunk = layout.dp // layout.replicas
    return [tp_i + layout.tp * (d + layout.dp * pp_i) for d in range(layout.dp)
            if d % chunk == dp_i % chunk]


def _two_holders(rng: random.Random, s: Schedule) -> Schedule:
    """Two holders of one shard hit in one step (each to be repaired from a third copy)."""
    first = rng.randrange(s.layout.world)
    second = rng.choice([h for h in holders(s.layout, first) if h != first])
    step, point = rng.randint(2, s.steps - 1), rng.choice(STEP_POINTS)
    pair = tuple(Fault(kind, rank, point, step, 1, rng.choice(("param", "optimizer"))
                       if kind == "uce" else "")
                 for rank, kind in ((first, rng.choice(("uce", "kill"))),
                                    (second, rng.choice(("uce", "kill")))))
    return replace(s, faults=pair + s.faults[:1])


def _scaling(rng: random.Random, s: Schedule) -> Schedule:
    """An elastic job driven where real ones go: a rank lost without a replacement in time
    (the job shrinks), maybe its late replacement (the job grows back: slower steps, so that
    it comes while the job still trains), then faults during the shrink, the grow or their
    dumps, or a later fault the shrunk job can only dump for."""
    lay = s.layout
    if rng.random() < 0.5:  # one rank a replica: the job can grow back without its peers
        lay = replace(lay, dp=lay.world, tp=1, pp=1, micro_batches=lay.world * (lay.world - 1),
                      replicas=rng.choice([n for n in (1, 2, lay.world) if lay.world % n == 0]))
    victim = rng.randrange(lay.world)
    node = victim // lay.ranks_per_node
    policy = rng.choice(("late", "late", "never"))
    replacement = tuple(policy if n == node else r for n, r in enumerate(s.replacement))
    first = Fault("kill", victim, rng.choice(STEP_POINTS), rng.randint(2, 3))
    extra = dict(s.extra)
    if policy == "late":
        extra["compute"] = 1.0
    faults = [first]
    for _ in range(rng.choice((1, 1, 2))):
        target = rng.randrange(lay.world)
        kind = rng.choice(("kill", "raise", "comm", "uce", "hang"))
        if rng.random() < 0.5:  # during the shrink (incident 1) or the grow (incident 2)
            point = rng.choice(("dump", "rename", "scale_in", "scale_out", "hold", "stop"))
            incident = 2 if point == "scale_out" else rng.choice((1, 2))
            faults.append(Fault(kind, target, point, first.step, incident,
                                rng.choice(UCE_TARGETS) if kind == "uce" else ""))
        else:  # in the shrunk (or grown) job
            faults.append(Fault(kind, target, rng.choice(STEP_POINTS),
                                rng.randint(first.step + 1, s.steps - 1), 1,
                                rng.choice(UCE_TARGETS) if kind == "uce" else ""))
    return replace(s, layout=replace(lay, worker_reboot=True), faults=tuple(faults),
                   replacement=replacement, extra=extra)


def shrink(schedule: Schedule, fails: Callable[[Schedule], bool],
           budget: int = 200) -> Schedule:
    """The smallest schedule derived from `schedule` (fewer faults, fewer steps, plain
    replacements and network) for which `fails` still holds."""
    best = schedule
    tries = 0
    changed = True
    while changed and tries < budget:
        changed = False
        for candidate in _simpler(best):
            tries += 1
            if fails(candidate):
                best, changed = candidate, True
                break
            if tries >= budget:
                break
    return best


def _simpler(s: Schedule) -> list[Schedule]:
    out = [replace(s, faults=s.faults[:i] + s.faults[i + 1:]) for i in range(len(s.faults))]
    if s.delay != (0.0005, 0.002):
        out.append(replace(s, delay=(0.0005, 0.002)))
    plain = tuple("restart" for _ in s.replacement)
    if s.replacement != plain:
        out += [replace(s, replacement=s.replacement[:i] + ("restart",) + s.replacement[i + 1:])
                for i, r in enumerate(s.replacement) if r != "restart"]
    last = max((f.step for f in s.faults), default=0)
    if s.steps > last + 2:
        out.append(replace(s, steps=last + 2))
    return out
