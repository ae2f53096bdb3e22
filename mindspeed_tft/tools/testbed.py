"""A test bed of hosts on one machine: Linux network namespaces on a bridge, each "host" with
its own interface (`eth0`), private address and TCP stack, so that a multi-node job runs as on
a cluster (node 0's address as `TTP_ADDR`, `GLOO_SOCKET_IFNAME=eth0`, CURVE off loopback) and
meets the failures only a network has: a host cut off while its processes live on
(`cut`/`restore`: its link down and up), a slow link (`slow`: `tc ... tbf`, which every
kernel has), and a small file system (`small_folder`: a tmpfs).

Everything it makes carries one run's name (`tftb` + 4 hex digits), and a record of it (the
creating process' pid) lies in `STATE_DIR`; `TestBed.__exit__` and `atexit` tear it down
(the processes in its namespaces are killed first), and a new bed removes what a killed run
left (records whose process is gone, and names of ours with no record). Needs root and
`ip` (iproute2) and `tc`; `unavailable()` says in one line why a machine cannot run it.

    tft-testbed up --hosts 3             # prints the bed's name and each host's address
    tft-testbed exec NAME 1 -- CMD...    # CMD on host 1
    tft-testbed cut NAME 1 / restore NAME 1 / slow NAME 1 10mbit / down NAME

Tests and `scripts/demo.sh --hosts 3` use the class: `with TestBed(3) as bed: bed.popen(1, cmd)`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

#: every name of a bed starts with this (links: at most 15 characters, so the run id is short)
PREFIX = "tftb"
#: a bed's record: `<name>.json` with the creating pid, its hosts and its subnet
STATE_DIR = Path("/run/tft-testbed")
#: the interface name inside every host
IFNAME = "eth0"
#: per-namespace files `ip netns exec` mounts over /etc (each host's /etc/hosts names every
#: host of its bed, so that reverse lookups of peers answer at once)
NETNS_ETC = Path("/etc/netns")


class TestBedError(RuntimeError):
    """A command of the bed failed (the command and its output in the message)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise TestBedError(f"ip {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def unavailable() -> str | None:
    """Why this machine cannot run a bed (one line), or None when it can."""
    if os.geteuid() != 0:
        return "the test bed needs root (network namespaces, veth pairs, a bridge)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the test bed needs `{tool}` (iproute2) on PATH"
    probe = f"{PREFIX}probe{os.getpid() % 10000}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _our_names() -> tuple[set[str], set[str]]:
    """The namespaces and links of any bed on this machine (ours by prefix)."""
    spaces = {line.split()[0] for line in _ip("netns", "list").stdout.splitlines()
              if line.startswith(PREFIX)}
    links = set()
    for line in _ip("-o", "link", "show").stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            links.add(name)
    return spaces, links


def _kill_namespace(space: str) -> None:
    """Kill every process in `space`, then delete it (a namespace lives on while a process
    holds it)."""
    pids = _ip("netns", "pids", space, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", space, check=False)
    shutil.rmtree(NETNS_ETC / space, ignore_errors=True)


def remove_stale() -> list[str]:
    """Tear down what beds of processes that are gone left behind; returns their names."""
    records = {p.stem: p for p in STATE_DIR.glob(f"{PREFIX}*.json")} if STATE_DIR.is_dir() else {}
    live = set()
    for name, path in records.items():
        try:
            pid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            pid = -1
        if pid > 0 and _alive(pid):
            live.add(name)
    spaces, links = _our_names()
    removed = set()
    for space in spaces:
        if not any(space.startswith(name) for name in live):
            _kill_namespace(space)
            removed.add(space[:len(PREFIX) + 4])
    for link in links:
        if not any(link.startswith(name) for name in live):
            _ip("link", "del", link, check=False)
            removed.add(link[:len(PREFIX) + 4])
    for etc in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else ():
        if not any(etc.name.startswith(name) for name in live):
            shutil.rmtree(etc, ignore_errors=True)
    for name, path in records.items():
        if name not in live:
            path.unlink(missing_ok=True)
            removed.add(name)
    return sorted(removed)


def _free_subnet() -> ipaddress.IPv4Network:
    """A private /24 that no route of this machine touches."""
    routes = _ip("-4", "route", "show", "table", "all").stdout + _ip("-4", "addr").stdout
    taken = []
    for word in routes.split():
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(word, strict=False))
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{random.randrange(100, 250)}.{random.randrange(256)}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise TestBedError("no free private /24 for the test bed")


class TestBed:
    """N hosts (0..N-1) as network namespaces on one bridge; a context manager that always
    tears down."""

    __test__ = False  # not a pytest class

    def __init__(self, hosts: int, *, name: str | None = None) -> None:
        if not 1 <= hosts <= 64:
            raise ValueError(f"hosts={hosts}: a test bed has 1..64 hosts")
        self.hosts = hosts
        self.name = name or f"{PREFIX}{os.urandom(2).hex()}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.record = STATE_DIR / f"{self.name}.json"
        self._up = False

    # -- names --------------------------------------------------------------------------
    def namespace(self, host: int) -> str:
        """The network namespace of `host`."""
        return f"{self.name}h{host}"

    def address(self, host: int) -> str:
        """The private address of `host` on the bed's bridge."""
        if self.subnet is None:
            raise TestBedError(f"test bed {self.name} is not up")
        return str(self.subnet.network_address + 2 + host)

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    def _veth(self, host: int) -> str:
        return f"{self.name}v{host}"

    # -- life -----------------------------------------------------------------------------
    def __enter__(self) -> TestBed:
        self.up()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def up(self) -> TestBed:
        """Make the bridge and the hosts (stale beds removed first)."""
        reason = unavailable()
        if reason is not None:
            raise TestBedError(reason)
        remove_stale()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.subnet = _free_subnet()
        self.record.write_text(json.dumps({"pid": os.getpid(), "hosts": self.hosts,
                                           "subnet": str(self.subnet)}))
        self._up = True
        atexit.register(self.down)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for host in range(self.hosts):
                self._add_host(host)
            names = "".join(f"{self.address(h)} {self.namespace(h)}\n" for h in range(self.hosts))
            for host in range(self.hosts):
                etc = NETNS_ETC / self.namespace(host)
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
        except BaseException:
            self.down()
            raise
        return self

    def _add_host(self, host: int) -> None:
        space, veth, peer = self.namespace(host), self._veth(host), f"{self._veth(host)}p"
        _ip("netns", "add", space)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", space)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("-n", space, "link", "set", peer, "name", IFNAME)
        _ip("-n", space, "addr", "add", f"{self.address(host)}/24", "dev", IFNAME)
        _ip("-n", space, "link", "set", IFNAME, "up")
        _ip("-n", space, "link", "set", "lo", "up")

    def down(self) -> None:
        """Kill every process on the bed's hosts and remove everything it made (idempotent)."""
        if not self._up:
            return
        self._up = False
        for host in range(self.hosts):
            _kill_namespace(self.namespace(host))
            _ip("link", "del", self._veth(host), check=False)
        _ip("link", "del", self.bridge, check=False)
        self.record.unlink(missing_ok=True)

    # -- use ------------------------------------------------------------------------------
    def command(self, host: int, cmd: Sequence[str]) -> list[str]:
        """`cmd` as run on `host`."""
        return ["ip", "netns", "exec", self.namespace(host), *cmd]

    def popen(self, host: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start `cmd` on `host` (`subprocess.Popen`'s keyword arguments)."""
        return subprocess.Popen(self.command(host, cmd), **kwargs)

    def run(self, host: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run `cmd` on `host` to its end (`subprocess.run`'s keyword arguments)."""
        return subprocess.run(self.command(host, cmd), **kwargs)

    def cut(self, host: int) -> None:
        """`host` drops off the network (its link down); its processes live on."""
        _ip("-n", self.namespace(host), "link", "set", IFNAME, "down")

    def restore(self, host: int) -> None:
        """`host`'s link comes back (its route with it)."""
        _ip("-n", self.namespace(host), "link", "set", IFNAME, "up")

    def slow(self, host: int, rate: str = "10mbit") -> None:
        """`host`'s link limited to `rate` both ways (a token bucket on its `eth0` for what it
        sends, on the bridge's end of its link for what it receives); `rate=""` lifts it."""
        for namespace, dev in ((["-n", self.namespace(host)], IFNAME), ([], self._veth(host))):
            subprocess.run(["tc", *namespace, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)
            if not rate:
                continue
            done = subprocess.run(["tc", *namespace, "qdisc", "add", "dev", dev, "root", "tbf",
                                   "rate", rate, "burst", "32kbit", "latency", "400ms"],
                                  capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise TestBedError(f"tc tbf {rate} on host {host} ({dev}): "
                                   f"{done.stderr.strip()}")

    def pids(self, host: int) -> list[int]:
        """The processes running on `host`."""
        return [int(p) for p in _ip("netns", "pids", self.namespace(host), check=False)
                .stdout.split()]

    def kill_host(self, host: int) -> None:
        """`host` dies: every process on it is SIGKILLed and its link goes down."""
        self.cut(host)
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def small_folder(path: Path, size: str) -> Iterator[Path]:
    """`path` as a tmpfs of `size` (e.g. `"2m"`): a file system that fills up; unmounted at
    the end."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                           str(path)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise TestBedError(f"mount tmpfs of {size} on {path}: {done.stderr.strip()}")
    try:
        yield path
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(path)], capture_output=True,
                              timeout=30).returncode == 0:
                break
            time.sleep(0.1)


# -- command line ---------------------------------------------------------------------------
def _load(name: str) -> TestBed:
    record = STATE_DIR / f"{name}.json"
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        raise SystemExit(f"tft-testbed: no test bed named {name!r} ({record} missing)") from None
    bed = TestBed(int(data["hosts"]), name=name)
    bed.subnet = ipaddress.IPv4Network(data["subnet"])
    bed._up = True
    return bed


def _host(bed: TestBed, text: str) -> int:
    if not text.isdigit() or int(text) >= bed.hosts:
        raise SystemExit(f"tft-testbed: host {text!r}: the bed {bed.name} has hosts "
                         f"0..{bed.hosts - 1}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tft-testbed", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make a bed; it stays until `down` (needs root)")
    up.add_argument("--hosts", type=int, default=2)
    for command in ("down", "exec", "cut", "restore", "slow"):
        one = sub.add_parser(command)
        one.add_argument("name")
        if command != "down":
            one.add_argument("host")
        if command == "slow":
            one.add_argument("rate", help="e.g. 10mbit; '' lifts the limit")
        if command == "exec":
            one.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "up":
        bed = TestBed(args.hosts).up()
        atexit.unregister(bed.down)
        bed.record.write_text(json.dumps({"pid": 1, "hosts": bed.hosts,  # pid 1: kept
                                          "subnet": str(bed.subnet)}))
        print(bed.name)
        for host in range(bed.hosts):
            print(f"host {host}: {bed.namespace(host)} {bed.address(host)} ({IFNAME})")
        return 0
    bed = _load(args.name)
    if args.command == "down":
        bed.down()
        return 0
    host = _host(bed, args.host)
    if args.command == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return bed.run(host, cmd).returncode
    if args.command == "slow":
        bed.slow(host, args.rate)
    else:
        getattr(bed, args.command)(host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
