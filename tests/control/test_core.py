"""The controller's sans-I/O core (`control.controller.core`) and an `IncidentFlow` built by
hand: inputs in, frames and events out, no socket, thread or clock."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from mindspeed_tft.control.controller.core import ControllerCore
from mindspeed_tft.control.controller.flow import Incident, IncidentFlow
from mindspeed_tft.control.controller.inputs import (
    Frame,
    Input,
    NodeBack,
    NodeSilent,
    NoReplacement,
    Pause,
    ProcessExit,
    Resume,
    Start,
    Tick,
)
from mindspeed_tft.control.controller.states import State
from mindspeed_tft.control.sim.job import sim_config
from mindspeed_tft.control.wire.classify import FaultKind
from mindspeed_tft.control.wire.protocol import MsgType, decode, encode
from mindspeed_tft.features import Features


class Harness:
    """A core of `world` ranks, registered at step `step`, and what it sent (`token`: the
    job's token, which the registrations carry)."""

    def __init__(self, world: int, features: Features, step: int = 1,
                 copies: int = 1, token: str | None = None) -> None:
        self.token = token
        self.core = ControllerCore(world, sim_config().replace(job_token=token),
                                   features=features)
        self.now = 0.0
        self.seq = {r: 0 for r in range(world)}
        self.sent: list[tuple[int, str, dict[str, Any]]] = []
        self.events: list[dict[str, Any]] = []
        self.feed(Start())
        for r in range(world):
            chunk = world // copies  # `copies` replicas of the optimizer state
            replica = {"dense": {"dp_index": r, "dp_size": world, "replica_num": copies,
                                 "shard": r % chunk,
                                 "holders": [r % chunk + k * chunk for k in range(copies)]}}
            self.frame(r, MsgType.REGISTER, {"world_size": world, "pid": 100 + r, "host": "h",
                                             "replica": replica, "step": step,
                                             "status": "updated",
                                             **({"token": token} if token else {})})

    def feed(self, event: Input) -> None:
        self.now += 0.01
        out = self.core.handle(event, self.now)
        self.absorb(out)

    def call(self, fn: Any, *args: Any) -> None:
        """Drive a part of the core by hand (a flow built by a test), then take what it
        decided, as `handle` would."""
        self.now += 0.01
        self.core.out.at(self.now)
        fn(*args)
        self.absorb(self.core.out.take())

    def absorb(self, out: Any) -> None:
        self.events += out.events
        for identity, frame in out.frames:
            msg = decode(frame)
            self.sent.append((int(identity.decode()), msg.type, msg.payload))

    def frame(self, rank: int, mtype: str, payload: dict[str, Any]) -> None:
        self.seq[rank] += 1
        self.feed(Frame(str(rank).encode(), encode(mtype, rank, self.seq[rank], payload)))

    def exited(self, rank: int, pid: int, code: int, key: str | None = None,
               **payload: Any) -> None:
        """Another node's launcher reports `rank`'s process `pid` ended (its own connection,
        under CURVE with `key`; the job's token unless `payload` says otherwise)."""
        payload = {"pid": pid, "code": code, "token": self.token, **payload}
        frame = encode(MsgType.EXITED, rank, 1, {k: v for k, v in payload.items()
                                                 if v is not None})
        self.feed(Frame(b"launcher", frame, key))

    def orders(self, name: str) -> list[tuple[int, dict[str, Any]]]:
        return [(r, p) for r, t, p in self.sent if t == MsgType.ACTION and p["name"] == name]

    def answer(self, name: str, result: dict[str, Any] | None = None,
               fail: int | None = None) -> None:
        for rank, order in self.orders(name):
            ok = rank != fail
            self.frame(rank, MsgType.RESULT, {"id": order["id"], "action": name, "ok": ok,
                                              "result": dict(result or {}),
                                              **({} if ok else {"error": "broken"})})

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_registration_and_operator_commands_are_inputs_and_outputs() -> None:
    h = Harness(2, Features(high_availability=True))
    assert h.core.state is State.NORMAL
    assert [(r, t) for r, t, _ in h.sent] == [(0, MsgType.REGISTERED), (1, MsgType.REGISTERED)]
    assert [e["state"] for e in h.named("state")] == ["INIT", "NORMAL"]
    h.feed(Pause())
    h.feed(Resume())
    assert [r for r, _ in h.orders("pause")] == [0, 1] == [r for r, _ in h.orders("resume")]
    assert h.core.state is State.NORMAL and h.core.next_deadline() > h.now


def test_an_incident_flow_built_by_hand_repairs_a_uce() -> None:
    """An IncidentFlow on the core's Incidents: hold, stop, strategy retry, clean, repair,
    rollback, resume; every order goes to both ranks, the events name its phases."""
    h = Harness(2, Features(high_availability=True, hbm_repair=True), copies=2)
    flow = IncidentFlow(h.core.incidents, Incident(1, h.now))
    h.core.incidents.flow = flow
    h.call(flow.begin, 1, FaultKind.UCE, "UCE ERROR")
    h.answer("hold", {"step": 1, "status": "updated"})
    h.answer("stop", {"step": 1, "status": "updated", "parked": True})
    (strategy,) = h.named("strategy")
    assert strategy["strategy"] == "retry" and strategy["lock_step"] == 1
    h.answer("clean")
    h.answer("repair")
    h.answer("rollback", {"step": 1})
    assert [e["action"] for e in h.named("action")] == ["hold", "stop", "clean", "repair",
                                                       "rollback"]
    assert h.named("repaired")[0]["step"] == 1 and flow.done
    assert [r for r, _ in h.orders("resume")] == [0, 1] and h.core.state is State.NORMAL


def test_a_failed_rollback_after_a_checkpoint_reload_dumps_nothing() -> None:
    """tft-sim --seed 656 --world 8: without optimizer replicas a repair reloads the last
    checkpoint; when the rollback then fails, the ranks no longer hold the lock step, so
    the fallback must not write a dump of it (it did, from the checkpoint's state): the job
    exits with the failure code and no dump order goes out."""
    h = Harness(2, Features(high_availability=True, hbm_repair=True, no_replica=True), step=5)
    h.frame(1, MsgType.REPORT, {"kind": "comm", "message": "HCCL", "step": 5,
                                "status": "updated"})
    h.answer("hold", {"step": 5, "status": "updated"})
    h.answer("stop", {"step": 5, "status": "updated", "parked": True})
    assert h.named("strategy")[0]["source"] == "checkpoint"
    h.answer("clean")
    h.answer("repair", {"step": 4})
    h.answer("rollback", {"step": 4}, fail=1)
    assert h.orders("dump") == [] and h.core.exit_code == 1
    assert "no longer hold the lock step" in h.named("exit")[0]["reason"]


def test_no_replacement_for_a_lost_rank_ends_its_rejoin_round() -> None:
    h = Harness(2, Features(high_availability=True, worker_reboot=True))
    h.feed(ProcessExit(1, -9, source="test"))
    h.answer("hold", {"step": 1, "status": "updated"})
    h.answer("stop", {"step": 1, "status": "updated", "parked": True})
    h.answer("clean")
    assert h.core.flow is not None and h.core.flow.phase is not None
    assert h.core.flow.phase.name == "rejoin"
    # the snapshot says what the incident waits for, until when, and why
    view = h.core.incidents.view()
    assert view is not None and view["phase"] == "rejoin" and view["waiting_for"] == [1]
    assert view["until"] == h.core.flow.phase.deadline
    assert view["why"] == {"stage": "rejoin", "code": "restarts",
                           "text": "waiting for restarted workers", "ranks": [1]}
    h.feed(NoReplacement(1, "budget"))
    assert h.core.state in (State.EXIT, State.FINAL, State.DUMP)
    (failed,) = h.named("repair_failed")
    assert failed["why"] == "no_restart" and failed["ranks_of_reason"] == [1]
    assert failed["reason"] == "restarted workers did not register: rank 1: no replacement " \
                               "(budget)"


def test_a_result_that_does_not_match_its_order_fails_the_order_naming_the_field() -> None:
    """Results are read typed (`wire.results.ResultMessage`): a rollback result without its
    `step` is a failed rollback, and the failure says which field was wrong."""
    h = Harness(2, Features(high_availability=True, hbm_repair=True), copies=2)
    h.frame(1, MsgType.REPORT, {"kind": "uce", "message": "UCE ERROR", "step": 1,
                                "status": "updated", "detail": {"target": "params"}})
    h.answer("hold", {"step": 1, "status": "updated"})
    h.answer("stop", {"step": 1, "status": "updated", "parked": True})
    h.answer("clean")
    h.answer("repair", {"received": 1})
    h.answer("rollback", {"iteration": 1})
    assert h.named("repaired") == []
    (failed,) = h.named("repair_failed")
    assert "rollback failed" in failed["reason"]
    assert "ResultError: rollback result: unknown key 'iteration'" in failed["reason"] or (
        "ResultError: rollback result: missing 'step'" in failed["reason"])


def test_a_hold_result_carries_the_step_the_lock_step_is_taken_from() -> None:
    """The typed hold and stop results set the rank's step and data status."""
    h = Harness(2, Features(high_availability=True, hbm_repair=True), copies=2, step=3)
    h.frame(0, MsgType.REPORT, {"kind": "uce", "message": "UCE ERROR", "step": 3,
                                "status": "updated", "detail": {"target": "params"}})
    h.answer("hold", {"step": 3, "status": "updating"})
    h.answer("stop", {"step": 4, "status": "updated", "parked": True})
    (strategy,) = h.named("strategy")
    assert strategy["lock_step"] == 4
    assert [h.core.table.get(r).step for r in (0, 1)] == [4, 4]


REFUSED = "exited with code 1: its launcher restarts only a worker killed by a signal or exiting with 76"


def test_an_exit_its_launcher_will_not_restart_dumps_at_once() -> None:
    """The launcher's exit report says it will not restart the rank: the incident decides a
    dump at once, the `strategy` event's reason naming the refusal; no clean, no rejoin."""
    h = Harness(4, Features(high_availability=True, worker_reboot=True), copies=2)
    h.feed(ProcessExit(1, 1, REFUSED))
    h.answer("hold", {"step": 1, "status": "updated"})
    h.answer("stop", {"step": 1, "status": "updated", "parked": True})
    (strategy,) = h.named("strategy")
    assert (strategy["strategy"], strategy["reason"]) == ("dump", f"no replacement: rank 1: "
                                                                  f"{REFUSED}")
    assert h.orders("clean") == [] and [r for r, _ in h.orders("dump")] == [0, 2, 3]


def test_under_elastic_training_an_exit_not_restarted_shrinks_without_a_wait() -> None:
    """The same refusal with elastic training: recover, whose rejoin round fails for the
    rank at once (no wait for its replacement), and the job shrinks from a dump."""
    h = Harness(4, Features(high_availability=True, worker_reboot=True, elastic=True),
                copies=2)
    h.feed(ProcessExit(1, 1, REFUSED))
    h.answer("hold", {"step": 1, "status": "updated"})
    h.answer("stop", {"step": 1, "status": "updated", "parked": True})
    (strategy,) = h.named("strategy")
    assert strategy["strategy"] == "recover" and "reason" not in strategy
    h.answer("clean")
    flow = h.core.flow
    assert flow is not None and flow.scaling.shrinking == {1}
    assert h.core.state is State.DUMP and [r for r, _ in h.orders("dump")] == [0, 2, 3]


def _lose_node_1(h: Harness) -> None:
    """Ranks 2 and 3 (node 1) fall silent: their processes are gone with their launcher."""
    h.feed(ProcessExit(2, -9))
    h.feed(ProcessExit(3, -9))
    h.answer("hold", {"step": 1, "status": "updated"})
    h.answer("stop", {"step": 1, "status": "updated", "parked": True})


def test_a_silent_node_s_ranks_get_no_replacement_the_incident_dumps_at_once() -> None:
    """Node 1's launcher silent (no replacement launcher coming, the default): the event says
    `dump`, and the incident that loses its ranks dumps without a rejoin round."""
    h = Harness(4, Features(high_availability=True, worker_reboot=True), copies=2)
    h.feed(NodeSilent(1, (2, 3), 5.0))
    (silent,) = h.named("node_silent")
    assert (silent["node"], silent["ranks"], silent["decision"]) == (1, [2, 3], "dump")
    _lose_node_1(h)
    (strategy,) = h.named("strategy")
    assert strategy["strategy"] == "dump"
    assert strategy["reason"].startswith("no replacement: rank 2: node 1's launcher silent")
    assert h.orders("clean") == [] and [r for r, _ in h.orders("dump")] == [0, 1]
    assert h.orders("dump")[0][1]["payload"]["claim"] == "controller - epoch 0"


def test_a_node_silent_after_the_decision_ends_the_rejoin_round_at_once() -> None:
    """The ranks were lost first (recover, waiting for restarts); the launcher's silence then
    ends the rejoin round at once: the dump instead of a wait of TFT_REPLACEMENT_WAIT."""
    h = Harness(4, Features(high_availability=True, worker_reboot=True), copies=2)
    _lose_node_1(h)
    assert [e["strategy"] for e in h.named("strategy")] == ["recover"]
    h.answer("clean")
    assert h.core.flow is not None and h.core.flow.phase.name == "rejoin"
    h.feed(NodeSilent(1, (2, 3), 5.0))
    (failed,) = h.named("repair_failed")
    assert "rank 2: no replacement (node 1's launcher silent for 5.0s)" in failed["reason"]
    assert h.core.state is State.DUMP


def test_under_elastic_training_a_silent_node_shrinks_the_job() -> None:
    h = Harness(4, Features(high_availability=True, worker_reboot=True, elastic=True),
                copies=2)
    h.feed(NodeSilent(1, (2, 3), 5.0))
    assert h.named("node_silent")[0]["decision"] == "shrink"
    _lose_node_1(h)
    h.answer("clean")
    flow = h.core.flow
    assert flow is not None and flow.scaling.shrinking == {2, 3}
    assert h.core.state is State.DUMP


def test_a_replacement_launcher_is_waited_for_then_given_up_on() -> None:
    """TFT_NODE_REPLACEMENT_WAIT: the ranks wait that long for a replacement launcher (the
    event says `wait`); a launcher heard again cancels it, a second silence past the wait
    refuses their replacement."""
    h = Harness(4, Features(high_availability=True, worker_reboot=True), copies=2)
    h.core.config = h.core.nodes.config = h.core.config.replace(node_replacement_wait=30.0)
    h.feed(NodeSilent(1, (2, 3), 5.0))
    (silent,) = h.named("node_silent")
    assert (silent["decision"], silent["wait_s"]) == ("wait", 30.0)
    assert h.core.next_deadline() <= h.now + 30.0
    h.feed(NodeBack(1))
    assert [e["node"] for e in h.named("node_back")] == [1]
    assert h.core.nodes.unreplaceable == {}
    h.feed(NodeSilent(1, (2, 3), 5.0))
    h.now += 31.0
    h.feed(Tick())
    assert set(h.core.nodes.unreplaceable) == {2, 3}
    assert "no replacement launcher for node 1 within 30s" in h.core.nodes.unreplaceable[2]


def test_a_shrink_to_fewer_than_half_of_its_members_dumps_instead() -> None:
    """A partition's minority side (here the controller's) never trains on: losing 4 of 6
    DP replicas at once ends the job with the dump instead of a shrink to two ranks."""
    h = Harness(6, Features(high_availability=True, worker_reboot=True, elastic=True),
                copies=3)
    for rank in (2, 3, 4, 5):
        h.feed(ProcessExit(rank, 1, REFUSED))
    h.answer("hold", {"step": 1, "status": "updated"})
    h.answer("stop", {"step": 1, "status": "updated", "parked": True})
    h.answer("clean")
    h.answer("dump", {"written": []})
    h.answer("rename", {"iteration": 1, "path": "/save/iter_0000001"})
    (exit_event,) = h.named("exit")
    assert "2 of its 6 ranks would train on: fewer than half" in exit_event["reason"]
    assert not h.named("scale_in")


TOKEN = "t" * 32


def test_another_nodes_launcher_reports_an_exit_as_node_0s_does() -> None:
    """An `exited` frame (a launcher without the controller, over the network) is node 0's
    launcher's `ProcessExit`: the rank is lost at once, and a refusal to restart it makes
    the incident a dump at once, its reason naming the refusal."""
    h = Harness(4, Features(high_availability=True, worker_reboot=True), copies=2,
                token=TOKEN)
    h.exited(3, 103, -9)
    (lost,) = h.named("fault_detected")
    assert (lost["ranks"], lost["kind"]) == ([3], "lost")
    assert lost["message"] == "process killed by signal 9 (reported by its launcher)"
    assert h.core.drops.counts == {}

    h = Harness(4, Features(high_availability=True, worker_reboot=True), copies=2,
                token=TOKEN)
    h.exited(1, 101, 1, no_replacement=REFUSED)
    h.answer("hold", {"step": 1, "status": "updated"})
    h.answer("stop", {"step": 1, "status": "updated", "parked": True})
    (strategy,) = h.named("strategy")
    assert (strategy["strategy"], strategy["reason"]) == ("dump", f"no replacement: rank 1: "
                                                                  f"{REFUSED}")


def test_an_exit_report_needs_the_token_the_rank_key_and_the_registered_process() -> None:
    """Dropped without the job's token, under CURVE from another key than the rank
    registered with, and in a job with neither token nor CURVE; about another process than
    the one registered for the rank (a report that crossed its replacement's
    registration), ignored: no fault."""
    h = Harness(4, Features(high_availability=True, worker_reboot=True), copies=2,
                token=TOKEN)
    h.exited(1, 101, -9, token="u" * 32)
    h.exited(1, 101, -9, token=None)
    h.core.registration.rank_keys[1] = "key-of-rank-1"
    h.exited(1, 101, -9, key="another-key")
    h.exited(2, 999, -9)
    assert h.core.drops.counts == {"bad_token": 2, "rank_key": 1}
    h.exited(1, 101, -9, key="key-of-rank-1")
    assert [e["ranks"] for e in h.named("fault_detected")] == [[1]]

    h = Harness(4, Features(high_availability=True, worker_reboot=True), copies=2)
    h.exited(1, 101, -9)  # neither token nor CURVE: heartbeats only
    assert h.core.drops.counts == {"bad_token": 1} and h.named("fault_detected") == []
    h.core.registration.rank_keys[1] = "key-of-rank-1"  # CURVE without a token
    h.exited(1, 101, -9, key="key-of-rank-1")
    assert [e["ranks"] for e in h.named("fault_detected")] == [[1]]
