"""Nodes whose launcher fell silent: a host lost or cut off, decided without waiting for
restarts that nobody can make.

Under `tft-run` on several nodes a lost worker is restarted by its own node's launcher; when
that launcher is silent too (node 0's launcher reads every other launcher's heartbeat in the
job's store and reports `NodeSilent`), waiting for a restart is waiting in vain. What
happens then is decided here, once per silence, and said in one `node_silent` event
(`decision`):

- `wait`: `TFT_NODE_REPLACEMENT_WAIT` > 0 (Kubernetes recreates the pod): the node's ranks
  wait that long for a replacement launcher, then get no replacement;
- `dump` / `shrink` (with elastic training): no launcher is coming; the node's ranks get no
  replacement at once, so the incident that loses them (under way, or opened later) dumps or
  shrinks instead of waiting for their restart.

A launcher heard again (`NodeBack`: the link returned, or a replacement launcher took the
node over) cancels the wait and the refusal for what comes after; an incident that already
decided keeps its decision. `Nodes` is part of the controller's core; it returns the ranks it
gives up on, and why, and the core tells the incident under way
(`IncidentFlow.no_replacement`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...records import CONTROLLER_RANK
from .context import Context


@dataclass
class _Silence:
    ranks: tuple[int, ...]
    #: when its wait for a replacement launcher ends (loop clock; inf: decided)
    deadline: float


class Nodes:
    """Silent launchers and the ranks that get no replacement (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.silent: dict[int, _Silence] = {}
        #: rank -> why it gets no replacement (every incident opened starts knowing it)
        self.unreplaceable: dict[int, str] = {}

    def on_silent(self, node: int, ranks: tuple[int, ...], silent_for: float,
                  now: float) -> list[tuple[int, str]]:
        """Node `node`'s launcher has not been heard for `silent_for` seconds. Returns the
        ranks given up now (no replacement is coming for them) and why."""
        if node in self.silent:
            return []
        wait = self.config.node_replacement_wait
        decision = "wait" if wait > 0 else ("shrink" if self.ctx.features.elastic else "dump")
        self.ctx.emit("node_silent", CONTROLLER_RANK, node=node, ranks=list(ranks),
                       silent_s=round(silent_for, 3), decision=decision,
                       **({"wait_s": wait} if wait > 0 else {}))
        self.silent[node] = _Silence(ranks, now + wait if wait > 0 else math.inf)
        if wait > 0:
            return []
        return self._give_up(node, f"node {node}'s launcher silent for {silent_for:.1f}s")

    def on_back(self, node: int) -> None:
        """Node `node`'s launcher is heard again."""
        silence = self.silent.pop(node, None)
        if silence is None:
            return
        for rank in silence.ranks:
            self.unreplaceable.pop(rank, None)
        self.ctx.emit("node_back", CONTROLLER_RANK, node=node, ranks=list(silence.ranks))

    def tick(self, now: float) -> list[tuple[int, str]]:
        """The ranks whose wait for a replacement launcher ended now, and why."""
        given_up = []
        for node, silence in self.silent.items():
            if now >= silence.deadline:
                silence.deadline = math.inf
                given_up += self._give_up(node, f"no replacement launcher for node {node} "
                                                f"within {self.config.node_replacement_wait:g}s")
        return given_up

    def next_deadline(self) -> float:
        return min((s.deadline for s in self.silent.values()), default=math.inf)

    def _give_up(self, node: int, why: str) -> list[tuple[int, str]]:
        ranks = self.silent[node].ranks
        for rank in ranks:
            self.unreplaceable[rank] = why
        return [(rank, why) for rank in ranks]
