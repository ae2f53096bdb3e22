"""What the controller knows to grow a shrunk job back (elastic training, scale-out).

A shrink (`IncidentFlow._start_scale_in`) leaves whole data-parallel (DP) replicas out of the
job. When their ranks come back (a replacement launcher for the lost node, a restarted
worker), they register again; the controller grows the job at the next step boundary once
the returning ranks complete one or more DP replicas and the larger DP size still splits the
global batch evenly (`mindspeed_tft.elastic.even_dp_size`, megatron-core's condition).

What that takes:
- `home`: the DP index each control-plane rank had at launch (from its first registration's
  replica layout), which names the DP replica a rank belongs to whatever the job's size;
- `micro_batches`: the global batch in micro-batches (global batch / micro batch), which the
  ranks report when the job shrinks (the controller does not parse the trainer's flags).

A grown world keeps every current replica and adds returning ones in ascending DP index,
up to the largest even size; its ranks keep their order (sorted control-plane ranks), which
is megatron-core's rank layout at the new DP size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...elastic import even_dp_size


class Elasticity:
    """Home replicas and the global batch in micro-batches (see the module docstring)."""

    def __init__(self) -> None:
        self.home: dict[int, int] = {}
        self.micro_batches: int | None = None

    def note_registration(self, rank: int, replica: dict[str, Any] | None) -> None:
        """Record `rank`'s DP index at launch (its first registration only)."""
        dense = (replica or {}).get("dense")
        if rank not in self.home and isinstance(dense, dict) and "dp_index" in dense:
            self.home[rank] = int(dense["dp_index"])

    def grown_world(self, members: Iterable[int],
                    returning: Iterable[int]) -> tuple[list[int], int] | None:
        """(ranks of the larger world, ascending; its DP size), or None when the returning
        ranks complete no replica the global batch can be split over as well."""
        members, returning = set(members), set(returning)
        if self.micro_batches is None or not returning:
            return None
        replicas: dict[int, set[int]] = {}
        for rank, dp_index in self.home.items():
            replicas.setdefault(dp_index, set()).add(rank)
        current = {self.home[r] for r in members if r in self.home}
        present = members | returning
        extra = [d for d in sorted(replicas) if d not in current and replicas[d] <= present]
        size = even_dp_size(self.micro_batches, 1, len(current) + len(extra))
        if size <= len(current):
            return None
        kept = current | set(extra[:size - len(current)])
        return sorted(r for r in present if self.home.get(r) in kept), size
