"""`scripts/demo.sh --hosts N`'s refusals: a `--hosts` that is not a number of hosts (2..64),
one beside `--megatron-lm`, and a user who is not root each get one clear line and exit code
2, before the demo sets up anything (no venv, no test bed, no run). The demo itself (3 hosts,
one lost and replaced) is run by hand: `sudo ./scripts/demo.sh --hosts 3`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "scripts" / "demo.sh"


def _demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEMO), *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("args", "line"), [
    (["--hosts"], "--hosts needs a number of hosts, 2 to 64"),
    (["--hosts", "1"], "--hosts 1: the multi-host demo needs 2 to 64 hosts"),
    (["--hosts=0"], "--hosts 0: the multi-host demo needs 2 to 64 hosts"),
    (["--hosts", "65"], "--hosts 65: the multi-host demo needs 2 to 64 hosts"),
    (["--hosts", "three"], "--hosts 'three': expected a number of hosts, 2 to 64"),
    (["--hosts", "-3"], "--hosts '-3': expected a number of hosts, 2 to 64"),
    (["--hosts", ""], "--hosts '': expected a number of hosts, 2 to 64"),
])
def test_a_hosts_that_is_no_number_of_hosts_is_refused_in_one_line(args, line):
    done = _demo(*args)
    assert done.returncode == 2, done.stderr
    first, *rest = done.stderr.splitlines()
    assert first == f"{DEMO}: {line}"
    assert rest[0].startswith("usage: ") and "--hosts N" in rest[0]
    assert not done.stdout  # nothing set up, nothing run


def test_hosts_beside_megatron_lm_is_refused(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("")
    done = _demo("--hosts", "3", "--megatron-lm", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"{DEMO}: --hosts runs the reference trainer only; leave out "
                           "--megatron-lm\n")
    assert not done.stdout


def test_hosts_without_root_says_so_in_one_line(tmp_path):
    """A user who is not root (here an `id` that says uid 1000) is told to use sudo."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text("#!/bin/sh\necho 1000\n")
    (fake / "id").chmod(0o755)
    done = _demo("--hosts", "3", env={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"{DEMO}: --hosts needs root (it makes network namespaces, veth "
                           f"pairs and a bridge): sudo {DEMO} --hosts 3\n")
    assert not done.stdout
