"""Multi-node jobs on a test bed of hosts (`mindspeed_tft.tools.testbed`): one `tft-run`
launcher per host (network namespace), each with the guide's multi-node settings: node 0's
address as `TTP_ADDR` and `--master-addr`, `GLOO_SOCKET_IFNAME=eth0`, one job token on every
node, CURVE keys from the key tool (the controller's folder on the nodes that run a
controller or a backup: 0, 1 and 2; the processor's on every node).

A machine where a bed cannot be made fails these tests with the one-line reason
(`testbed.unavailable`); `TFT_TESTBED=off` turns that into a skip with the same reason.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mindspeed_tft.control.wire.keys import generate_keys
from mindspeed_tft.tools.testbed import IFNAME, TestBed, unavailable
from tests.jobs import MEGATRON_LM_SCRIPT, REPO, TINY_SCRIPT, tiny_job_env, wait_event

#: the ports of the job: every host has a TCP stack of its own, so fixed ones do
MASTER_PORT, TTP_PORT = 29500, 8000


def need(reason: str | None) -> None:
    """A test the machine cannot run (`reason`, one line) fails with it; under
    TFT_TESTBED=off it is skipped with it. None: it can run."""
    if reason is None:
        return
    if os.environ.get("TFT_TESTBED") == "off":
        pytest.skip(f"TFT_TESTBED=off: {reason}")
    pytest.fail(f"{reason} (TFT_TESTBED=off skips the multi-node cells)", pytrace=False)


def make_bed(hosts: int) -> TestBed:
    """A bed of `hosts`, or the test fails (skips under TFT_TESTBED=off) with the reason."""
    reason = unavailable()
    need(None if reason is None else f"no test bed of hosts on this machine: {reason}")
    return TestBed(hosts)


class Cluster:
    """The launchers of one job on a bed, started host by host; `end()` kills what is left."""

    def __init__(self, bed: TestBed, run_dir: Path, *, nnodes: int, ha_args: str,
                 megatron_lm: Path | None = None, kubernetes: bool = False,
                 **job: Any) -> None:
        self.bed, self.run_dir, self.nnodes = bed, run_dir, nnodes
        #: the Kubernetes route's addresses too (configs/k8s): each node's controller binds
        #: its own address (`CONTROLLER_ADDR`), processors connect to node 0's
        #: (`PROCESSOR_ADDR`)
        self.kubernetes = kubernetes
        self.ha_args, self.megatron_lm, self.job = ha_args, megatron_lm, job
        self.token = secrets.token_hex(32)
        self.keys = generate_keys(str(run_dir / "keys"))
        self.procs: dict[int, subprocess.Popen] = {}
        self.outputs: dict[int, str] = {}
        self.events = run_dir / "events.jsonl"

    def env(self, node: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Node `node`'s environment (the guide's settings; `extra` last)."""
        role = "controller+processor" if node <= 2 else "processor"
        addr0 = self.bed.address(0)
        settings = {
            "NPROC": "2", "MASTER_PORT": str(MASTER_PORT), "TTP_PORT": str(TTP_PORT),
            "TTP_ADDR": addr0, "GLOO_SOCKET_IFNAME": IFNAME, "TTP_JOB_TOKEN": self.token,
            "TTP_LOG_PATH": str(self.run_dir / f"ttp_logs_node{node}"),
            **self.keys[role], **(extra or {}),
        }
        if self.kubernetes:
            settings = {"CONTROLLER_ADDR": self.bed.address(node), "PROCESSOR_ADDR": addr0,
                        **settings}
        if self.megatron_lm is not None:
            settings.update({"MEGATRON_LM": str(self.megatron_lm), "ENTRY": "",
                             "SCRIPT": "pretrain_gpt.py"})
        launcher = (f"tft-run --nnodes {self.nnodes} --node-rank {node} "
                    f"--master-addr {addr0}")
        job = dict(self.job)
        settings = {**settings, **job.pop("env", {})}
        return tiny_job_env(self.run_dir, ha_args=self.ha_args, launcher=launcher,
                            env=settings, **job)

    def start(self, node: int, host: int | None = None,
              extra: dict[str, str] | None = None) -> subprocess.Popen:
        """Start node `node`'s launcher on `host` (default: the host of the same number)."""
        script = MEGATRON_LM_SCRIPT if self.megatron_lm is not None else TINY_SCRIPT
        proc = self.bed.popen(node if host is None else host, ["bash", str(script)],
                              cwd=REPO, env=self.env(node, extra), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs[node] = proc
        return proc

    def wait(self, node: int, timeout: float) -> int:
        """Node `node`'s launcher's exit code (its output kept in `outputs` and a file)."""
        proc = self.procs[node]
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.end()
            output = self.outputs.get(node, "")
            raise AssertionError(f"node {node}'s launcher did not end within {timeout:g}s; "
                                 f"output tail:\n{output[-4000:]}") from None
        self._keep(node, output)
        return proc.returncode

    def replace_host(self, node: int) -> None:
        """Host `node` dies (its processes killed, its link down) and, once node 0's
        controller has said its launcher is silent (`node_silent`), comes back with a new
        launcher for the node, as Kubernetes recreates a lost pod."""
        self.bed.kill_host(node)
        self.wait(node, 30)
        wait_event(self.events, lambda e: e["event"] == "node_silent" and e["node"] == node,
                   60)
        self.bed.restore(node)
        self.start(node)

    def _keep(self, node: int, output: str) -> None:
        self.outputs[node] = self.outputs.get(node, "") + output
        (self.run_dir / f"node{node}.log").write_text(self.outputs[node])

    def end(self) -> None:
        """Kill every launcher still running with its process group."""
        for node, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                output, _ = proc.communicate()
                self._keep(node, output or "")


def node_processes(cluster: Cluster) -> Iterator[int]:
    """Every process of the job (its hosts' processes)."""
    for host in range(cluster.bed.hosts):
        yield from cluster.bed.pids(host)
