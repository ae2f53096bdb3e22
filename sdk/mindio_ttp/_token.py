"""The job's token on the SDK route: made by the controller that `tft_start_controller`
starts, handed to the job's ranks on this host, required of every REGISTER.

`tft-run` on one node makes a per-job token (`TTP_JOB_TOKEN`) and hands it to its workers
in their environment. A controller that MindSpeed-LLM's rank 0 (or a standalone process,
`tft_init_controller(-1, ...)`) starts has no children to hand it to: the ranks are its
siblings, started by torchrun or by hand. So when neither `TTP_JOB_TOKEN` nor CURVE keys are
given, `publish` makes a token, puts it into this process' environment (its own processor
and its children read it there, as tft-run's workers do) and writes it to a file that only
this user can read: `<tmp>/mindio_ttp-<uid>/controller-<ip>-<port>.token`, mode 0600, in a
folder of mode 0700 that this user owns (anything else there is refused, never used).
`read` / `wait_for` are the processor's side: a processor without a token of its own,
connecting to `ip:port`, takes the token from that file (waiting, bounded by
`TTP_REGISTER_TIMEOUT`, for a controller that starts beside it, as torchrun starts rank 0
and the others at once). Another user's process can read
neither, so its REGISTER is refused (`transport.token_ok`). The controller deletes the file
however it ends while Python runs (`withdraw`, through `process_exit.at_exit`: a dump's exit
75 and SIGTERM included). A SIGKILLed one cannot: the next controller on that address and
port replaces the file it finds, never reading it, and a processor that read the earlier
job's token before that and is refused takes the new one (`_runtime`).

Across hosts nothing is handed over: a controller on a non-loopback address needs CURVE keys
(`transport.check_bind`), and every node then sets `TTP_JOB_TOKEN` as with tft-run.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mindspeed_tft.control.wire.config import ControlConfigError

#: the name of the token's variable (read by `ControlConfig.from_env`, set here)
TOKEN_ENV = "TTP_JOB_TOKEN"


def folder() -> Path:
    """This user's private folder for tokens (created 0700; refused if not safe)."""
    path = Path(tempfile.gettempdir()) / f"mindio_ttp-{os.getuid()}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    _check_private(path, os.lstat(path), stat.S_ISDIR, "folder")
    return path


def token_path(ip: str, port: int) -> Path:
    """Where the token of the controller at `ip:port` is kept."""
    ip = ipaddress.ip_address(ip.strip("[]")).compressed.replace(":", "_")
    return folder() / f"controller-{ip}-{int(port)}.token"


def publish(ip: str, port: int) -> tuple[str, Path]:
    """Make the job's token for the controller at `ip:port`: set it in this process'
    environment and write it for the ranks (module docstring). Returns (token, file)."""
    token = secrets.token_hex(32)
    path = token_path(ip, port)
    # a new file of this process (0600, a name no earlier one has) replaces whatever is there
    fd, scratch = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(scratch, path)
    os.environ[TOKEN_ENV] = token
    return token, path


def read(ip: str, port: int) -> str | None:
    """The token a controller of this user published for `ip:port` (None: there is none)."""
    try:
        path = token_path(ip, port)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, ValueError):
        return None
    try:
        _check_private(path, os.fstat(fd), stat.S_ISREG, "file")
        raw = os.read(fd, 300).decode("ascii", "replace")
    finally:
        os.close(fd)
    if not (16 <= len(raw) <= 256 and raw.isascii() and raw.isprintable()):
        raise ControlConfigError(f"the job token file {path} does not hold a token (16..256 "
                                 "printable characters); delete it")
    return raw


def wait_for(ip: str, port: int, timeout: float) -> str:
    """`read`, waiting (at most `timeout` seconds) for a controller starting beside this
    rank to publish its token; ControlConfigError once the time is up."""
    deadline = time.monotonic() + timeout
    while (token := read(ip, port)) is None:
        if time.monotonic() > deadline:
            raise ControlConfigError(
                f"no job token for the controller at {ip}:{port} within {timeout:g}s: a "
                f"controller started by tft_start_controller writes it to "
                f"{token_path(ip, port)} when it starts (is it running, on this host, as this "
                "user?); or set TTP_JOB_TOKEN for the job, or CURVE keys")
        time.sleep(0.05)
    return token


def withdraw(path: Path | None, token: str | None = None) -> None:
    """Delete a published token file (the controller stopped); with `token`, only while the
    file still holds it (not a later controller's on the same port)."""
    if path is None:
        return
    try:
        if token is None or path.read_text() == token:
            path.unlink()
    except FileNotFoundError:
        pass


def _check_private(path: Path, st: os.stat_result, kind: Callable[[int], bool],
                   what: str) -> None:
    if not kind(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ControlConfigError(
            f"the job token {what} {path} is not a {what} of this user (uid {os.getuid()}) that "
            f"only this user can read (it has uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
            "); it is not used: remove it, or set TTP_JOB_TOKEN")
