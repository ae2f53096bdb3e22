"""An incident's stages follow one table (`controller/phases.NEXT`), and architecture.md draws
exactly that table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mindspeed_tft.control.controller.flow import Incident, IncidentFlow
from mindspeed_tft.control.controller.phases import (
    FINAL_STAGES,
    NEXT,
    IllegalPhaseTransition,
    PhaseEnd,
    Stage,
    diagram,
    next_stage,
)
from mindspeed_tft.features import Features

from .test_core import Harness

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_architecture_md_draws_the_table() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = re.search(r"```mermaid\n%% phases:[^\n]*\n(.*?)\n```", text, re.S)
    assert block is not None, "architecture.md has no phases diagram"
    assert block.group(1) == diagram(), (
        "architecture.md's phases diagram is not phases.NEXT; put this there:\n" + diagram())


def test_every_stage_is_reached_and_every_stage_but_the_last_ones_leads_on() -> None:
    reached = {Stage.HOLD} | set(NEXT.values())
    assert reached == set(Stage)
    leaving = {stage for stage, _ in NEXT}
    assert leaving == set(Stage) - FINAL_STAGES


def test_every_stage_runs_into_an_ending() -> None:
    """From every stage, the table leads to RESUME or an exit (no cycle without a phase
    that waits on ranks, no dead end)."""
    for start in Stage:
        seen, frontier = set(), {start}
        while frontier:
            stage = frontier.pop()
            seen.add(stage)
            frontier |= {after for (s, _), after in NEXT.items() if s is stage} - seen
        assert seen & FINAL_STAGES, start


def test_a_pair_the_table_lacks_is_a_bug_named() -> None:
    assert next_stage(Stage.CLEAN, PhaseEnd.AWAIT) is Stage.REJOIN
    with pytest.raises(IllegalPhaseTransition, match="hold ended shrink: no stage follows"):
        next_stage(Stage.HOLD, PhaseEnd.SHRINK)


def test_the_flow_has_an_end_for_every_phase_and_a_start_for_every_stage_after_one() -> None:
    h = Harness(2, Features(high_availability=True))
    flow = IncidentFlow(h.core.incidents, Incident(1, 0.0))
    phases = {stage for stage, _ in NEXT} - {Stage.REPAIR_FAILED}
    assert set(flow._ends) == phases
    assert set(flow._starts) == set(NEXT.values())
