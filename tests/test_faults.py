"""Tests of mindspeed_tft.faults: TFT_INJECT parsing, firing, and once-per-job semantics.

Firing is tested in real subprocesses running a tiny step loop (`LOOP`): a kill must end the
process with SIGKILL, a hang must leave other threads running, and an item recorded as fired
(marker file or torch.distributed store) must not fire again in a restarted worker.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mindspeed_tft import events, faults
from mindspeed_tft.faults import (
    FaultInjector,
    FaultItem,
    FaultSpecError,
    parse_fault_spec,
    parse_hang_seconds,
)
from tests.jobs import wait_for

REPO = Path(__file__).resolve().parents[1]

# --- parsing ---------------------------------------------------------------------------------


def test_empty_or_unset_means_no_faults():
    assert parse_fault_spec(None) == []
    assert parse_fault_spec("") == []
    assert parse_fault_spec("  \n ") == []
    assert not FaultInjector.from_env(0, environ={})


def test_parse_all_kinds_with_defaults():
    spec = (
        "kill:rank=3,step=5; raise:rank=0,step=0,phase=backward;"
        "uce:rank=1,step=7 ; uce: rank = 2 , step = 1 , phase = save , target = grad;"
        "comm:rank=4,step=2,phase=optimizer;hang:step=9,rank=5,phase=after"
    )
    assert parse_fault_spec(spec) == [
        FaultItem("kill", 3, 5, "forward", None, 1),
        FaultItem("raise", 0, 0, "backward", None, 2),
        FaultItem("uce", 1, 7, "forward", "optimizer", 3),
        FaultItem("uce", 2, 1, "save", "grad", 4),
        FaultItem("comm", 4, 2, "optimizer", None, 5),
        FaultItem("hang", 5, 9, "after", None, 6),
    ]


def test_item_marker_and_describe():
    item = FaultItem("uce", 2, 1, "save", "grad", 4)
    assert item.marker == "fired-4-uce-rank2-step1-save-grad"
    assert item.describe() == "uce:rank=2,step=1,phase=save,target=grad"
    assert FaultItem("kill", 0, 3).marker == "fired-1-kill-rank0-step3-forward"
    publish = FaultItem("kill", 0, 9, "publish", index=2, point="renamed")
    assert publish.marker == "fired-2-kill-rank0-step9-publish-renamed"
    assert publish.describe() == "kill:rank=0,step=9,phase=publish,point=renamed"
    assert parse_fault_spec(" kill : rank=0, step=9, phase=publish, point=renamed ") == [
        FaultItem("kill", 0, 9, "publish", None, 1, "renamed")]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("kill:rank=0,step=1;;hang:rank=0,step=2",
         "TFT_INJECT item 2 '': empty item; allowed: KIND:key=value,... with KIND one of "
         "kill, raise, uce, comm, hang, corrupt, exit"),
        ("kill:rank=0,step=1;",
         "TFT_INJECT item 2 '': empty item; allowed: KIND:key=value,... with KIND one of "
         "kill, raise, uce, comm, hang, corrupt, exit"),
        ("oom:rank=0,step=1",
         "TFT_INJECT item 1 'oom:rank=0,step=1': unknown kind 'oom'; allowed: kill, raise, "
         "uce, comm, hang, corrupt, exit"),
        ("KILL:rank=0,step=1",
         "TFT_INJECT item 1 'KILL:rank=0,step=1': unknown kind 'KILL'; allowed: kill, raise, "
         "uce, comm, hang, corrupt, exit"),
        ("kill",
         "TFT_INJECT item 1 'kill': missing required key 'rank'"),
        ("kill:step=3",
         "TFT_INJECT item 1 'kill:step=3': missing required key 'rank'"),
        ("kill:rank=0",
         "TFT_INJECT item 1 'kill:rank=0': missing required key 'step'"),
        ("hang:rank=0,step=1;kill:rank=x,step=3",
         "TFT_INJECT item 2 'kill:rank=x,step=3': rank must be a non-negative integer, "
         "got 'x'"),
        ("kill:rank=-1,step=3",
         "TFT_INJECT item 1 'kill:rank=-1,step=3': rank must be a non-negative integer, "
         "got '-1'"),
        ("kill:rank=0,step=2.5",
         "TFT_INJECT item 1 'kill:rank=0,step=2.5': step must be a non-negative integer, "
         "got '2.5'"),
        ("kill:rank=0,step=",
         "TFT_INJECT item 1 'kill:rank=0,step=': step must be a non-negative integer, "
         "got ''"),
        ("kill:rank=0,step=1,when=3",
         "TFT_INJECT item 1 'kill:rank=0,step=1,when=3': unknown key 'when'; allowed: rank, "
         "step, phase, target, point"),
        ("kill:rank=0,step=1,rank=2",
         "TFT_INJECT item 1 'kill:rank=0,step=1,rank=2': duplicate key 'rank'"),
        ("kill:rank=0,step",
         "TFT_INJECT item 1 'kill:rank=0,step': 'step' is not key=value; allowed keys: rank, "
         "step, phase, target, point"),
        ("kill:rank=0,,step=1",
         "TFT_INJECT item 1 'kill:rank=0,,step=1': '' is not key=value; allowed keys: rank, "
         "step, phase, target, point"),
        ("kill:rank=0,step=1,phase=fwd",
         "TFT_INJECT item 1 'kill:rank=0,step=1,phase=fwd': unknown phase 'fwd'; allowed: "
         "forward, backward, optimizer, save, after, publish, scale, transfer"),
        ("kill:rank=0,step=1,phase=publish",
         "TFT_INJECT item 1 'kill:rank=0,step=1,phase=publish': phase publish needs "
         "point=P; allowed: written, synced, aside, renamed, tracker"),
        ("kill:rank=0,step=1,phase=publish,point=fsync",
         "TFT_INJECT item 1 'kill:rank=0,step=1,phase=publish,point=fsync': unknown point "
         "'fsync'; allowed: written, synced, aside, renamed, tracker"),
        ("kill:rank=0,step=1,phase=save,point=synced",
         "TFT_INJECT item 1 'kill:rank=0,step=1,phase=save,point=synced': point is only "
         "allowed with phase publish, not with phase save"),
        ("uce:rank=0,step=1,target=hbm",
         "TFT_INJECT item 1 'uce:rank=0,step=1,target=hbm': unknown target 'hbm'; allowed: "
         "optimizer, param, grad, activation"),
        ("kill:rank=0,step=1,target=param",
         "TFT_INJECT item 1 'kill:rank=0,step=1,target=param': target is only allowed for "
         "uce, not for kill"),
    ],
)
def test_malformed_spec(spec, message):
    with pytest.raises(FaultSpecError) as info:
        parse_fault_spec(spec)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_numbers_are_bounded_and_echoes_cut():
    """A number of any length is refused by its text, before a conversion could fail, and
    an echoed item or value is cut to 60 characters with its length (one short line)."""
    huge = "9" * 5000
    with pytest.raises(FaultSpecError) as info:
        parse_fault_spec(f"kill:rank={huge},step=1")
    assert str(info.value) == (
        f"TFT_INJECT item 1 'kill:rank={'9' * 50}'… (5017 characters): rank must be at most "
        f"2147483647, got '{'9' * 60}'… (5000 characters)")
    with pytest.raises(FaultSpecError) as info:
        parse_fault_spec("kill:rank=0,step=2147483648")
    assert str(info.value).endswith("step must be at most 2147483647, got '2147483648'")
    assert parse_fault_spec("kill:rank=0002147483647,step=0")[0].rank == 2147483647
    junk = "x" * 120_000
    with pytest.raises(FaultSpecError) as info:
        parse_fault_spec(f"kill:rank=0,step=1;{junk}")
    assert str(info.value) == (f"TFT_INJECT item 2 '{'x' * 60}'… (120000 characters): unknown "
                               f"kind '{'x' * 60}'… (120000 characters); allowed: kill, raise, "
                               "uce, comm, hang, corrupt, exit")
    with pytest.raises(FaultSpecError) as info:
        parse_hang_seconds(junk)
    assert len(str(info.value)) < 200


def test_from_env_rejects_malformed_spec_of_other_ranks():
    with pytest.raises(FaultSpecError) as info:
        FaultInjector.from_env(0, environ={"TFT_INJECT": "kill:rank=0,step=1;hang:rank=1"})
    assert str(info.value) == "TFT_INJECT item 2 'hang:rank=1': missing required key 'step'"


def test_from_env_keeps_only_own_rank_and_reads_settings(tmp_path):
    environ = {
        "TFT_INJECT": "kill:rank=1,step=1;raise:rank=0,step=2;comm:rank=1,step=4,phase=after",
        "TFT_INJECT_STATE_DIR": str(tmp_path),
        "TFT_INJECT_HANG_SECONDS": "2.5",
    }
    injector = FaultInjector.from_env(1, environ=environ, store=None)
    assert injector.items == (
        FaultItem("kill", 1, 1, "forward", None, 1),
        FaultItem("comm", 1, 4, "after", None, 3),
    )
    assert (injector.state_dir, injector.hang_seconds, injector.store) == (str(tmp_path), 2.5, None)
    assert FaultInjector.from_env(1, environ={}).state_dir is None
    assert not FaultInjector.from_env(7, environ=environ)


@pytest.mark.parametrize("text", ["0", "-3", "abc", "nan", "inf"])
def test_bad_hang_seconds(text):
    with pytest.raises(FaultSpecError) as info:
        parse_hang_seconds(text)
    assert str(info.value) == (
        f"TFT_INJECT_HANG_SECONDS={text!r}: allowed: a positive number of seconds"
    )


def test_hang_seconds_default():
    assert parse_hang_seconds(None) == 3600.0
    assert parse_hang_seconds(" ") == 3600.0
    assert parse_hang_seconds("0.25") == 0.25


def test_parsing_does_not_import_torch():
    code = (
        "import sys, mindspeed_tft.faults as f; f.parse_fault_spec('kill:rank=0,step=1'); "
        "print('torch' in sys.modules, f.default_store())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=30, check=True)
    assert out.stdout == "False None\n"


# --- firing in process -----------------------------------------------------------------------


@pytest.fixture
def emitted(monkeypatch):
    """The events the injector emits, as (event, rank, fields) tuples."""
    records: list[tuple[str, int, dict]] = []
    monkeypatch.setattr(events, "emit", lambda event, rank, **f: records.append((event, rank, f)))
    return records


def injector_for(spec: str, rank: int = 0, **kwargs) -> FaultInjector:
    kwargs.setdefault("store", None)
    return FaultInjector(parse_fault_spec(spec), rank, **kwargs)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("raise:rank=3,step=2,phase=backward",
         "TFT_INJECT raise: injected error at rank 3 step 2 phase backward"),
        ("comm:rank=3,step=2,phase=backward",
         "HCCL OP RETRY FAILED: TFT_INJECT comm: injected communication error at rank 3 "
         "step 2 phase backward"),
        ("uce:rank=3,step=2,phase=backward",
         "UCE ERROR: TFT_INJECT uce: injected on-chip memory fault in optimizer at rank 3 "
         "step 2 phase backward"),
    ],
)
def test_raising_kinds_fire_once_at_their_point(spec, message, emitted):
    injector = injector_for(spec, rank=3)
    for step, phase in [(1, "backward"), (2, "forward"), (2, "optimizer")]:
        injector.fire(step, phase)
    assert emitted == []
    with pytest.raises(RuntimeError) as info:
        injector.fire(2, "backward")
    assert str(info.value) == message
    kind = spec.split(":")[0]
    target = "optimizer" if kind == "uce" else None
    assert emitted == [("fault_injected", 3,
                        dict(kind=kind, step=2, phase="backward", target=target, item=1))]
    injector.fire(2, "backward")  # recomputing the step: fired already, nothing happens
    assert injector.pending == ()
    assert len(emitted) == 1


def test_uce_corrupts_target_before_raising(emitted):
    injector = injector_for("uce:rank=0,step=4,phase=optimizer,target=param")
    corrupted: list[str] = []
    with pytest.raises(RuntimeError, match="^UCE ERROR: .* in param at rank 0 step 4 "):
        injector.fire(4, "optimizer", corrupt=corrupted.append)
    assert corrupted == ["param"]
    assert emitted[0][2]["target"] == "param"


def test_items_at_one_point_fire_in_order_one_per_call(emitted):
    injector = injector_for("comm:rank=0,step=1;raise:rank=0,step=1;raise:rank=1,step=1")
    with pytest.raises(RuntimeError, match="^HCCL OP RETRY FAILED"):
        injector.fire(1, "forward")
    with pytest.raises(RuntimeError, match="^TFT_INJECT raise"):
        injector.fire(1, "forward")
    injector.fire(1, "forward")
    assert [fields["item"] for _, _, fields in emitted] == [1, 2]


def test_fire_rejects_unknown_phase():
    with pytest.raises(ValueError) as info:
        injector_for("").fire(0, "update")
    assert str(info.value) == (
        "unknown phase 'update'; allowed: forward, backward, optimizer, save, after, publish, scale, transfer"
    )


def test_fire_takes_a_point_with_phase_publish_only():
    injector = injector_for("")
    for phase, point in (("publish", None), ("publish", "fsync"), ("save", "synced")):
        with pytest.raises(ValueError) as info:
            injector.fire(0, phase, point)
        assert str(info.value) == (
            f"phase {phase} with point {point!r}: phase publish takes one of written, synced, "
            "aside, renamed, tracker, other phases none")


def test_hang_is_bounded(emitted):
    injector = injector_for("hang:rank=0,step=0,phase=after", hang_seconds=0.2)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        injector.fire(0, "after")
    assert time.monotonic() - start >= 0.2
    assert str(info.value) == "TFT_INJECT hang: rank 0 step 0 phase after was not stopped within 0.2 s"


class DictStore:
    """A Store with `compare_set` only, like torch's: sets `desired` when the key is absent
    (`expected` empty) or holds `expected`; returns the value the key then holds."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.claims = 0

    def compare_set(self, key: str, expected: str, desired: bytes) -> bytes:
        self.claims += 1
        if key not in self.values and expected == "" or self.values.get(key) == expected:
            self.values[key] = desired
        return self.values[key]


def test_store_ledger_shared_between_injectors(emitted):
    store = DictStore()
    spec = "raise:rank=0,step=1"
    with pytest.raises(RuntimeError):
        injector_for(spec, store=store).fire(1, "forward")
    injector_for(spec, store=store).fire(1, "forward")  # a restarted worker
    assert list(store.values) == ["tft_inject/fired/fired-1-raise-rank0-step1-forward"]
    assert store.claims == 2
    assert len(emitted) == 1


def test_dir_ledger_shared_between_injectors(tmp_path, emitted):
    spec = "raise:rank=0,step=1"
    with pytest.raises(RuntimeError):
        injector_for(spec, state_dir=str(tmp_path / "state")).fire(1, "forward")
    injector_for(spec, state_dir=str(tmp_path / "state")).fire(1, "forward")
    marker = tmp_path / "state" / "fired-1-raise-rank0-step1-forward"
    assert marker.read_text().startswith("raise:rank=0,step=1,phase=forward pid=")
    assert len(emitted) == 1


def test_any_ledger_that_saw_the_item_stops_it(tmp_path, emitted):
    store = DictStore()
    store.compare_set("tft_inject/fired/fired-1-raise-rank0-step1-forward", "", b"another")
    injector_for("raise:rank=0,step=1", store=store, state_dir=str(tmp_path)).fire(1, "forward")
    assert emitted == []
    assert (tmp_path / "fired-1-raise-rank0-step1-forward").exists()  # recorded there too


def test_memory_only_without_store_or_dir(emitted):
    spec = "raise:rank=0,step=1"
    injector = injector_for(spec)
    with pytest.raises(RuntimeError):
        injector.fire(1, "forward")
    injector.fire(1, "forward")
    with pytest.raises(RuntimeError):  # a new process would fire it again
        injector_for(spec).fire(1, "forward")


def test_unreachable_store_falls_back_to_other_ledgers(tmp_path, emitted):
    class BrokenStore:
        def add(self, key, amount):
            raise RuntimeError("connection refused")

    spec = "raise:rank=0,step=1"
    with pytest.raises(RuntimeError, match="^TFT_INJECT raise"):
        injector_for(spec, store=BrokenStore(), state_dir=str(tmp_path)).fire(1, "forward")
    injector_for(spec, store=BrokenStore(), state_dir=str(tmp_path)).fire(1, "forward")
    assert len(emitted) == 1


def test_default_store_is_none_without_process_group():
    assert faults.default_store() is None


# --- firing in real processes ----------------------------------------------------------------

# A tiny training loop: steps 0..STEPS-1, the four in-step phase points, a heartbeat thread.
LOOP = textwrap.dedent(
    """
    import os, sys, threading, time
    if os.environ.get("STORE_PORT"):
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False)
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        dist.init_process_group("gloo", store=dist.PrefixStore(f"/worker/attempt_{attempt}",
                                store), rank=0, world_size=1)
    from mindspeed_tft.faults import FaultInjector

    injector = FaultInjector.from_env(int(os.environ["RANK"]))
    progress = open(os.environ["PROGRESS"], "a", buffering=1)

    def heartbeat():
        with open(os.environ["PROGRESS"] + ".beat", "a", buffering=1) as beat:
            while True:
                beat.write("tick\\n")
                time.sleep(0.02)

    threading.Thread(target=heartbeat, daemon=True).start()

    def corrupt(target):
        progress.write(f"corrupt {target}\\n")

    for step in range(int(os.environ.get("STEPS", "4"))):
        for phase in ("forward", "backward", "optimizer", "after"):
            progress.write(f"{step} {phase}\\n")
            injector.fire(step, phase, corrupt=corrupt)
    progress.write("done\\n")
    """
)


def start_loop(tmp_path: Path, spec: str, **env: str) -> subprocess.Popen:
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TFT_")},
        "PYTHONPATH": str(REPO),
        "TFT_INJECT": spec,
        "RANK": "0",
        "PROGRESS": str(tmp_path / "progress"),
        "TFT_EVENTS_FILE": str(tmp_path / "events.jsonl"),
        **env,
    }
    return subprocess.Popen([sys.executable, "-c", LOOP], cwd=tmp_path, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_loop(tmp_path: Path, spec: str, **env: str) -> tuple[int, str]:
    proc = start_loop(tmp_path, spec, **env)
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr


def progress_lines(tmp_path: Path) -> list[str]:
    return (tmp_path / "progress").read_text().splitlines()


def injected_events(tmp_path: Path) -> list[dict]:
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    for record in records:
        assert isinstance(record.pop("time"), float)
    return records


ALL_STEPS = [f"{s} {p}" for s in range(4) for p in ("forward", "backward", "optimizer", "after")]


def test_kill_in_subprocess_then_restarted_worker_skips_it(tmp_path):
    state = str(tmp_path / "state")
    code, _ = run_loop(tmp_path, "kill:rank=0,step=2,phase=backward", TFT_INJECT_STATE_DIR=state)
    assert code == -9
    assert progress_lines(tmp_path) == ALL_STEPS[: ALL_STEPS.index("2 backward") + 1]
    assert injected_events(tmp_path) == [
        {"event": "fault_injected", "rank": 0, "kind": "kill", "step": 2, "phase": "backward",
         "target": None, "item": 1}
    ]
    assert os.listdir(state) == ["fired-1-kill-rank0-step2-backward"]

    (tmp_path / "progress").unlink()
    code, stderr = run_loop(tmp_path, "kill:rank=0,step=2,phase=backward",
                            TFT_INJECT_STATE_DIR=state)
    assert (code, stderr) == (0, "")
    assert progress_lines(tmp_path) == ALL_STEPS + ["done"]
    assert len(injected_events(tmp_path)) == 1


def test_kill_for_another_rank_does_nothing(tmp_path):
    assert run_loop(tmp_path, "kill:rank=1,step=0") == (0, "")
    assert progress_lines(tmp_path) == ALL_STEPS + ["done"]


@pytest.mark.parametrize(
    "spec, last_line, corrupted",
    [
        ("raise:rank=0,step=1,phase=after",
         "RuntimeError: TFT_INJECT raise: injected error at rank 0 step 1 phase after", []),
        ("comm:rank=0,step=3,phase=optimizer",
         "RuntimeError: HCCL OP RETRY FAILED: TFT_INJECT comm: injected communication error "
         "at rank 0 step 3 phase optimizer", []),
        ("uce:rank=0,step=0,phase=backward,target=activation",
         "RuntimeError: UCE ERROR: TFT_INJECT uce: injected on-chip memory fault in "
         "activation at rank 0 step 0 phase backward", ["corrupt activation"]),
    ],
)
def test_raising_kinds_in_subprocess(tmp_path, spec, last_line, corrupted):
    code, stderr = run_loop(tmp_path, spec)
    assert code == 1
    assert stderr.splitlines()[-1] == last_line
    item = parse_fault_spec(spec)[0]
    point = f"{item.step} {item.phase}"
    assert progress_lines(tmp_path) == ALL_STEPS[: ALL_STEPS.index(point) + 1] + corrupted
    assert injected_events(tmp_path) == [
        {"event": "fault_injected", "rank": 0, "kind": item.kind, "step": item.step,
         "phase": item.phase, "target": item.target, "item": 1}
    ]


def test_hang_in_subprocess_keeps_other_threads_running(tmp_path):
    proc = start_loop(tmp_path, "hang:rank=0,step=1,phase=optimizer")
    try:
        wait_for(lambda: (tmp_path / "events.jsonl").exists(), 20, "the events file")
        beat = tmp_path / "progress.beat"
        time.sleep(0.3)
        ticks_before = beat.read_text().count("tick")
        time.sleep(0.3)
        assert proc.poll() is None
        assert beat.read_text().count("tick") > ticks_before  # heartbeat still ticking
        assert progress_lines(tmp_path) == ALL_STEPS[: ALL_STEPS.index("1 optimizer") + 1]
        assert injected_events(tmp_path)[0]["kind"] == "hang"
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == -15


def test_hang_in_subprocess_ends_with_error_after_bound(tmp_path):
    code, stderr = run_loop(tmp_path, "hang:rank=0,step=0", TFT_INJECT_HANG_SECONDS="0.3")
    assert code == 1
    assert stderr.splitlines()[-1] == (
        "RuntimeError: TFT_INJECT hang: rank 0 step 0 phase forward was not stopped within 0.3 s"
    )


def test_kill_once_per_job_through_torch_distributed_store(tmp_path):
    """Two worker processes share the launcher's TCPStore through their default process group
    (with different attempt prefixes, as under torchrun's agent store)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"STORE_PORT": str(store.port), "TFT_INJECT_STATE_DIR": ""}
    spec = "raise:rank=1,step=0;kill:rank=0,step=1,phase=after"
    code, _ = run_loop(tmp_path, spec, TORCHELASTIC_RESTART_COUNT="0", **env)
    assert code == -9
    assert progress_lines(tmp_path)[-1] == "1 after"

    (tmp_path / "progress").unlink()
    code, stderr = run_loop(tmp_path, spec, TORCHELASTIC_RESTART_COUNT="1", **env)
    assert (code, progress_lines(tmp_path)) == (0, ALL_STEPS + ["done"]), stderr
    # claimed once, by the first process: a pid and a time of its own
    assert re.fullmatch(rb"\d+-\d+", store.get("tft_inject/fired/fired-2-kill-rank0-step1-after"))
    assert not list(tmp_path.glob("fired-*"))
    assert [e["kind"] for e in injected_events(tmp_path)] == ["kill"]
