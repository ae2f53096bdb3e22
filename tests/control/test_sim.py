"""The control plane under deterministic simulation (`mindspeed_tft.control.sim`).

A fixed set of seeds runs the real controller core with simulated ranks, launchers and
network through faults of every kind at every point of a step (one inside the optimizer
update) and of a recovery (during shrinks, grows and dumps), in DP, TP and PP layouts with and
without elastic training; every invariant holds after every event and every run ends no
worse than the oracle says its schedule owes. The set reaches each state of `MUST_REACH`.

Mutation checks (one-line changes kept out of the repository; each applied alone to the
code as of issue 60's last commit, the set fails with this many seeds, the first named):

- processor-core-update-start-status (the core records "updated" at `UpdateStart`):
  18 seeds, W=8 seed 28;
- processor-core-hold-status (a hold answers "updated" while updating): 14 seeds, W=8 seed 85;
- processor-core-stop-catch-up (a stop lets no rank behind its lock step catch up):
  15 seeds, W=8 seed 85;
- strategy-dump-holder (`dump_holders` takes the first registered holder, healthy or not):
  571 seeds, W=8 seed 0;
- strategy-repair-holder (`repair_payloads` sends from the first other holder, healthy or
  not): 10 seeds, W=8 seed 139;
- undo-51229db-unreplaceable-awaited (the undone fix of 51229db): 1 seed, W=8 seed 221;
- undo-8d83d6d-left-ranks-in-repair (the undone fix of 8d83d6d): 22 seeds, W=8 seed 45.

Not caught: processor-core-stop-result-status (a stop answers "updated" while updating): a
rank still inside its update when the stop's wait ends is one whose own fault stopped it
there, and the controller counts it faulty whatever status it gives.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from mindspeed_tft.control.sim import cli, oracle
from mindspeed_tft.control.sim.invariants import Checker, Violation
from mindspeed_tft.control.sim.job import SimJob
from mindspeed_tft.control.sim.oracle import Ending
from mindspeed_tft.control.sim.schedule import Fault, Layout, Schedule, generate, shrink

#: (world size, seeds): the CI seed set
SEED_SET = [(8, range(0, 1500)), (4, range(0, 400)), (16, range(0, 200))]
#: the states real jobs reach that the set must reach (`reached`), per world size
MUST_REACH = {8: {"inside", "shrink", "grow", "dump", "dump_after_shrink"},
              4: {"inside", "dump", "shrink", "dump_after_shrink"},
              16: {"inside"}}


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def reached(job: SimJob) -> set[str]:
    """Which of the states real jobs reach a run reached: a fault inside the optimizer update
    (inside), during a dump (dump), during an incident that shrinks the job (shrink) or grows
    it back (grow), and a dump after a shrink (dump_after_shrink)."""
    out = {"inside" for f in job.struck if f.point == "inside"}
    out |= {"dump" for f in job.struck if f.point in ("dump", "rename")}
    spans: list[tuple[float, float, str]] = []
    begun: tuple[float, str] | None = None
    shrunk = False
    for e in job.events:
        name = e["event"]
        if name in ("fault_detected", "scale_out_started") and begun is None:
            begun = (e["time"], "grow" if name == "scale_out_started" else "fault")
        ends = name in ("repaired", "scale_in", "scale_out", "exit") or (
            name == "strategy" and e["strategy"] == "none")
        if begun is not None and ends:
            spans.append((begun[0], e["time"], "shrink" if name == "scale_in" else begun[1]))
            begun = None
        shrunk = shrunk or name == "scale_in"
        if name == "exit" and e["code"] == 75 and shrunk:
            out.add("dump_after_shrink")
    for t in job.struck_at:
        out |= {kind for a, b, kind in spans if a <= t <= b and kind in ("shrink", "grow")}
    return out


@pytest.mark.parametrize(("world", "seeds"), SEED_SET, ids=[f"w{w}" for w, _ in SEED_SET])
def test_the_seed_set_holds_every_invariant(world: int, seeds: range) -> None:
    failures = {}
    ends: Counter[str] = Counter()
    for seed in seeds:
        job = SimJob(generate(seed, world))
        outcome = job.run()
        if outcome.failure is not None:
            failures[seed] = outcome.failure
        ends.update(e["event"] for e in job.events
                    if e["event"] in ("repaired", "scale_in", "repair_failed"))
        ends[f"exit {outcome.exit_code}"] += 1
        ends.update(reached(job))
    assert failures == {}
    # the set reaches every ending: repairs, shrinks, dumps, failed repairs, clean ends
    assert ends["repaired"] and ends["exit 0"] and ends["exit 75"] and ends["repair_failed"]
    assert ends["scale_in"]
    assert {state for state in MUST_REACH[world] if not ends[state]} == set(), ends


def test_a_seed_replays_exactly() -> None:
    schedule = generate(11, 8)
    runs = [SimJob(schedule) for _ in range(2)]
    outcomes = [job.run() for job in runs]
    assert outcomes[0] == outcomes[1]
    assert runs[0].events == runs[1].events and len(runs[0].events) > 4
    assert Schedule.from_text(schedule.to_text()) == schedule


def test_a_uce_is_repaired_in_place_and_training_ends() -> None:
    """DP4 with two optimizer replicas: a UCE in rank 1's optimizer state at step 3 is
    repaired from its replica; training resumes at the lock step and ends with code 0."""
    schedule = Schedule(1, Layout(dp=4, replicas=2), (Fault("uce", 1, "update", 3,
                                                            detail="optimizer"),),
                        ("restart",), steps=6)
    job = SimJob(schedule)
    outcome = job.run()
    assert outcome.failure is None and outcome.exit_code == 0
    (strategy,) = [e for e in job.events if e["event"] == "strategy"]
    assert strategy["strategy"] == "retry" and strategy["faults"] == {"1": "uce"}
    (repaired,) = [e for e in job.events if e["event"] == "repaired"]
    assert repaired["lock_step"] == repaired["step"] == strategy["lock_step"]


def test_a_lost_rank_without_replacement_shrinks_an_elastic_job() -> None:
    """DP4 elastic, launcher policy never: a killed rank's replica leaves, the job goes on
    at DP 2 (the batch of 8 micro-batches splits evenly over 2) and finishes."""
    schedule = Schedule(2, Layout(dp=4, replicas=2, elastic=True, micro_batches=8,
                                  ranks_per_node=4),
                        (Fault("kill", 3, "start", 3),), ("never",), steps=6)
    job = SimJob(schedule)
    outcome = job.run()
    assert outcome.failure is None and outcome.exit_code == 0
    (scale_in,) = [e for e in job.events if e["event"] == "scale_in"]
    assert scale_in["dp_size"] == 2 and scale_in["lost"] == [3]
    assert 3 in scale_in["left"] and len(scale_in["ranks"]) == 2


def test_a_failure_is_shrunk_and_printed_with_its_replay_command(capsys) -> None:
    """A failing predicate (here: any schedule with a kill) shrinks to one kill; the
    replay command prints the same schedule back."""
    schedule = generate(5, 8)
    schedule = Schedule(schedule.seed, schedule.layout,
                        (Fault("comm", 1, "start", 2), Fault("kill", 2, "start", 3),
                         Fault("uce", 0, "end", 4, detail="param")),
                        tuple("late" for _ in schedule.replacement), steps=9)
    small = shrink(schedule, lambda s: any(f.kind == "kill" for f in s.faults))
    assert small.faults == (Fault("kill", 2, "start", 3),)
    assert small.steps == 5 and set(small.replacement) == {"restart"}
    assert cli.main(["--replay", small.to_text()]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == small.to_text()
    summary = json.loads(out[-1])
    assert summary["schedules"] == 1 and summary["failures"] == 0


def test_the_last_line_is_the_json_summary(capsys) -> None:
    assert cli.main(["--seeds", "30", "--world", "8"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["schedules"] == 30 and summary["failures"] == 0
    assert summary["per_minute"] > 0 and summary["world"] == 8


def test_a_backup_that_takes_charge_numbers_its_orders_anew() -> None:
    """tft-sim --seed 480 --world 8: a kill repaired by the active controller (its orders
    are actions 1..6), then node 0 lost with the active controller: the backup takes charge
    dump-only. Its orders used to start at action 1 again, which the surviving ranks had
    seen and dropped as repeats (the hold timed out, every rank was taken for hung); now an
    epoch's action ids start at epoch << 40 and the survivors dump the lock step."""
    schedule = Schedule(480, Layout(dp=4, tp=2, replicas=4, micro_batches=12, ranks_per_node=4,
                                    checkpoint_every=2, hbm_repair=False, backup=True),
                        (Fault("kill", 6, "end", 2), Fault("node", 0, "start", 4)),
                        ("late", "warm"), steps=5, delay=(0.0005, 0.02))
    job = SimJob(schedule)
    outcome = job.run()
    assert outcome.failure is None and outcome.exit_code == 75
    (takeover,) = [e for e in job.events if e["event"] == "controller_takeover"]
    assert takeover["dump_only"] and takeover["epoch"] == 1
    assert [e["strategy"] for e in job.events if e["event"] == "strategy"] == ["recover", "dump"]
    assert not [e for e in job.events if e["event"] == "fault_detected" and e["kind"] == "hang"]


def test_a_rank_that_left_earlier_and_comes_back_is_no_part_of_a_later_repair() -> None:
    """tft-sim --seed 10904 --world 8: elastic DP4 x PP2; rank 5 hangs, is rebooted and its
    replacement comes too late: the job shrinks without its replica ([1, 5]). During the
    next incident (a UCE on rank 0, repaired in place) that late replacement registers: it
    waits outside the job. It used to be counted as a rank the repair needed ("ranks [5] are
    gone"), and the repairable UCE ended in a dump."""
    schedule = Schedule(10904, Layout(dp=4, pp=2, replicas=4, elastic=True, micro_batches=4,
                                      ranks_per_node=4, checkpoint_every=3, backup=True),
                        (Fault("uce", 0, "update", 7, detail="activation"),
                         Fault("hang", 5, "end", 6)),
                        ("restart", "late"), steps=9, delay=(0.0005, 0.3))
    job = SimJob(schedule)
    outcome = job.run()
    assert outcome.failure is None, outcome.failure
    assert [e["event"] for e in job.events if e["event"] in ("scale_in", "repaired")] == [
        "scale_in", "repaired"]
    assert not [e for e in job.events if e["event"] == "repair_failed"]


def test_ranks_left_without_a_controller_exit_with_77_and_send_no_answer() -> None:
    """tft-sim --seed 11275 --world 8: the launchers of nodes 0 and 1 die (both controllers
    with them) during a recovery. The survivors hear no active controller for
    `controller_lost_timeout` and order themselves to exit (order id -1): that exit's result
    went to `ResultMessage.to_wire`, which refuses id -1, and raised (in the processor: on its
    order thread; here: out of the run). Now nobody is answered and every survivor exits 77."""
    schedule = Schedule(11275, Layout(dp=4, tp=2, replicas=2, micro_batches=12,
                                      ranks_per_node=2, checkpoint_every=2, backup=True),
                        (Fault("comm", 1, "update", 5), Fault("launcher", 0, "update", 4),
                         Fault("launcher", 1, "stop", 4)),
                        ("late", "warm", "late", "restart"), steps=7, delay=(0.0005, 0.002))
    job = SimJob(schedule)
    codes: dict[int, int] = {}
    exited = job.exited
    job.exited = lambda proc, code: (codes.__setitem__(proc.rank, code), exited(proc, code))
    outcome = job.run()
    assert outcome.failure is None, outcome.failure
    assert codes == {0: -9, 1: -9, 2: -9, 3: -9, 4: 77, 5: 77, 6: 77, 7: 77}


# -- the outcome oracle ------------------------------------------------------------------------
@pytest.mark.parametrize(("layout", "faults", "replacement", "ending"), [
    # a UCE in the optimizer state, HBM repair on, two copies: repaired from the other copy
    (Layout(dp=4, replicas=2), [Fault("uce", 1, "inside", 3, detail="optimizer")],
     ("restart",), Ending.REPAIRED),
    # the same without HBM repair: dumped, from the other copy of rank 1's shard
    (Layout(dp=4, replicas=2, hbm_repair=False),
     [Fault("uce", 1, "end", 3, detail="optimizer")], ("restart",), Ending.DUMPED),
    # one copy only, and it is damaged: nothing can save it
    (Layout(dp=4, replicas=1, hbm_repair=False), [Fault("uce", 1, "end", 3, detail="param")],
     ("restart",), Ending.LOST),
    # a UCE in the gradients spares the optimizer state: its own rank dumps it
    (Layout(dp=4, replicas=1, hbm_repair=False), [Fault("uce", 1, "end", 3, detail="grad")],
     ("restart",), Ending.DUMPED),
    # a lost rank without a replacement in an elastic job: it shrinks
    (Layout(dp=4, replicas=2, elastic=True), [Fault("kill", 3, "start", 3)], ("never",),
     Ending.SHRUNK),
    # ... and then an unknown error in the shrunk job: a dump after the shrink
    (Layout(dp=4, replicas=2, elastic=True),
     [Fault("kill", 3, "start", 3), Fault("raise", 0, "end", 5)], ("never",), Ending.DUMPED),
    # a kill during a repair's clean (a cascading fault): the dump, of the other copies
    (Layout(dp=4, replicas=2), [Fault("uce", 1, "end", 3, detail="param"),
                                Fault("kill", 2, "clean")], ("restart",), Ending.DUMPED),
    # a fault before the first update completed: nothing to repair or dump
    (Layout(dp=2, replicas=2), [Fault("comm", 1, "allreduce", 1)], ("restart",), Ending.LOST),
])
def test_the_oracle_owes(layout: Layout, faults: list[Fault], replacement: tuple[str, ...],
                         ending: Ending) -> None:
    schedule = Schedule(1, layout, tuple(faults), replacement, steps=8)
    assert oracle.owed(schedule, faults).ending is ending


def test_a_run_that_ends_worse_than_owed_fails() -> None:
    """The oracle owes a repair (a UCE in one of two copies, HBM repair on): a run whose
    controller ends it with a dump instead fails as a liveness failure, one that loses the
    state as a correctness failure."""
    schedule = Schedule(1, Layout(dp=4, replicas=2), (Fault("uce", 1, "end", 3,
                                                            detail="optimizer"),),
                        ("restart",), steps=6)
    owed = oracle.owed(schedule, list(schedule.faults))
    for got, kind in ((oracle.Ending.DUMPED, "liveness"), (oracle.Ending.LOST, "correctness")):
        checker = Checker(4, 8, 75, 6)
        with pytest.raises(Violation) as caught:
            checker.judge(owed, got, {})
        assert str(caught.value) == (f"{kind}: ended {got.name}, owed REPAIRED "
                                     "(every fault repaired)")
