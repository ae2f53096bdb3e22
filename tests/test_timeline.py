"""The goodput accounting (mindspeed_tft/goodput.py, tools/report.py) and the timeline picture
(mindspeed_tft/tools/timeline.py) on hand-written event streams with known times: a run without a
fault, a repair that recomputes steps, a dump that ends the job, and matplotlib missing.
A real faulty job's timeline is checked in tests/test_worker_reboot.py
(`test_no_replica_reloads_the_periodic_checkpoint`, via `check_timeline`)."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mindspeed_tft.tools import report
from mindspeed_tft.tools.timeline import DPI, PLOT_HINT, Timeline

T0 = 1_000_000.0


def _event(t: float, name: str, rank: int = -1, **fields: Any) -> dict[str, Any]:
    return {"time": T0 + t, "event": name, "rank": rank, **fields}


def _state(t: float, state: str, prev: str | None) -> dict[str, Any]:
    return _event(t, "state", state=state, prev=prev, reason="")


def _iteration(t: float, i: int, rank: int) -> dict[str, Any]:
    return _event(t, "iteration", rank, iteration=i, loss=10.0 - i, grad_norm=1.0, lr=1e-3,
                  consumed_samples=16 * i)


def _action(t: float, name: str) -> dict[str, Any]:
    return _event(t, "action", action=name, targets=2, incident=1)


def _finish(t: float, code: int = 0, reason: str = "training finished") -> list[dict[str, Any]]:
    return [_state(t, "EXIT", "NORMAL"), _event(t, "exit", code=code, reason=reason),
            _state(t, "FINAL", "EXIT")]


def no_fault() -> list[dict[str, Any]]:
    """2 ranks, 4 steps of 1 s, a checkpoint save of 0.5 s after step 3."""
    return [_state(0.0, "INIT", None), _state(1.0, "NORMAL", "INIT"),
            _iteration(3.0, 1, 1), _iteration(4.0, 2, 1), _iteration(5.0, 3, 1),
            _event(5.5, "checkpoint_saved", 0, iteration=3, path="ckpt", seconds=0.5),
            _iteration(6.5, 4, 1), *_finish(7.0)]


def recompute() -> list[dict[str, Any]]:
    """Rank 1 killed after step 4; the repair rolls back to step 2 (the checkpoint): steps
    3 and 4 run again."""
    return [
        _state(0.0, "INIT", None), _state(1.0, "NORMAL", "INIT"),
        _iteration(2.0, 1, 1), _iteration(3.0, 2, 1),
        _event(3.5, "checkpoint_saved", 0, iteration=2, path="ckpt", seconds=0.5),
        _iteration(4.5, 3, 1), _iteration(5.5, 4, 1),
        _event(6.0, "fault_injected", 1, kind="kill", step=4, phase="forward", target=None,
               item=1),
        _event(6.5, "fault_detected", ranks=[1], kind="lost", message="killed", incident=1),
        _state(6.5, "ABNORMAL", "NORMAL"), _action(6.5, "stop"),
        _event(7.0, "strategy", strategy="recover", lock_step=4, source="checkpoint",
               faults={"1": "lost"}, incident=1),
        _state(7.0, "ENV_CLEAR", "ABNORMAL"), _action(7.0, "clean"),
        _event(7.2, "worker_restarted", 1, pid=10, new_pid=11, returncode=-9, restart=1,
               rank_restarts=1, spare=False, node=0),
        _state(8.0, "REPAIR", "ENV_CLEAR"), _action(8.0, "repair"), _action(9.0, "rollback"),
        _event(9.1, "rolled_back", 0, iteration=2), _event(9.1, "rolled_back", 1, iteration=2),
        _event(9.2, "repaired", strategy="recover", lock_step=4, step=2, incident=1),
        _state(9.5, "NORMAL", "REPAIR"),
        _iteration(10.5, 3, 1), _iteration(11.5, 4, 1), _iteration(12.5, 5, 1),
        *_finish(13.0),
    ]


def dump_ends_the_job() -> list[dict[str, Any]]:
    """4 ranks; a UCE on rank 2 (not injected) after step 3; the dump ends the job (75)."""
    return [
        _state(0.0, "INIT", None), _state(1.0, "NORMAL", "INIT"),
        _iteration(2.0, 1, 3), _iteration(3.0, 2, 3), _iteration(4.0, 3, 3),
        _event(4.6, "fault_detected", ranks=[2], kind="uce", message="UCE ERROR", incident=1),
        _state(4.6, "ABNORMAL", "NORMAL"), _action(4.6, "stop"),
        _event(4.8, "strategy", strategy="dump", lock_step=3, source="replica",
               faults={"2": "uce"}, incident=1),
        _state(4.8, "DUMP", "ABNORMAL"), _action(4.8, "dump"),
        _event(5.0, "dump_written", 0, iteration=3, shard="0", assembled=True),
        _action(5.3, "rename"), _event(5.35, "dump_saved", 0, iteration=3, path="ckpt"),
        _state(5.4, "EXIT", "DUMP"),
        _event(5.4, "exit", code=75, reason="dying-gasp checkpoint saved", incident=1),
        _state(5.4, "FINAL", "EXIT"),
    ]


# -- goodput --------------------------------------------------------------------------------
def test_goodput_without_a_fault():
    run = report.goodput(no_fault())
    # steps 2-4 measured (1 s each, step 4 from the end of the save); step 1 has no start
    # event: the median step, so 4 s of 7 s
    assert [s.measured for s in run.steps] == [False, True, True, True]
    assert [round(s.seconds, 6) for s in run.steps] == [1.0] * 4
    assert run.productive == pytest.approx(4.0) and run.wall == pytest.approx(7.0)
    assert run.ratio == pytest.approx(4 / 7) and run.training_ratio == pytest.approx(4 / 5)
    assert run.startup == pytest.approx(2.0) and run.checkpoints == pytest.approx(0.5)
    assert run.other == pytest.approx(0.5) and run.incidents == []


def test_goodput_leaves_out_steps_recomputed_after_a_rollback():
    run = report.goodput(recompute())
    assert [(s.iteration, s.counts, s.undone_by) for s in run.steps] == [
        (1, True, None), (2, True, None), (3, False, 1), (4, False, 1),
        (3, True, None), (4, True, None), (5, True, None)]
    # step 3 after the repair starts where the incident ends (9.5 s), not at the fault
    assert [round(s.seconds, 6) for s in run.steps] == [1.0] * 7
    assert run.counted == 5 and run.productive == pytest.approx(5.0)
    assert run.ratio == pytest.approx(5 / 13)
    (cost,) = run.incidents
    assert {k: round(v, 6) for k, v in cost.parts.items()} == {
        "interrupted step": 0.5, "detect": 0.5, "stop": 0.5, "clean": 1.0, "repair": 1.0,
        "rollback": 0.5, "discarded steps": 2.0}
    assert list(cost.parts) == ["interrupted step", "detect", "stop", "clean", "repair",
                                "rollback", "discarded steps"]
    assert cost.discarded_steps == 2 and cost.total == pytest.approx(6.0)
    # everything is accounted for: 5 + 1 (start-up) + 0.5 (save) + 6 + 0.5 (shutdown) = 13
    assert run.startup == pytest.approx(1.0) and run.checkpoints == pytest.approx(0.5)
    assert run.other == pytest.approx(0.5)


def test_steps_undone_by_a_rollback_do_not_count_even_if_never_recomputed():
    events = recompute()
    events = [*[e for e in events if e["time"] <= T0 + 9.5], *_finish(10.0)]
    run = report.goodput(events)
    assert [(s.iteration, s.counts, s.undone_by) for s in run.steps] == [
        (1, True, None), (2, True, None), (3, False, 1), (4, False, 1)]
    assert run.productive == pytest.approx(2.0)
    assert run.incidents[0].parts["discarded steps"] == pytest.approx(2.0)


def test_phases_last_until_the_next_one_and_the_report_says_so():
    (incident,) = report.incidents(dump_ends_the_job())
    assert [(p.name, round(p.seconds, 6)) for p in report.phases(incident)] == [
        ("stop", 0.2), ("dump", 0.5), ("rename", 0.1), ("exit", 0.0)]
    lines = report.describe_incident(incident)
    assert any("phase stop (2 ranks) (0.20 s)" in line for line in lines)
    assert any("phase dump (2 ranks) (0.50 s)" in line for line in lines)
    (cost,) = report.goodput(dump_ends_the_job()).incidents
    # not injected: the fault is its detection, which ends the interrupted step
    assert cost.parts["interrupted step"] == pytest.approx(0.6)
    assert cost.parts["detect"] == pytest.approx(0.0)
    text = "\n".join(report.describe_goodput(report.goodput(recompute())))
    assert "goodput 0.385: 5.00 s of productive step time in 13.00 s of wall time" in text
    assert ("incident 1 cost 6.00 s: interrupted step 0.50 s, detect 0.50 s, stop 0.50 s, "
            "clean 1.00 s, repair 1.00 s, rollback 0.50 s, discarded steps 2.00 s (2 steps)"
            in text)


# -- the picture ----------------------------------------------------------------------------
def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def _in_figure(timeline: Timeline, artists: list[Any]) -> bool:
    return bool(artists) and all(a.axes in timeline.figure.axes for a in artists)


def check_timeline(events: list[dict[str, Any]], path: Path,
                   compare: list[dict[str, Any]] | None = None) -> Timeline:
    """Draw and save `events`' timeline and check it: the PNG's pixel size is the figure's,
    each phase of each incident has a bar as long as the phase and a band, labelled with its
    duration; every fault is marked; one lane line per rank; restarted ranks marked."""
    timeline = report.timeline(events, compare)
    timeline.save(path)
    width, height = timeline.figure.get_size_inches() * DPI
    assert png_size(path) == (round(width), round(height))
    assert png_size(path)[0] == 1100
    run = report.goodput(events)
    for cost in run.incidents:
        for phase in cost.phases:
            spans = {(a.axes, round(a.get_x(), 6), round(a.get_width(), 6))
                     for a in timeline.bands[phase.name]}
            # a bar in the incident's panel, from the fault; a band in both whole-run panels
            zoom = timeline.panels.get(f"incident {cost.number}")
            at = round(phase.start - cost.fault, 6), round(phase.start - run.start, 6)
            width = round(phase.seconds, 6)
            assert zoom is None or (zoom, at[0], width) in spans, phase
            if width > 0:
                for panel in ("lanes", "loss"):
                    assert (timeline.panels[panel], at[1], width) in spans, (panel, phase)
            labels = [t.get_text() for t in timeline.labels[phase.name]]
            assert zoom is None or f"{phase.seconds:.2f} s" in labels
    if run.incidents:
        assert len(timeline.fault_marks) >= 2 * len(run.incidents)  # lanes and loss panels
        assert _in_figure(timeline, timeline.fault_marks)
    ranks = {r for e in events if e["event"] == "iteration" for r in range(e["rank"] + 1)}
    assert set(timeline.rank_lines) >= ranks
    assert _in_figure(timeline, list(timeline.rank_lines.values()))
    restarted = {e["rank"] for e in events if e["event"] == "worker_restarted"}
    assert set(timeline.restart_marks) == restarted
    assert ("fault-free" in timeline.loss_lines) == bool(compare)
    return timeline


def test_timeline_without_a_fault(tmp_path):
    timeline = check_timeline(no_fault(), tmp_path / "t.png")
    assert timeline.bands == {} and timeline.fault_marks == []
    assert sorted(timeline.rank_lines) == [0, 1]
    assert len(timeline.figure.axes) == 4  # no incident panel
    xs = timeline.rank_lines[0].get_xdata()
    assert (min(xs), max(xs)) == (3.0, 6.5)


def test_timeline_of_a_repair_shows_the_gap_and_the_rollback(tmp_path):
    events = recompute()
    timeline = check_timeline(events, tmp_path / "t.png", compare=no_fault())
    assert set(timeline.bands) == {"interrupted step", "detect", "stop", "clean", "repair",
                                   "rollback"}
    survivor, restarted = (list(zip(timeline.rank_lines[r].get_xdata(),
                                    timeline.rank_lines[r].get_ydata(), strict=True))
                           for r in (0, 1))
    # the survivor's lane is flat through the incident; the restarted rank's has a gap
    assert not any(math.isnan(y) for _, y in survivor)
    assert [x for x, y in restarted if math.isnan(y)] == [6.0]
    # both lanes drop back to step 2 where the repair ends (9.5 s)
    lane_of = {x: y for x, y in survivor}
    assert lane_of[9.5] < lane_of[5.5]
    assert "2 discarded steps" in timeline.panels["incident 1"].get_title()


def test_timeline_of_a_dump_that_ends_the_job(tmp_path):
    timeline = check_timeline(dump_ends_the_job(), tmp_path / "t.png")
    assert set(timeline.bands) == {"interrupted step", "detect", "stop", "dump", "rename",
                                   "exit"}
    assert sorted(timeline.rank_lines) == [0, 1, 2, 3]
    for line in timeline.rank_lines.values():  # every lane ends at the fault
        assert max(line.get_xdata()) == pytest.approx(4.6)


def test_svg_and_other_formats(tmp_path):
    timeline = report.timeline(no_fault())
    assert timeline.save(tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="png or .svg"):
        timeline.save(tmp_path / "t.pdf")


def test_report_cli_plots_and_accounts(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    path.write_text("".join(f"{json.dumps(e)}\n" for e in recompute()))
    assert report.main([str(path), "--plot", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "goodput 0.385" in out and f"timeline: {tmp_path / 't.png'}" in out
    assert png_size(tmp_path / "t.png")[0] == 1100
    with pytest.raises(SystemExit):
        report.main([str(path), "--plot", str(tmp_path / "t.pdf")])


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install mindspeed-tft\[plot\]"):
        report.timeline(no_fault())
    path = tmp_path / "events.jsonl"
    path.write_text("".join(f"{json.dumps(e)}\n" for e in no_fault()))
    assert report.main([str(path), "--plot", str(tmp_path / "t.png")]) == 2
    captured = capsys.readouterr()
    assert "goodput" in captured.out and PLOT_HINT in captured.err
    assert not (tmp_path / "t.png").exists()


def test_the_report_and_timeline_modules_do_not_import_matplotlib():
    code = ("import sys, mindspeed_tft.report, mindspeed_tft.tools.timeline; "
            "sys.exit(any(m.startswith('matplotlib') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
