"""What Linux's `/proc/<pid>/stat` says of a process that is exiting, before its parent can
reap it.

A process killed by a signal is not reapable at once: the kernel first releases its memory
(`exit_mm`), then closes its files, and only then makes it a zombie that `waitpid` reports.
Releasing the memory takes time that grows with it: here a 2.5 GB worker takes 0.2 s on an
idle machine and 0.7 s while three other processes compute (the ranks of a CPU job), and a
GPU worker also tears down its device context. From the moment the signal takes effect the
process has `PF_EXITING` in its flags and its `exit_code` holds the signal, so the launcher
sees the death at its next poll instead of at the reap, and the repair starts that much
earlier (`launcher.agent.TFTSubprocessContext._poll`). The controller reads the same fields
of the ranks that run in its own pid namespace (`identity` / `namespace`: a registration
says where its process runs), so under plain torchrun, where no launcher reports deaths, a
killed rank is lost as soon as the signal lands instead of after interval x misses of
silence (`control.controller.liveness`, `procwatch`).

Without procfs (another OS) or without the right to read `exit_code`, every function here
answers as for a process that is not exiting: the launcher then waits for the reap, as
torch's agent does.

It also reads what a warm spare sizes its memory reserve by (`warm_memory`): a field of
`/proc/<pid>/status` or `/proc/meminfo` (`kib`), and a process' children (`children`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: `PF_EXITING` of the kernel's task flags: set when the task starts to exit
PF_EXITING = 0x4
#: fields of /proc/<pid>/stat after the command name (field 3, the state, is index 0)
_FLAGS, _START, _EXIT_CODE = 9 - 3, 22 - 3, 52 - 3


@dataclass(frozen=True)
class ProcStat:
    """The fields of one `/proc/<pid>/stat` read that tell whether the process is ending."""

    state: str  # R, S, D, Z (zombie: ended, not reaped), X, ...
    flags: int
    exit_code: int  # waitpid's status once exiting: the signal in the low 7 bits
    start: int  # start time (clock ticks after boot): tells a reused pid from its process

    @property
    def exiting(self) -> bool:
        # the kernel shows exit_code only once exiting (it may read the flags a moment
        # before it sets PF_EXITING)
        return bool(self.flags & PF_EXITING) or self.exit_code != 0

    @property
    def killed_by(self) -> int | None:
        """`-signal` (Popen's returncode) once exiting because of a signal; else None."""
        signal_number = self.exit_code & 0x7F
        return -signal_number if self.exiting and signal_number else None

    @property
    def ended(self) -> bool:
        """Its memory and files are released (a zombie waiting for its parent, or dead)."""
        return self.state in ("Z", "X", "x")


def read_stat(pid: int) -> ProcStat | None:
    """The process' stat fields, or None when it does not exist (or there is no procfs)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    try:
        exit_code = int(fields[_EXIT_CODE]) if len(fields) > _EXIT_CODE else 0
        return ProcStat(state=fields[0], flags=int(fields[_FLAGS]), exit_code=exit_code,
                        start=int(fields[_START]))
    except (IndexError, ValueError):
        return None


def killed_returncode(pid: int) -> int | None:
    """`-signal` (Popen's returncode) for a process that a signal is ending, as soon as the
    signal takes effect; None for one still running, ending otherwise (an exit code: wait
    for the reap), or unknown."""
    stat = read_stat(pid)
    return None if stat is None else stat.killed_by


def has_ended(pid: int) -> bool:
    """True once `pid` released its memory and files (a zombie, or no such process)."""
    stat = read_stat(pid)
    return stat is None or stat.ended


def process_state(pid: int, start: int) -> tuple[bool, int | None]:
    """(running, returncode) of the process `pid` that started at `start`: running while it
    is neither exiting nor ended; once not, `-signal` when a signal ends it (seen as soon as
    the signal takes effect), else None (an exit code, a process already reaped, or a pid
    that now names a process of another start time)."""
    stat = read_stat(pid)
    if stat is None or stat.start != start:
        return False, None
    if not (stat.exiting or stat.ended):
        return True, None
    return False, stat.killed_by


def namespace() -> str | None:
    """The pid namespace this process runs in, unique across machines and boots: the boot's
    id and the namespace's device and inode (None without procfs). Two processes that see
    each other's pids have the same one (a container of its own has another)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}:{ns.st_dev}:{ns.st_ino}" if boot else None


def identity() -> str | None:
    """This process, unique on its machine even after its pid is reused: `namespace()`,
    pid and start time, as "NAMESPACE:PID:START" (None without procfs)."""
    where, stat = namespace(), read_stat(os.getpid())
    return None if where is None or stat is None else f"{where}:{os.getpid()}:{stat.start}"


def local_start(proc: str | None, pid: int, here: str | None) -> int | None:
    """The start time in `proc` (another process' `identity()`) when that process is `pid`
    in the namespace `here` (this process' `namespace()`), so this process can read its
    stat; else None."""
    if not proc or here is None:
        return None
    where, _, rest = proc.rpartition(":")
    where, _, claimed = where.rpartition(":")
    if where != here or claimed != str(pid) or not rest.isdigit():
        return None
    return int(rest)


def kib(path: str, field: str) -> int | None:
    """A `kB` field of a procfs file such as `/proc/<pid>/status` or `/proc/meminfo`
    (None without the file, the process or the field)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def children(pid: int) -> list[int]:
    """The child processes of `pid`, from each of its threads' `children` file (empty
    without procfs or without that file)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                found.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return found
