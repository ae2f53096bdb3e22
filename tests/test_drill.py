"""The fault drill (mindspeed_tft/tools/drill.py): its options, the certificate built from events,
a pass's timeout, and two real drills of the tiny CPU job under `tft-run` with 2 ranks: one
configuration that recovers from a kill and a UCE in the optimizer state (every row OK, exit
0), and one that cannot (`--distributed-optimizer-no-replica`, a kill before the first
periodic checkpoint: the row says why, exit 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mindspeed_tft.tools import drill
from mindspeed_tft.tools.drill import PassResult, certify, parse_args
from tests.jobs import REPO, tiny_job_env

REFERENCE = {1: 8.31, 2: 8.30, 3: 8.28, 4: 8.25, 5: 8.20, 6: 8.21}


def ev(time: float, name: str, rank: int = -1, **fields) -> dict:
    return {"time": time, "event": name, "rank": rank, **fields}


def it(time: float, iteration: int, loss: float | None = None) -> dict:
    return ev(time, "iteration", 1, iteration=iteration,
              loss=REFERENCE[iteration] if loss is None else loss)


def start() -> list[dict]:
    return [ev(0.0, "state", state="INIT", prev=None, reason="controller started"),
            ev(0.5, "state", state="NORMAL", prev="INIT", reason="all 2 ranks registered")]


def fault(time: float, step: int) -> list[dict]:
    return [ev(time, "fault_injected", 1, kind="kill", step=step, phase="backward",
               target=None, item=1),
            ev(time + 0.1, "state", state="ABNORMAL", prev="NORMAL", reason="lost on rank 1")]


def finish(time: float, code: int = 0, reason: str = "training finished") -> list[dict]:
    return [ev(time, "exit", code=code, reason=reason),
            ev(time, "state", state="FINAL", prev="EXIT", reason=reason)]


def repaired(time: float, strategy: str, source: str, lock: int, resume: int) -> list[dict]:
    return [ev(time - 1, "strategy", strategy=strategy, lock_step=lock, source=source,
               faults={"1": "lost"}, incident=1),
            ev(time, "repaired", strategy=strategy, lock_step=lock, step=resume, incident=1),
            ev(time, "state", state="NORMAL", prev="REPAIR", reason="repaired")]


# --- options ---------------------------------------------------------------------------


def test_defaults_and_the_command_after_the_separator():
    options = parse_args(["--", "torchrun", "--nproc-per-node", "2", "pretrain_gpt.py",
                          "--train-iters", "100", "--", "x"])
    assert options.command == ["torchrun", "--nproc-per-node", "2", "pretrain_gpt.py",
                               "--train-iters", "100", "--", "x"]
    assert options.faults == ["kill", "uce:optimizer"]
    assert (options.rank, options.step, options.phase, options.iters) == (None, None,
                                                                          "backward", 8)
    options = parse_args(["--faults", "kill, uce:optimizer,uce:param,raise,hang", "--rank", "3",
                          "--step", "4", "--iters", "6", "--", "bash", "job.sh"])
    assert options.faults == ["kill", "uce:optimizer", "uce:param", "raise", "hang"]
    assert (options.rank, options.step, options.iters) == (3, 4, 6)


@pytest.mark.parametrize(("argv", "message"), [
    (["--faults", "kill,uce:bogus", "--", "x"],
     "unknown fault 'uce:bogus'; allowed: kill, raise, hang, comm, uce:optimizer, uce:param, "
     "uce:grad, uce:activation"),
    (["--faults", "kill,kill", "--", "x"], "fault 'kill' listed twice"),
    (["--faults", "kill"], "no command: give the launch command after '--'"),
    (["--"], "no command"),
    (["--iters", "6", "--step", "6", "--", "x"], "--step 6 must come before the end of --iters 6"),
    (["--rank", "-1", "--", "x"], "an integer >= 0, got '-1'"),
    (["--timeout", "0", "--", "x"], "a positive number of seconds"),
])
def test_usage_errors_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_used_workdir_is_refused(tmp_path, capsys):
    (tmp_path / "old").write_text("x")
    with pytest.raises(SystemExit):
        parse_args(["--workdir", str(tmp_path), "--", "x"])
    assert "is not empty" in capsys.readouterr().err


def test_what_each_pass_runs_with(tmp_path):
    assert drill.inject_spec("uce:param", 1, 3, "backward") == \
        "uce:rank=1,step=3,phase=backward,target=param"
    assert drill.inject_spec("hang", 0, 2, "after") == "hang:rank=0,step=2,phase=after"
    assert drill.pass_command(["bash", "job.sh"], 6, tmp_path) == [
        "bash", "job.sh", "--train-iters", "6", "--save", str(tmp_path / "ckpt"),
        "--tft-events-file", str(tmp_path / "events.jsonl")]
    assert "--train-iters" not in drill.pass_command(["bash", "job.sh"], 0, tmp_path)
    env = drill.pass_env({"TFT_INJECT": "kill:rank=0,step=1", "A": "1"}, tmp_path, None)
    assert "TFT_INJECT" not in env and env["A"] == "1"
    assert env["TFT_INJECT_STATE_DIR"] == str(tmp_path / "inject-state")
    env = drill.pass_env({}, tmp_path, "kill:rank=1,step=2,phase=backward",
                         drill.hang_env(parse_args(["--timeout", "60", "--", "x"])))
    assert env["TFT_INJECT"] == "kill:rank=1,step=2,phase=backward"
    assert (env["TTP_HANG_TIMEOUT_MIN"], env["TFT_INJECT_HANG_SECONDS"]) == ("5", "30")


# --- the certificate from events -------------------------------------------------------


def test_a_replica_repair_is_ok():
    events = [*start(), it(1, 1), it(2, 2), it(3, 3), *fault(3.5, 3),
              *repaired(6.0, "recover", "replica", 3, 3), it(7.25, 4), it(8, 5), it(9, 6),
              *finish(9.5)]
    row = certify("kill", "kill:rank=1,step=3,phase=backward", PassResult(0, events), REFERENCE)
    assert row.ok and row.why == []
    assert (row.strategy, row.outcome, row.returncode) == ("recover/replica", "recovered", 0)
    assert row.recover_seconds == pytest.approx(3.75)
    assert (row.iterations_lost, row.losses, row.losses_identical) == (0, "identical", True)


def test_a_checkpoint_reload_counts_the_recomputed_iterations():
    events = [*start(), *(it(i, i) for i in range(1, 6)), *fault(5.5, 5),
              *repaired(8.0, "load_checkpoint", "checkpoint", 5, 3),
              *(it(5 + i, i) for i in range(4, 7)), *finish(12)]
    row = certify("uce:optimizer", "uce:...", PassResult(0, events), REFERENCE)
    assert row.ok and row.strategy == "load_checkpoint/checkpoint"
    assert row.iterations_lost == 2  # iterations 4 and 5 were logged again


def test_a_configuration_that_cannot_recover_says_why():
    why = "repair failed: rank 0: RuntimeError: no periodic checkpoint under /c to repair from"
    events = [*start(), it(1, 1), it(2, 2), *fault(2.5, 2),
              ev(2.6, "strategy", strategy="recover", lock_step=2, source="checkpoint",
                 faults={"1": "lost"}, incident=1),
              ev(7, "repair_failed", reason=why, incident=1),
              *finish(7, 1, "dump impossible: no healthy holder for dense shard 1")]
    row = certify("kill", "kill:rank=1,step=2,phase=backward", PassResult(1, events), REFERENCE)
    assert not row.ok and row.outcome == "failed" and row.recover_seconds is None
    assert row.why == [
        why, "the job exited 1: dump impossible: no healthy holder for dense shard 1",
        "losses not bit-identical to the fault-free pass: missing 3-6"]
    assert row.iterations_lost == 4
    table = drill.format_certificate([row])
    assert table.splitlines()[2].split() == [
        "kill", "recover/checkpoint", "failed", "1", "-", "4", "missing", "3-6", "FAIL"]
    assert f"kill (kill:rank=1,step=2,phase=backward): {why}" in table


def test_a_dump_is_not_a_recovery():
    events = [*start(), it(1, 1), it(2, 2), it(3, 3), *fault(3.5, 3),
              ev(4, "strategy", strategy="dump", lock_step=3, source="replica", faults={},
                 incident=1),
              ev(5, "dump_saved", 0, iteration=3, path="/c/iter_0000003"), *finish(5, 75, "dump")]
    row = certify("raise", "raise:...", PassResult(75, events), REFERENCE)
    assert row.outcome == "dumped" and not row.ok
    assert row.why[0].startswith("dumped, not recovered: a dying-gasp checkpoint of iteration 3 "
                                 "was saved in /c/iter_0000003 (exit 75)")


def test_a_recovery_with_other_losses_falls_short():
    events = [*start(), it(1, 1), it(2, 2), it(3, 3), *fault(3.5, 3),
              *repaired(6.0, "recover", "replica", 3, 3), it(7, 4), it(8, 5, 8.2000001),
              it(9, 6), *finish(9.5)]
    row = certify("kill", "kill:...", PassResult(0, events), REFERENCE)
    assert row.outcome == "recovered" and not row.ok
    assert row.why == ["losses not bit-identical to the fault-free pass: differ at 5"]


def test_a_fault_that_never_fired_and_a_timeout_and_a_silent_crash():
    quiet = [*start(), *(it(i, i) for i in range(1, 7)), *finish(7)]
    row = certify("kill", "kill:rank=9,step=3", PassResult(0, quiet), REFERENCE)
    assert not row.ok and "the fault never fired" in row.why[0]
    row = certify("hang", "hang:...", PassResult(None, quiet[:4], timed_out=True), REFERENCE,
                  timeout=30)
    assert row.outcome == "timeout"
    assert row.why[0] == "did not finish within 30 s: its process group was killed"
    crash = PassResult(1, [*start(), it(1, 1), *fault(1.5, 1)],
                       "step 1\nRuntimeError: boom\nerror_file: <N/A>\nbye\n")
    row = certify("kill", "kill:...", crash, REFERENCE)
    assert row.why[0] == "exit code 1; output: RuntimeError: boom"


def test_the_json_line_holds_every_row():
    good = certify("kill", "k", PassResult(0, [*start(), *(it(i, i) for i in range(1, 7)),
                                               *fault(6.5, 6), *finish(7)]), REFERENCE)
    line = json.loads(drill.certificate_json([good], workdir="/w"))
    assert line["ok"] is False and line["workdir"] == "/w"
    assert line["rows"][0]["fault"] == "kill" and line["rows"][0]["ok"] is False


def test_a_pass_past_its_timeout_loses_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    command = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    started = time.monotonic()
    result = drill.run_pass(command, dict(os.environ), tmp_path / "pass", timeout=1.0)
    assert result.timed_out and result.returncode is None
    assert time.monotonic() - started < 10
    status = Path(f"/proc/{int(pid_file.read_text())}/status")

    def gone() -> bool:  # the background child: gone, or dead and not yet reaped
        try:
            return "zombie" in status.read_text()
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 5
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()


# --- real drills -----------------------------------------------------------------------

HA = "--enable-high-availability --enable-worker-reboot --enable-hbmfault-repair"


def run_drill(tmp_path: Path, ha_args: str, *options: str) -> tuple[int, str, dict]:
    """The drill on the tiny CPU job (2 ranks, DP2, fp32, 6 iterations, a save every 3)
    under tft-run; its exit code, output and JSON line."""
    env = tiny_job_env(tmp_path / "run", train_iters=6, save_interval=3, ha_args=ha_args,
                       launcher="tft-run", precision="fp32", env={"NPROC": "2"})
    proc = subprocess.run(
        [sys.executable, "-m", "mindspeed_tft.drill", *options, "--iters", "6",
         "--timeout", "120", "--workdir", str(tmp_path / "drill"), "--",
         "bash", "scripts/pretrain_tiny_cpu.sh"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300)
    return proc.returncode, proc.stdout, json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.multiproc
def test_drill_certifies_a_configuration_that_recovers(tmp_path):
    code, output, certificate = run_drill(tmp_path, HA, "--faults", "kill,uce:optimizer")
    print(output)
    assert code == 0, output
    assert certificate["ok"] and (certificate["rank"], certificate["step"]) == (1, 3)
    rows = {row["fault"]: row for row in certificate["rows"]}
    assert list(rows) == ["kill", "uce:optimizer"]
    assert rows["kill"]["strategy"] == "recover/replica"
    assert rows["uce:optimizer"]["strategy"] == "retry/replica"
    for row in rows.values():
        assert row["ok"] and row["outcome"] == "recovered" and row["returncode"] == 0
        assert row["losses_identical"] and row["iterations_lost"] == 0
        assert 0 < row["recover_seconds"] < 60
    lines = output.splitlines()
    assert lines[-5].split()[0] == "fault" and lines[-4].startswith("-----")
    assert [line.split()[0] for line in lines[-3:-1]] == ["kill", "uce:optimizer"]
    assert [line.split()[-1] for line in lines[-3:-1]] == ["OK", "OK"]
    # the drill wrote its checkpoints in its passes' folders, never the command's own
    assert not (tmp_path / "run" / "ckpt").exists()
    assert (tmp_path / "drill" / "01-kill" / "ckpt" / "iter_0000006").is_dir()


@pytest.mark.multiproc
def test_drill_fails_a_configuration_that_cannot_recover(tmp_path):
    code, output, certificate = run_drill(
        tmp_path, f"{HA} --distributed-optimizer-no-replica", "--faults", "kill", "--step", "2")
    print(output)
    assert code == 1, output
    (row,) = certificate["rows"]
    assert not certificate["ok"] and not row["ok"]
    assert (row["strategy"], row["outcome"], row["returncode"]) == (
        "recover/checkpoint", "failed", 1)
    assert any("no periodic checkpoint under" in why for why in row["why"])
    assert "FAIL" in output and "no periodic checkpoint under" in output
