"""The same MindSpeed-LLM-shaped client (`tests/sdk_compat/client.py`, 4 ranks, DP groups
[0, 2] and [1, 3] with full optimizer replicas) runs against Huawei's `mindio_ttp` 7.3.0
(../shared/peers/mindio_ttp, in a venv of its own) and against this project's (sdk/), for a
UCE report on one rank (also one whose clean finds nothing to rebuild), a communication
failure, MindSpeed-LLM's precision error, an unknown error (dump), a SIGKILLed rank and a
normal end. Every handler call is recorded with its arguments; the two must agree on
which handlers run on which rank, in which order, with which step, ranks, repair type and
checkpoint information, except where docs/design.md ("mindio_ttp") says this control plane
differs, which is asserted as such. All sixteen jobs run at once (~15 s: the SDK takes 9-11 s to
see a killed process).

Also against both: a pause ordered through the SDK's cluster-manager API in the controller's
process (the stream-sync handler runs on every rank once it is held, before the job goes
on); the SDK's own client (`example_proc.py`, unchanged) as a standalone controller
(`tft_init_controller(-1, 4, False)`) plus 4 processors, a UCE report on rank 1 reaching
every rank's stop handler (here within 1 s, with the job's token made by the controller and
a stranger's REGISTER and report refused); and the SDK's refusals of bad arguments, with
its words and exit codes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import REPO, free_port
from tests.sdk_compat.harness import CaseResult, calls_view, run_case

#: Huawei's SDK built for CPU (shared/ beside the repository; MINDIO_TTP_DIR overrides)
PEER = Path(os.environ.get("MINDIO_TTP_DIR") or REPO.parent / "shared" / "peers" / "mindio_ttp")
WHEEL = PEER / "mindio_ttp-7.3.0-py3-none-linux_x86_64.whl"
#: the SDK's venv, made once per wheel (an ignored folder of the checkout)
SDK_VENV = REPO / ".cache" / "mindio-sdk-venv"
WORLD, ITERATIONS, FAULT_RANK, FAULT_ITER = 4, 6, 1, 3
DP_GROUPS = [[0, 2], [1, 3]]
CASES = ("uce", "uce_low", "hccl", "precision", "unknown", "kill", "none", "pause")
#: per case: the client's spec beyond the common one (pause: the ranks meet in a barrier
#: until the pause's iteration, then train on alone, 0.1 s an iteration)
SPECS = {"pause": {"barrier_until": FAULT_ITER, "step_seconds": 0.1}}
EXAMPLE = PEER / "example_proc.py"


def sdk_python() -> str:
    """The SDK venv's interpreter (created here on first use, cached by the wheel's hash)."""
    assert WHEEL.is_file(), f"Huawei's mindio_ttp wheel not found at {WHEEL} (set MINDIO_TTP_DIR)"
    digest = hashlib.sha256(WHEEL.read_bytes()).hexdigest()[:16]
    python = SDK_VENV / "bin" / "python"
    stamp = SDK_VENV / ".wheel"
    if python.exists() and stamp.exists() and stamp.read_text() == digest:
        return str(python)
    building = SDK_VENV.with_name(SDK_VENV.name + f".build-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
    subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", "--no-index", str(WHEEL)], check=True)
    (building / ".wheel").write_text(digest)
    shutil.rmtree(SDK_VENV, ignore_errors=True)
    building.rename(SDK_VENV)  # venvs do not move well: the scripts name their folder, but
    return str(python)         # `bin/python` itself runs from anywhere


def _env(real: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTP_", "TFT_", "MINDX"))}
    if real:  # the SDK's MindSpore code path, without torch_npu (PEER/README.md)
        env.update(MINDIO_FOR_MINDSPORE="1", PYTHONPATH=str(PEER / "stubs"), TTP_LOG_STDOUT="1")
    else:
        env["PYTHONPATH"] = str(REPO)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], CaseResult]:
    """Every case against both implementations, eight jobs of 4 ranks at a time (all 16 at
    once starved the real SDK's ranks beside another job: its controller, 8 s without a
    rank's status, ended a job)."""
    real_python = sdk_python()
    base = tmp_path_factory.mktemp("sdk-compat")
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        for impl, python in (("sdk", real_python), ("ours", sys.executable)):
            for case in CASES:
                fault = (FAULT_RANK, FAULT_ITER) if case != "none" else (-1, -1)
                jobs[impl, case] = pool.submit(
                    run_case, python, _env(impl == "sdk"), base / impl / case, case,
                    world=WORLD, port=free_port(), dp_groups=DP_GROUPS, iterations=ITERATIONS,
                    fault_rank=fault[0], fault_iter=fault[1], timeout=60,
                    **SPECS.get(case, {}))
    return {key: job.result() for key, job in jobs.items()}


def _pair(runs: dict, case: str) -> tuple[CaseResult, CaseResult]:
    return runs["sdk", case], runs["ours", case]


def _after_fault(result: CaseResult, name: str) -> float:
    first, fault = result.first(name), result.first("fault")
    assert first is not None and fault is not None, result.describe()
    return first - fault


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["uce", "uce_low", "hccl"])
def test_repairs_call_the_same_handlers(runs, case):
    """A UCE on rank 1 / the same UCE where its clean handler finds nothing to rebuild
    (returns 2) / a communication failure: on every rank stop, clean (the UCE rank's
    `is_uce_error` True, repair type "retry"), for the UCE the repair of rank 1 from its
    replica rank 3 (RT_UCE_HIGHLEVEL and rebuild on 1, RT_SEND on 3, step 3), no repair in
    the other two cases, rollback to 3; then training goes on to the end. The SDK acts 2 s
    after the report (its confirmation sleep); this control plane at once."""
    sdk, ours = _pair(runs, case)
    assert calls_view(ours) == calls_view(sdk), sdk.describe() + "\n" + ours.describe()
    for result in (sdk, ours):
        assert [c["iteration"] for r in range(WORLD) for c in result.named(r, "end")] == \
            [ITERATIONS] * WORLD, result.describe()
        assert all(len(result.named(r, "train_enter")) == 2 for r in range(WORLD))
        assert all(c["args_type"] == "list" for r in range(WORLD)
                   for c in result.named(r, "rollback"))
    view = calls_view(ours)
    if case == "uce":
        assert view[1][2] == ("repair", FAULT_ITER, True, (1,), 1, (3,), (1,), (0,), (1, 3))
        assert view[3][2] == ("repair", FAULT_ITER, False, (1,), 0, (3,), (1,), (0,), (1, 3))
    else:
        assert not any(row[0] == "repair" for rows in view.values() for row in rows)
    assert all(rows[-1] == ("rollback", FAULT_ITER) for rows in view.values())
    assert set(ours.codes.values()) == {0}, ours.describe()
    # the SDK sleeps 2 s to confirm a fault before its stop; ours does not wait that out
    assert _after_fault(sdk, "stop") >= 1.9, sdk.describe()
    assert _after_fault(ours, "stop") < 1.9, ours.describe()


@pytest.mark.multiproc
def test_precision_error_reloads_the_checkpoint(runs):
    """MindSpeed-LLM's registered `PRECISION ERROR` (RS_RETRY) on rank 1: every rank's repair
    handler reloads the last checkpoint (RT_LOAD_CKPT, its own rank, the whole job as
    rank_list), as the SDK's PyTorch path does (`GetAllRepairInfo`), and the rollback goes to
    the iteration the handlers loaded (`tft_report_load_ckpt_step`: 2). The SDK's MindSpore
    path, which runs here, does not reload checkpoints: it repairs rank 1 from its replica
    and rolls back to the lock step (docs/design.md)."""
    sdk, ours = _pair(runs, "precision")
    everyone = tuple(range(WORLD))
    assert calls_view(ours) == {
        r: [("stop",), ("clean", False, "retry"),
            ("repair", FAULT_ITER, False, (r,), 5, (r,), (r,), (0,), everyone),
            ("rollback", FAULT_ITER - 1)] for r in everyone}, ours.describe()
    assert calls_view(sdk)[1][2] == ("repair", FAULT_ITER, False, (1,), 3, (3,), (1,), (0,),
                                     (1, 3)), sdk.describe()
    assert calls_view(sdk)[1][-1] == ("rollback", FAULT_ITER), sdk.describe()
    assert set(ours.codes.values()) == {0}, ours.describe()


def _writers(result: CaseResult) -> dict[int, tuple]:
    return {r: rows for r, rows in calls_view(result).items()
            if any(row[0] == "save_ckpt" for row in rows)}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["unknown", "kill"])
def test_dumps_save_the_same_step(runs, case):
    """An unknown error on rank 1 / rank 1 killed: one writer per DP group runs stop, clean
    (not a UCE) and save (step 3, `save_info` naming itself), one writer renames step 3, and
    every live rank is told to exit. Differences (docs/design.md): the stop reaches every
    live rank (it comes before the decision here), the clean's repair type is "dump" (the
    SDK's is "unknow"), a rank whose error left its optimizer data intact may write its own
    group (unknown: rank 1 here, 3 in the SDK), rank 0 renames, the ranks exit with 75 at
    once, and a kill is seen at once, not after 9-11 s of missed heartbeats."""
    sdk, ours = _pair(runs, case)
    live = [r for r in range(WORLD) if not (case == "kill" and r == FAULT_RANK)]
    expected_writers = {"sdk": {0, 3}, "ours": {0, 1} if case == "unknown" else {0, 3}}
    for impl, result in (("sdk", sdk), ("ours", ours)):
        writers = _writers(result)
        assert set(writers) == expected_writers[impl], result.describe()
        repair_type = "unknow" if impl == "sdk" else "dump"
        for rank, rows in writers.items():
            assert rows[:3] == [("stop",), ("clean", False, repair_type),
                                ("save_ckpt", FAULT_ITER, ((0, (rank,)),))], result.describe()
        renames = [(r, row) for r, rows in writers.items() for row in rows if row[0] == "rename"]
        assert [row for _, row in renames] == [("rename", FAULT_ITER)], result.describe()
        assert all(result.named(r, "exit") for r in live), result.describe()
        stopped = {r for r, rows in calls_view(result).items() if ("stop",) in rows}
        assert stopped == (set(live) if impl == "ours" else set(writers)), result.describe()
    assert [r for r, rows in _writers(ours).items() if ("rename", FAULT_ITER) in rows] == [0]
    assert {ours.codes[r] for r in live} == {75}, ours.describe()
    if case == "kill":
        assert _after_fault(sdk, "stop") > 5.0, sdk.describe()
        assert _after_fault(ours, "stop") < 2.0, ours.describe()


@pytest.mark.multiproc
def test_normal_end_calls_no_handler(runs):
    """Training ends without a fault: no handler runs, every rank returns its last iteration
    and leaves the control plane (rank 0's controller ends with the job)."""
    for result in _pair(runs, "none"):
        assert all(rows == [] for rows in calls_view(result).values()), result.describe()
        assert [c["iteration"] for r in range(WORLD) for c in result.named(r, "end")] == \
            [ITERATIONS] * WORLD, result.describe()
        assert set(result.codes.values()) == {0}, result.describe()


@pytest.mark.multiproc
def test_pause_runs_the_stream_sync_on_every_held_rank(runs):
    """Rank 0's process (the controller's) pauses the job at iteration 3 through the SDK's
    cluster-manager API (`tft_notify_controller_stop_train({}, "pause", 30)`) and continues
    it 1 s later (`tft_notify_controller_change_strategy("continue")`): every rank's
    stream-sync handler runs once, after the pause and before the continue, and no other
    handler; every rank is held about 1 s and ends normally. Where the training thread is
    held differs (docs/usage.md): the SDK holds it in `tft_pause_train` at its pause step
    (the ranks' latest step + 1), this control plane at the rank's next hold point
    (`tft_start_updating_os` here)."""
    sdk, ours = _pair(runs, "pause")
    for impl, result in (("sdk", sdk), ("ours", ours)):
        [ordered] = result.named(0, "pause_ordered")
        [going_on] = result.named(0, "continue_ordered")
        assert (ordered["ret"], going_on["ret"]) == (0, 0), result.describe()
        for rank in range(WORLD):
            syncs = [c["t"] for c in result.named(rank, "stream_sync")]
            assert len(syncs) == 1 and ordered["t"] <= syncs[0] <= going_on["t"], \
                (impl, result.describe())
            [held] = result.named(rank, "held")
            assert held["blocked"] > 0.5, (impl, result.describe())
            assert held["where"] == ("tft_pause_train" if impl == "sdk"
                                     else "tft_start_updating_os"), result.describe()
        assert all(rows == [] for rows in calls_view(result).values()), result.describe()
        assert set(result.codes.values()) == {0}, result.describe()


def test_get_device_on_cpu_is_the_same(runs):
    """`get_device()` after `tft_init_processor`, on this CPU: what the SDK answers."""
    sdk, ours = _pair(runs, "none")
    devices = [c["device"] for result in (sdk, ours) for r in range(WORLD)
               for c in result.named(r, "started")]
    assert devices == [0] * (2 * WORLD), (sdk.describe(), ours.describe())


def _stranger_checks(port: int, before: dict) -> None:
    """A stranger (a real socket, no token) registers as rank 0 before the ranks do: refused."""
    import zmq

    from mindspeed_tft.control.wire.protocol import MsgType, decode, encode

    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(encode(MsgType.REGISTER, 0, 1, {"world_size": WORLD, "pid": 4242,
                                                "host": "stranger"}))
        assert s.poll(5000, zmq.POLLIN), "the stranger's REGISTER got no answer"
        before["reply"] = decode(s.recv()).type
    finally:
        ctx.destroy(linger=0)


def _stranger_report(port: int, after: dict) -> None:
    """Once the ranks registered: a connection that never registered reports a UCE for
    rank 1 (dropped: no rank's stop handler runs within 2 s)."""
    import zmq

    from mindspeed_tft.control.wire.protocol import MsgType, encode

    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(encode(MsgType.REPORT, 1, 10**6, {"kind": "uce", "message": "UCE ERROR (forged)",
                                                 "step": 1, "status": "updated"}))
        after["sent"] = time.time()
        time.sleep(2.0)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.multiproc
def test_standalone_controller_runs_the_sdks_own_client(tmp_path):
    """`example_proc.py`, unchanged: a standalone controller (`tft_init_controller(-1, 4,
    False)`) and 4 processors (DP groups of 2), a UCE reported on rank 1. Both SDKs stop all
    4 ranks; the SDK after its 2 s confirmation, this project within 1 s. Here, with no
    TTP_JOB_TOKEN and no keys, the controller made the job's token and the processors took
    it (`_token`); a stranger's REGISTER as rank 0 was refused and a report from a connection
    that never registered changed nothing."""
    from tests.sdk_compat import standalone

    before: dict = {}
    after: dict = {}
    results = {}
    for impl, python in (("sdk", sdk_python()), ("ours", sys.executable)):
        hooks = {} if impl == "sdk" else {
            "before_ranks": lambda port: _stranger_checks(port, before),
            "with_ranks": lambda port: _stranger_report(port, after)}
        env = {**_env(impl == "sdk"), "TTP_LOG_PATH": str(tmp_path / impl / "logs")}
        results[impl] = standalone.run(python, env, EXAMPLE, tmp_path / impl, port=free_port(),
                                       world=WORLD, uce_rank=FAULT_RANK, **hooks)
    for impl, outcome in results.items():
        reported = outcome.first(FAULT_RANK, "report_uce")
        assert reported is not None, outcome.describe()
        stops = {r: outcome.first(r, "stop") for r in range(WORLD)}
        assert all(t is not None for t in stops.values()), (impl, outcome.describe())
        delays = [t - reported for t in stops.values() if t is not None]
        if impl == "sdk":
            assert min(delays) >= 1.9, outcome.describe()
        else:
            assert max(delays) < 1.9, outcome.describe()  # no 2 s confirmation sleep
            assert all(outcome.names(r).count("stop") == 1 for r in range(WORLD))
    from mindspeed_tft.control.wire.protocol import MsgType

    assert before["reply"] == MsgType.REJECT
    ours = results["ours"]
    assert all(t > after["sent"] + 1.9 for r in range(WORLD)
               if (t := ours.first(r, "stop")) is not None), ours.describe()


@pytest.mark.multiproc
@pytest.mark.parametrize("left", [False, True], ids=["none", "stale"])
def test_ranks_started_before_the_controller_wait_for_its_token(tmp_path, left):
    """Here: torchrun starts every rank at once, so a processor may look for the job's
    token before the controller made it: the 4 processors of example_proc.py start 1.5 s
    before its standalone controller, wait for the token file, register and are stopped
    by a UCE as before. With an earlier job's token file left on the port (a SIGKILLed
    controller's), each reads that one, is refused, says so in one line and registers with
    the token the new controller wrote over it."""
    from mindio_ttp import _token

    from tests.sdk_compat import standalone

    port, seen = free_port(), {}
    path = _token.token_path("127.0.0.1", port)
    if left:
        path.write_text("0" * 64)
        path.chmod(0o600)
    env = {**_env(False), "TTP_LOG_PATH": str(tmp_path / "logs")}
    outcome = standalone.run(sys.executable, env, EXAMPLE, tmp_path, port=port, world=WORLD,
                             uce_rank=FAULT_RANK, controller_delay=1.5,
                             with_ranks=lambda _: seen.update(token=path.read_text()))
    started = [outcome.first(r, "started") for r in range(WORLD)]
    assert all(t is not None for t in started), outcome.describe()
    assert all(outcome.first(r, "stop") is not None for r in range(WORLD)), outcome.describe()
    assert len(seen["token"]) == 64 and seen["token"] != "0" * 64
    said = [outcome.output[f"rank{r}"].count("refused the job token read from") for r in
            range(WORLD)]
    assert said == [int(left)] * WORLD, outcome.describe()


#: (calls, what both SDKs must do): the last call of each either answers or ends the process
REFUSALS = [
    ([["tft_init_controller", [-1, 4, False]]], "ok"),
    ([["tft_init_controller", [-2, 4, False]]], "init controller failed, error num:1"),
    ([["tft_init_controller", [4, 4, False]]], "init controller failed, error num:1"),
    ([["tft_init_controller", [0, 0, False]]], "init controller failed, error num:1"),
    ([["tft_init_controller", [0, 100001, False]]], "init controller failed, error num:1"),
    ([["tft_init_controller", ["0", 4, False]]],
     "in method 'init_controller', argument 1 of type 'int'"),
    ([["tft_init_processor", [-1, 4, False, False]]], "exit 2"),
    ([["tft_init_processor", [4, 4, False, False]]], "exit 2"),
    ([["tft_init_controller", [-1, 4, False]], ["tft_start_controller", ["0.0.0.0", 8000, False]]],
     "exit 2"),
    ([["tft_init_controller", [-1, 4, False]], ["tft_start_controller", ["127.0.0.1", 80, False]]],
     "exit 2"),
]


def _probe(python: str, env: dict[str, str], calls: list) -> tuple[int, list[dict]]:
    out = subprocess.run(["nice", "-n", "10", python, str(REPO / "tests" / "sdk_compat" /
                                                          "refusal_probe.py"), json.dumps(calls)],
                         env=env, capture_output=True, text=True, timeout=60)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return out.returncode, rows


@pytest.mark.multiproc
def test_refusals_are_the_sdks(tmp_path):
    """The same bad arguments to both SDKs: the same acceptance, exception type (an
    Exception; here a ValueError or TypeError) and words at the start of the message, or
    the same exit code (2; the SDK exits 10 s after its refusal, this one at once)."""
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for impl, python in (("sdk", sdk_python()), ("ours", sys.executable)):
            env = {**_env(impl == "sdk"), "TTP_LOG_PATH": str(tmp_path / impl)}
            for i, (calls, _) in enumerate(REFUSALS):
                jobs[impl, i] = pool.submit(_probe, python, env, calls)
    for i, (calls, expected) in enumerate(REFUSALS):
        for impl in ("sdk", "ours"):
            code, rows = jobs[impl, i].result()
            what = (impl, calls, code, rows)
            if expected == "exit 2":
                assert code == 2 and len(rows) == len(calls) - 1, what
                continue
            assert code == 0 and len(rows) == len(calls), what
            if expected == "ok":
                assert rows[-1] == {"ok": True}, what
            else:
                assert rows[-1]["exception"] and rows[-1]["message"].startswith(expected), what
        sdk_rows, our_rows = jobs["sdk", i].result()[1], jobs["ours", i].result()[1]
        if expected.startswith("in method"):
            assert sdk_rows[-1]["error"] == our_rows[-1]["error"] == "TypeError"
    # where the oracle cannot go: its CPU build (the MindSpore path) refuses ZIT, which its
    # PyTorch path, MindSpeed-LLM's, accepts (as this one does: docs/usage.md)
    zit = [["tft_init_controller", [0, 4, False, False, True]]]
    code, rows = _probe(sdk_python(), {**_env(True), "TTP_LOG_PATH": str(tmp_path / "zit")}, zit)
    assert code == 0 and rows[-1]["message"] == "init controller failed, error num:1", rows
    code, rows = _probe(sys.executable, {**_env(False), "TTP_LOG_PATH": str(tmp_path / "z")}, zit)
    assert code == 0 and rows == [{"ok": True}], rows
