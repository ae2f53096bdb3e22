"""The multi-host demo (`scripts/demo.sh --hosts N`, root): one tiny job over N hosts of a
test bed (`mindspeed_tft.tools.testbed`: network namespaces on a bridge, each with its own
`eth0` and address), 2 CPU ranks per host, one `tft-run` launcher per host with the
multi-node settings of the usage guide. Partway through training the last host dies (all its
processes SIGKILLed, its link down: nobody reports it, the controller on node 0 notices the
silence); its link comes back and a replacement launcher for that node starts on it, as
Kubernetes recreates a lost pod with the same index; the job takes it back and finishes.
Then the report of what happened (`tft-report` on the events file), and the same job without
a fault on the same hosts, whose losses the recovered job's must equal bit for bit.

Every host's whole output lies in DEMO_DIR/faulty/host<N>.log; the screen shows it line by
line, each line prefixed with its host. Exit code 0 when the job recovered and finished every
iteration with the fault-free losses, 1 when it did not, 2 when this machine cannot make a
test bed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mindspeed_tft.control.wire.keys import generate_keys
from mindspeed_tft.events import read_events_if_any
from mindspeed_tft.tools.testbed import IFNAME, TestBed, unavailable

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "scripts" / "pretrain_tiny_cpu.sh"
#: seconds the controller waits for a lost node's replacement before it gives up on its
#: ranks (the one place to change it: both names the controller may read are set from it)
REPLACEMENT_WAIT_S = 120
#: ranks per host; the global batch (micro-batch 2) is one micro-batch per rank
NPROC = 2
#: every host has a TCP stack of its own, so every host uses the same fixed ports
MASTER_PORT, TTP_PORT = 29500, 8000
#: the one-host demo's high-availability flags
HA_ARGS = "--enable-high-availability --enable-hbmfault-repair --enable-worker-reboot"
#: how long the job may take in all (start-up, the loss, the replacement, the end)
JOB_TIMEOUT_S = 600
#: how long the other launchers may run on once node 0's (the controller's) ended
AFTER_NODE_0_S = 60
#: a launcher's exit code when the job ended with its dying-gasp checkpoint
DUMP_EXIT_CODE = 75


#: one line at a time on the screen (the hosts' output comes from threads)
_SCREEN = threading.Lock()


def show_line(line: str) -> None:
    with _SCREEN:
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        sys.stdout.flush()


def say(text: str = "") -> None:
    show_line(f"[demo] {text}" if text else "")


class Job:
    """The launchers of one job on a bed, one per host; their output on the screen."""

    def __init__(self, bed: TestBed, run_dir: Path, train_iters: int, save_interval: int,
                 *, echo: bool = True):
        self.bed, self.run_dir, self.nnodes, self.echo = bed, run_dir, bed.hosts, echo
        run_dir.mkdir(parents=True, exist_ok=True)
        self.addr0 = bed.address(0)
        self.token = secrets.token_hex(32)
        self.keys = generate_keys(str(run_dir / "keys"))
        self.events = run_dir / "events.jsonl"
        self.procs: dict[int, subprocess.Popen] = {}
        self._readers: list[threading.Thread] = []
        self.common = {
            # the tiny job (scripts/pretrain_tiny_cpu.sh's knobs)
            "NPROC": str(NPROC), "GBS": str(NPROC * 2 * bed.hosts),
            "TRAIN_ITERS": str(train_iters), "SAVE_INTERVAL": str(save_interval),
            "HA_ARGS": HA_ARGS, "RUN_DIR": str(run_dir), "MASTER_PORT": str(MASTER_PORT),
            # the controller waits this long for a lost node's ranks to come back
            "TFT_REPLACEMENT_WAIT": str(REPLACEMENT_WAIT_S),
            "TFT_NODE_REPLACEMENT_WAIT": str(REPLACEMENT_WAIT_S),
        }

    def settings(self, node: int) -> dict[str, str]:
        """What node `node` needs beyond the job's common settings: the multi-node ones."""
        role = "controller+processor" if node <= 2 else "processor"
        return {
            "TTP_ADDR": self.addr0, "TTP_PORT": str(TTP_PORT), "GLOO_SOCKET_IFNAME": IFNAME,
            "TTP_JOB_TOKEN": self.token, **self.keys[role],
            "TTP_LOG_PATH": str(self.run_dir / f"ttp_logs_node{node}"),
            "LAUNCHER": f"tft-run --nnodes {self.nnodes} --node-rank {node} "
                        f"--master-addr {self.addr0}",
        }

    def show(self) -> None:
        """Print what every host runs: the lesson of the multi-node set-up."""
        def shown(title: str, env: dict[str, str]) -> None:
            items = [f"{k}={shlex.quote(v.replace(str(self.run_dir), '$RUN'))}"
                     for k, v in env.items()]
            line = f"  {title}:"
            for item in items:
                if len(line) + len(item) > 92 and not line.endswith(":"):
                    say(line)
                    line = "   "
                line += f" {item}"
            say(line)

        nodes = [self.settings(node) for node in range(self.nnodes)]
        same = {k: v for k, v in nodes[0].items() if all(n[k] == v for n in nodes)}
        same["TTP_JOB_TOKEN"] = "<one secret of the job, the same on every host>"
        say(f"RUN={self.run_dir}; every host runs {TRAIN.relative_to(REPO)} with")
        shown("the job's settings", self.common)
        shown("the multi-node ones", same)
        say("  (CURVE keys by `python -m mindspeed_tft.control.keys $RUN/keys`: both folders "
            "on the nodes of")
        say(f"  the controller and its backups, 0 to {min(2, self.nnodes - 1)}; keys/processor "
            "only on the others)")
        for node, env in enumerate(nodes):
            shown(f"host {node} ({self.bed.address(node)})",
                  {k: v for k, v in env.items() if k not in same})
        say(f"  so that host N runs: $LAUNCHER --nproc-per-node {NPROC} --master-port "
            f"{MASTER_PORT} pretrain_gpt.py")
        say("    <the tiny model's flags> $HA_ARGS --save $RUN/ckpt ...")

    def start(self, node: int, note: str = "") -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("TFT_INJECT", "HIGH_AVAILABILITY")}
        env = {**env, **self.common, **self.settings(node),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "PYTHONUNBUFFERED": "1"}
        proc = self.bed.popen(node, ["bash", str(TRAIN)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", start_new_session=True)
        self.procs[node] = proc
        reader = threading.Thread(target=self._relay, args=(node, proc, note), daemon=True)
        reader.start()
        self._readers.append(reader)

    def _relay(self, node: int, proc: subprocess.Popen, note: str) -> None:
        """Node `node`'s output to its log file and, prefixed, to the screen."""
        with open(self.run_dir / f"host{node}.log", "a") as log:
            if note:
                log.write(f"--- {note}\n")
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if self.echo:
                    show_line(f"[host {node}] {line}")

    def iteration(self) -> int:
        """The last iteration the job logged (0 before the first)."""
        done = [e["iteration"] for e in read_events_if_any(self.events)
                if e["event"] == "iteration"]
        return max(done, default=0)

    def wait_for(self, what: str, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            if self.procs[0].poll() is not None:
                say(f"node 0's launcher ended (exit code {self.procs[0].returncode}) while "
                    f"waiting for {what}")
                return False
            time.sleep(0.2)
        say(f"no {what} within {timeout:g} s")
        return False

    def finish(self, timeout: float) -> str | None:
        """Wait for every launcher to end (the others at most `AFTER_NODE_0_S` after node
        0's, which hosts the controller); why the job failed, or None."""
        codes: dict[int, int | str] = {}
        for node in range(self.nnodes):
            try:
                codes[node] = self.procs[node].wait(timeout if node == 0 else AFTER_NODE_0_S)
            except subprocess.TimeoutExpired:
                if node == 0:
                    return f"node 0's launcher did not end within {timeout:g} s"
                codes[node] = f"still running {AFTER_NODE_0_S} s after node 0's end"
        if not any(codes.values()):
            return None
        why = f"the launchers' exit codes {codes}"
        if DUMP_EXIT_CODE in codes.values():
            why += f" ({DUMP_EXIT_CODE}: the job stopped with its dying-gasp checkpoint)"
        return why

    def end(self) -> None:
        """Kill the launchers still running, with their process groups (the bed's teardown
        kills what is left on its hosts: workers run in sessions of their own)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        for reader in self._readers:  # their last lines, unless a worker still holds a pipe
            reader.join(timeout=max(0.0, deadline - time.monotonic()))


def run(hosts: int, demo_dir: Path, train_iters: int, save_interval: int) -> int:
    lost = hosts - 1
    lost_ranks = list(range(lost * NPROC, (lost + 1) * NPROC))
    at = max(2, train_iters * 2 // 5)
    with TestBed(hosts) as bed:
        say(f"1/3: {hosts} hosts (network namespaces {bed.namespace(0)}..{bed.namespace(lost)} "
            f"on the bridge {bed.bridge}), {NPROC} CPU ranks each: DP={hosts * NPROC}, "
            f"distributed optimizer with 2 replicas; {train_iters} iterations")
        say(f"     host {lost} (ranks {lost_ranks}) dies after iteration {at}: every process "
            "on it SIGKILLed, its link down; then a replacement launcher starts there")
        job = Job(bed, demo_dir / "faulty", train_iters, save_interval)
        job.show()
        say()
        try:
            failed = lose_a_host(job, lost, lost_ranks, at)
        finally:
            job.end()
        say()
        say(f"2/3: what happened (from {job.events})")
        timeline = job.run_dir / "timeline.png"
        subprocess.run([sys.executable, "-m", "mindspeed_tft.report", str(job.events),
                        "--plot", str(timeline)], check=False)
        say(f"every host's output: {job.run_dir}/host<N>.log; the control plane's logs: "
            f"{job.run_dir}/ttp_logs_node<N>")
        failed = failed or missing_iterations(job, train_iters)
        if failed is not None:
            say(f"the job did NOT recover from the loss of host {lost}: {failed}")
            return 1
        say()
        say("3/3: the same training without a fault on the same hosts, for comparison")
        reference = Job(bed, demo_dir / "fault-free", train_iters, save_interval, echo=False)
        try:
            for node in range(hosts):
                reference.start(node)
            failed = reference.finish(JOB_TIMEOUT_S) or missing_iterations(reference,
                                                                          train_iters)
        finally:
            reference.end()
        if failed is not None:
            say(f"the fault-free run failed: {failed} (its output: "
                f"{reference.run_dir}/host<N>.log)")
            return 1
    compare = subprocess.run([sys.executable, "-m", "mindspeed_tft.report", str(job.events),
                              "--compare", str(reference.events), "--plot", str(timeline)],
                             capture_output=True, text=True, check=False)
    show_line(compare.stdout.strip().splitlines()[-1] if compare.stdout.strip() else
              compare.stderr.strip())
    if compare.returncode != 0:
        say("the recovered job's losses differ from the fault-free run's")
        return 1
    strategies = [e["strategy"] for e in read_events_if_any(job.events)
                  if e["event"] == "strategy"]
    say(f"host {lost} was lost and replaced; the job recovered ({', '.join(strategies)}) and "
        f"trained all {train_iters} iterations with the fault-free run's losses")
    say(f"recovery timeline (with the fault-free run's loss): {timeline}")
    return 0


def lose_a_host(job: Job, lost: int, lost_ranks: list[int], at: int) -> str | None:
    """Start the job, kill host `lost` after iteration `at`, start its replacement once the
    controller noticed, wait for the end; why the job failed, or None."""
    for node in range(job.nnodes):
        job.start(node)
    if not job.wait_for(f"iteration {at}", lambda: job.iteration() >= at, 300):
        return "the job did not reach the iteration of the loss"
    say(f"host {lost} dies now (iteration {job.iteration()} logged): its processes are "
        "killed, its link goes down")
    job.bed.kill_host(lost)
    try:
        job.procs[lost].wait(timeout=30)
    except subprocess.TimeoutExpired:
        return f"host {lost}'s launcher outlived the loss of its host"

    def noticed() -> dict | None:
        """The controller's word on the loss: its launcher silent (`node_silent`, with its
        decision), or, from a controller that says nothing of launchers, its ranks lost."""
        events = read_events_if_any(job.events)
        silent = next((e for e in events
                       if e["event"] == "node_silent" and e.get("node") == lost), None)
        lost_event = next((e for e in events if e["event"] == "fault_detected"
                           and set(e.get("ranks", [])) & set(lost_ranks)), None)
        if silent is None and lost_event is not None and time.time() - lost_event["time"] < 15:
            return None
        return silent or lost_event

    if not job.wait_for("detection of the lost host", noticed, 120):
        return "the controller did not notice the lost host"
    event = noticed()
    if event["event"] == "node_silent":
        say(f"the controller noticed: node {lost}'s launcher silent for {event['silent_s']} s "
            f"(ranks {event['ranks']}); decision: {event['decision']}"
            + (f", up to {event['wait_s']:g} s for a replacement launcher "
               "(TFT_NODE_REPLACEMENT_WAIT)" if "wait_s" in event else ""))
    else:
        say(f"the controller noticed: {event['kind']} on rank(s) {event['ranks']}: "
            f"{event.get('message', '')[:80]}")
    job.bed.restore(lost)
    say(f"host {lost} is back (link up) and a replacement launcher starts there with the same "
        f"node rank ({lost}), as Kubernetes recreates a lost pod")
    job.start(lost, note="the replacement launcher")
    return job.finish(JOB_TIMEOUT_S)


def missing_iterations(job: Job, train_iters: int) -> str | None:
    """Why the job's iterations are not 1..train_iters, or None."""
    done = sorted({e["iteration"] for e in read_events_if_any(job.events)
                   if e["event"] == "iteration"})
    if done == list(range(1, train_iters + 1)):
        return None
    return f"iterations logged: {done}, not 1..{train_iters}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3, help="hosts of the bed (2..64)")
    parser.add_argument("--demo-dir", type=Path, default=REPO / "runs" / "demo-hosts")
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument("--save-interval", type=int, default=10)
    args = parser.parse_args(argv)
    if not 2 <= args.hosts <= 64:
        parser.error(f"--hosts {args.hosts}: the demo needs 2 to 64 hosts")
    # a kill or a closed terminal ends the demo through the bed's teardown, like Ctrl-C
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, lambda signum, frame: sys.exit(128 + signum))
    reason = unavailable()
    if reason is not None:
        print(f"{parser.prog}: cannot run the {args.hosts}-host demo here: {reason}",
              file=sys.stderr)
        return 2
    return run(args.hosts, args.demo_dir.resolve(), args.train_iters, args.save_interval)


if __name__ == "__main__":
    sys.exit(main())
