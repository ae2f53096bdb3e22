"""Configuration of the control plane (SPEC 4), read from the environment.

One dataclass, `ControlConfig`, holds everything the controller and the processors need:
addresses, port, heartbeat timing, action time limit, hang watchdog, backups, CURVE key
files and logging. `ControlConfig.from_env()` builds it from the environment:

| variable | meaning | default | invalid value |
| --- | --- | --- | --- |
| `TTP_ADDR` | controller address (IPv4 or IPv6 literal) | 127.0.0.1 | error |
| `CONTROLLER_ADDR` | address the controller binds (overrides `TTP_ADDR`) | TTP_ADDR | error |
| `PROCESSOR_ADDR` | address processors connect to (overrides `TTP_ADDR`) | TTP_ADDR | error |
| `TTP_PORT` | controller port, 1..65535 | 8000 | error |
| `TTP_HEARTBEAT_INTERVAL` | seconds between heartbeats, 0.05..60 | 2 | error |
| `TTP_HEARTBEAT_MISSES` | missed intervals before a rank is lost, 1..100 | 3 | error |
| `TTP_NORMAL_ACTION_TIME_LIMIT` | seconds an action callback may take, 30..1800 | 180 | error |
| `TFT_REPLACEMENT_WAIT` | seconds an incident waits for a lost rank's restarted process before it gives up on it (dump, or with elastic training a shrink), 1..1800 | the action time limit | error |
| `TFT_NODE_REPLACEMENT_WAIT` | seconds a lost rank whose node's launcher fell silent too (a host lost or cut off, `tft-run` on several nodes) waits for a replacement launcher (Kubernetes recreating the pod), 0..1800; 0: no launcher is coming, the incident decides at once (the dump, or with elastic training the shrink) | 0 | error |
| `TTP_REGISTER_TIMEOUT` | seconds for all ranks to register, 1..86400 | 600 | error |
| `TTP_HANG_TIMEOUT_MIN` | floor of the hang timeout in seconds, 0.1..86400 | 60 | error |
| `TTP_HANG_TIMEOUT_FACTOR` | hang timeout = factor x slowest recent step, 1..1000 | 5 | error |
| `TTP_HANG_INITIAL_TIMEOUT` | hang timeout before the first step, 1..86400 | 1800 | error |
| `TTP_PARK_TIMEOUT` | seconds a stopped rank's training thread has to come back before it is hung, 0.5..900 | 30 | error |
| `TTP_EXIT_GRACE` | seconds an exit order gives the training thread before the process ends, 0.5..600 | 10 | error |
| `TTP_CONTROLLER_LOST_TIMEOUT` | seconds a registered rank goes on with no active controller (none answering, backups included) before it exits with code 77; at least a failover (3 x interval x misses + 2 x interval), at most 3600 | 120 (or that failover time if longer) | error |
| `TTP_BACKUP_ADDRS` | up to 2 backup controllers, `ip:port,[v6]:port` | none | error |
| `TTP_CURVE_SERVER_KEY` | server certificate: `server.key_secret` on controller and backup hosts, the public `server.key` on worker-only nodes | off | error |
| `TTP_CURVE_CLIENT_KEY` | client secret certificate (processors) | none | error |
| `TTP_CURVE_AUTHORIZED_KEYS` | client public certificate file or folder the controller accepts | the client key | error |
| `TTP_JOB_TOKEN` | per-job secret every REGISTER (and backup) must carry, 16..256 printable characters; `tft-run` on one node makes one when unset | none | error |
| `TTP_ALLOW_INSECURE` | 1: let a controller bind a non-loopback address without CURVE, and the metrics endpoint a non-loopback `TFT_METRICS_ADDR` (warned on every start) | 0 | error |
| `TFT_METRICS_PORT` | port of the active controller's metrics endpoint (OpenMetrics / Prometheus text, `control/controller/metrics.py`; needs `pip install mindspeed-tft[metrics]`); `--tft-metrics-port` sets it; 0 or unset: off, 1..65535 | off | error |
| `TFT_METRICS_ADDR` | address the metrics endpoint binds (IPv4 or IPv6 literal); a non-loopback one only with `TTP_ALLOW_INSECURE=1` | 127.0.0.1 | error |
| `TFT_CONTROL_NICE` | nice value the control plane's threads ask for (controller loop, processor I/O, their ZeroMQ I/O threads; `control/wire/priority.py`), -20..0; 0: leave them at the process's priority; below it needs CAP_SYS_NICE or RLIMIT_NICE, and where refused the log says so once | -10 | error |
| `TFT_CONTROL_RTPRIO` | real-time priority (`SCHED_RR`) the same threads ask for, 0..99; 0: the normal policy; needs CAP_SYS_NICE or RLIMIT_RTPRIO, and where refused the log says so once | 1 | error |
| `TTP_LOG_PATH` | log folder (file `ttp_log.log`) | logs | - |
| `TTP_LOG_LEVEL` | DEBUG, INFO, WARNING, ERROR | INFO | error |
| `TTP_LOG_MODE` | ONLY_ONE (one file) or PER_PROC (one file per process) | ONLY_ONE | error |
| `TTP_LOG_STDOUT` | 0 or 1 | 0 | error |

`TTP_ADDR` names the controller; `CONTROLLER_ADDR` and `PROCESSOR_ADDR` override it per role:
the controller binds `controller_addr` (it may be a wildcard such as 0.0.0.0 or ::), the
processors connect to `processor_addr` (never a wildcard). The range checks apply to values
read from the environment; code (tests) may set shorter times through the constructor.
Every variable is checked when the configuration is read, at start-up: a value that cannot
be used stops the start with an error naming the variable and what is allowed; nothing
falls back silently.

The metrics endpoint has no authentication (CURVE covers the control plane's ZeroMQ sockets,
not HTTP), so it is treated like a controller without CURVE: it binds a loopback address
unless `TTP_ALLOW_INSECURE=1` lets it listen on the network (checked when the configuration
is read, and warned about on every start).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .peers import (  # noqa: F401  (re-exported: callers name them config's)
    ControlConfigError,
    parse_hostport,
    parse_ip,
    parse_port,
)
from .priority import NICE_RANGE, RTPRIO_RANGE

log = logging.getLogger("mindspeed_tft.control")

DEFAULT_PORT = 8000
DEFAULT_ADDR = "127.0.0.1"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_MODES = ("ONLY_ONE", "PER_PROC")
LOG_FILE = "ttp_log.log"
MAX_BACKUPS = 2
METRICS_PORT_ENV = "TFT_METRICS_PORT"
METRICS_ADDR_ENV = "TFT_METRICS_ADDR"


def port_in_use(addr: str, port: int, what: str = "the controller",
                variable: str = "TTP_PORT") -> ControlConfigError:
    """The one-line error of a controller whose port another process holds."""
    where = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    return ControlConfigError(
        f"{what} cannot listen on {where}: the port is in use (another job's controller or "
        f"another program listens there); allowed: a free port in {variable}")


def check_port_free(addr: str, port: int, what: str = "the controller",
                    variable: str = "TTP_PORT") -> None:
    """Raise `port_in_use` when `addr:port` cannot be bound now (as ZeroMQ binds it: with
    SO_REUSEADDR, so a port left in TIME_WAIT by an earlier job counts as free)."""
    import errno
    import socket

    if not port:
        return
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((addr, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise port_in_use(addr, port, what, variable) from None
            raise


def _metrics_port(env: Mapping[str, str]) -> int:
    raw = (env.get(METRICS_PORT_ENV) or "").strip()
    try:
        port = int(raw or 0)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ControlConfigError(f"{METRICS_PORT_ENV}={env[METRICS_PORT_ENV]!r} is not a port "
                                 "(allowed: 1..65535; 0 or unset: no metrics endpoint)")
    return port


def _check_metrics_addr(values: dict[str, Any]) -> None:
    """A metrics endpoint on the network only with TTP_ALLOW_INSECURE=1 (it has no
    authentication); the opt-out is warned about on every start."""
    addr = values["metrics_addr"]
    if not values["metrics_port"] or ipaddress.ip_address(addr).is_loopback:
        return
    if not values["allow_insecure"]:
        raise ControlConfigError(
            f"{METRICS_ADDR_ENV}={addr!r} is not a loopback address: the metrics endpoint has "
            "no authentication (CURVE does not cover it), so anyone who reaches it could read "
            "the job's state; allowed: a loopback address (127.0.0.1, ::1), or "
            "TTP_ALLOW_INSECURE=1 to serve the metrics on the network anyway")
    values["warnings"] = [*values.get("warnings", []),
                          f"INSECURE: the metrics endpoint listens on {addr} without "
                          "authentication (TTP_ALLOW_INSECURE=1): anyone who reaches it can "
                          "read the job's state"]


def _number(env: Mapping[str, str], name: str, default: float, lo: float, hi: float, *,
            integer: bool = False) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        value = float("nan")
    if not (lo <= value <= hi):  # also false for nan
        kind = "an integer" if integer else "a number"
        raise ControlConfigError(f"{name}={raw!r} is not {kind} in [{lo:g}, {hi:g}] "
                                 f"(unset: {default:g})")
    return value


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().upper()
    if value not in allowed:
        raise ControlConfigError(f"{name}={raw!r} is not one of {', '.join(allowed)} "
                                 f"(unset: {default})")
    return value


def _path(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    path = raw.strip()
    if not os.path.exists(path):
        raise ControlConfigError(f"{name}={raw!r}: no such file or folder")
    return path


def _token(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    if not (16 <= len(raw) <= 256 and raw.isascii() and raw.isprintable() and raw.strip() == raw):
        raise ControlConfigError(
            f"{name} is not 16..256 printable ASCII characters without surrounding blanks "
            f"(it has {len(raw)}; e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return raw


@dataclass
class ControlConfig:
    """Everything the control plane needs; see the module docstring for the variables."""

    controller_addr: str = DEFAULT_ADDR
    processor_addr: str = DEFAULT_ADDR
    port: int = DEFAULT_PORT
    heartbeat_interval: float = 2.0
    heartbeat_misses: int = 3
    action_time_limit: float = 180.0
    register_timeout: float = 600.0
    #: seconds an incident waits for a lost rank's replacement to register (None: the
    #: action time limit); a launcher whose restart budget is spent ends the wait at once
    replacement_wait: float | None = None
    #: seconds a lost rank whose node's launcher is silent too waits for a replacement
    #: launcher (0: none is coming; the incident decides at once)
    node_replacement_wait: float = 0.0
    hang_timeout_min: float = 60.0
    hang_timeout_factor: float = 5.0
    hang_initial_timeout: float = 1800.0
    backups: list[tuple[str, int]] = field(default_factory=list)
    curve_server_key: str | None = None
    curve_client_key: str | None = None
    curve_authorized_keys: str | None = None
    #: per-job secret carried by REGISTER and backup announcements (None: not checked)
    job_token: str | None = field(default=None, repr=False)
    #: a controller may bind a non-loopback address without CURVE (TTP_ALLOW_INSECURE=1)
    allow_insecure: bool = False
    max_message_bytes: int = 1 << 20
    #: seconds a controller keeps a connection that has not shown the job's token (no valid
    #: REGISTER or backup announcement yet, `admission.py`) before it closes it; longer than
    #: the ZMTP handshake interval (5 s), since a CURVE handshake may take that long in a
    #: registration storm
    admit_deadline: float = 10.0
    #: seconds a processor waits for the controller's decision after reporting an error;
    #: None: derived from the action time limit (enough for every phase of an incident:
    #: hold, stop, clean, repair, rollback, dump, rename)
    decision_timeout: float | None = None
    #: seconds an `exit` action gives the training thread before the process is ended
    exit_grace: float = 10.0
    #: seconds a `stop` waits for the training thread to come back to the handler (at most
    #: half the action time limit); a thread that never does is really hung
    park_timeout: float = 30.0
    #: exit code after a successful dying-gasp dump (75, EX_TEMPFAIL: "restart the job from
    #: the dump"), and after any failure
    dump_exit_code: int = 75
    failure_exit_code: int = 1
    #: exit code of a rank ordered to end so that its launcher restarts it (ARF: a hung rank
    #: under the recover strategy); `tft-run` restarts a worker exiting with it
    reboot_exit_code: int = 76
    #: seconds a registered rank goes on without hearing from an active controller (the
    #: active one and the backups all silent) before it gives up: it exits with
    #: `controller_lost_exit_code` (77: "the control plane is gone", no checkpoint written)
    controller_lost_timeout: float = 120.0
    controller_lost_exit_code: int = 77
    log_path: str = "logs"
    log_level: str = "INFO"
    log_mode: str = "ONLY_ONE"
    log_stdout: bool = False
    #: the active controller's metrics endpoint (control/controller/metrics.py): port (0: off), address
    metrics_port: int = 0
    metrics_addr: str = DEFAULT_ADDR
    #: nice value of the control plane's threads (`control/wire/priority.py`; 0: unchanged)
    thread_nice: int = -10
    #: SCHED_RR priority of the same threads (`control/wire/priority.py`; 0: normal policy)
    thread_rtprio: int = 1
    #: what setup_logging warns about on every start (e.g. a switched-off safety)
    warnings: list[str] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise ControlConfigError(f"heartbeat_interval={self.heartbeat_interval} must be > 0")
        if self.heartbeat_misses < 1:
            raise ControlConfigError(f"heartbeat_misses={self.heartbeat_misses} must be >= 1")
        if self.action_time_limit <= 0:
            raise ControlConfigError(f"action_time_limit={self.action_time_limit} must be > 0")
        if not self.admit_deadline > 0:
            raise ControlConfigError(f"admit_deadline={self.admit_deadline} must be > 0")
        self.controller_addr = parse_ip(self.controller_addr, "controller_addr")
        self.processor_addr = parse_ip(self.processor_addr, "processor_addr", allow_wildcard=False)
        self.port = parse_port(self.port, "port", allow_any=True)  # 0: a controller binds any port
        self.metrics_port = parse_port(self.metrics_port, "metrics_port", allow_any=True)  # 0: off
        self.metrics_addr = parse_ip(self.metrics_addr, "metrics_addr")
        if not NICE_RANGE[0] <= self.thread_nice <= NICE_RANGE[1]:
            raise ControlConfigError(
                f"thread_nice={self.thread_nice} is out of range (allowed: {NICE_RANGE[0]}.."
                f"{NICE_RANGE[1]})")
        if not RTPRIO_RANGE[0] <= self.thread_rtprio <= RTPRIO_RANGE[1]:
            raise ControlConfigError(
                f"thread_rtprio={self.thread_rtprio} is out of range (allowed: "
                f"{RTPRIO_RANGE[0]}..{RTPRIO_RANGE[1]})")

    @property
    def lost_after(self) -> float:
        """Seconds of silence after which a rank (or the controller) is lost."""
        return self.heartbeat_interval * self.heartbeat_misses

    @property
    def curve(self) -> bool:
        """True when CURVE encryption and authentication are on."""
        return self.curve_server_key is not None

    @property
    def effective_replacement_wait(self) -> float:
        """How long an incident waits for a lost rank's restarted process."""
        return self.action_time_limit if self.replacement_wait is None else self.replacement_wait

    def effective_decision_timeout(self) -> float:
        """How long a rank waits for a decision before giving up and exiting."""
        if self.decision_timeout is not None:
            return self.decision_timeout
        return 7 * self.action_time_limit + 2 * self.lost_after + 30

    def replace(self, **changes: Any) -> ControlConfig:
        """A copy with some fields changed."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ControlConfig(**values)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ControlConfig:
        """Read the environment (default `os.environ`); keyword overrides win over it."""
        env = os.environ if env is None else env
        ttp_addr = parse_ip(env.get("TTP_ADDR") or DEFAULT_ADDR, "TTP_ADDR")
        ctrl = env.get("CONTROLLER_ADDR")
        proc = env.get("PROCESSOR_ADDR")
        values: dict[str, Any] = {
            "controller_addr": parse_ip(ctrl, "CONTROLLER_ADDR") if ctrl else ttp_addr,
            "processor_addr": parse_ip(proc, "PROCESSOR_ADDR", allow_wildcard=False)
            if proc else parse_ip(ttp_addr, "TTP_ADDR", allow_wildcard=False),
            "port": parse_port(env.get("TTP_PORT") or DEFAULT_PORT),
            "heartbeat_interval": _number(env, "TTP_HEARTBEAT_INTERVAL", 2.0, 0.05, 60),
            "heartbeat_misses": int(_number(env, "TTP_HEARTBEAT_MISSES", 3, 1, 100,
                                            integer=True)),
            "action_time_limit": _number(env, "TTP_NORMAL_ACTION_TIME_LIMIT", 180, 30, 1800),
            "register_timeout": _number(env, "TTP_REGISTER_TIMEOUT", 600, 1, 86400),
            "hang_timeout_min": _number(env, "TTP_HANG_TIMEOUT_MIN", 60, 0.1, 86400),
            "hang_timeout_factor": _number(env, "TTP_HANG_TIMEOUT_FACTOR", 5, 1, 1000),
            "park_timeout": _number(env, "TTP_PARK_TIMEOUT", 30, 0.5, 900),
            "exit_grace": _number(env, "TTP_EXIT_GRACE", 10, 0.5, 600),
            "controller_lost_timeout": _number(env, "TTP_CONTROLLER_LOST_TIMEOUT", 120, 5,
                                               3600),
            "hang_initial_timeout": _number(env, "TTP_HANG_INITIAL_TIMEOUT", 1800, 1, 86400),
            "curve_server_key": _path(env, "TTP_CURVE_SERVER_KEY"),
            "curve_client_key": _path(env, "TTP_CURVE_CLIENT_KEY"),
            "curve_authorized_keys": _path(env, "TTP_CURVE_AUTHORIZED_KEYS"),
            "job_token": _token(env, "TTP_JOB_TOKEN"),
            "allow_insecure": _choice(env, "TTP_ALLOW_INSECURE", "0", ("0", "1")) == "1",
            "log_path": (env.get("TTP_LOG_PATH") or "").strip() or "logs",
            "log_level": _choice(env, "TTP_LOG_LEVEL", "INFO", LOG_LEVELS),
            "log_mode": _choice(env, "TTP_LOG_MODE", "ONLY_ONE", LOG_MODES),
            "log_stdout": _choice(env, "TTP_LOG_STDOUT", "0", ("0", "1")) == "1",
            "metrics_port": _metrics_port(env),
            "metrics_addr": parse_ip(env.get(METRICS_ADDR_ENV) or DEFAULT_ADDR, METRICS_ADDR_ENV),
            "thread_nice": int(_number(env, "TFT_CONTROL_NICE", -10, *NICE_RANGE, integer=True)),
            "thread_rtprio": int(_number(env, "TFT_CONTROL_RTPRIO", 1, *RTPRIO_RANGE,
                                         integer=True)),
        }
        values["node_replacement_wait"] = _number(env, "TFT_NODE_REPLACEMENT_WAIT", 0.0, 0, 1800)
        if (env.get("TFT_REPLACEMENT_WAIT") or "").strip():
            values["replacement_wait"] = _number(env, "TFT_REPLACEMENT_WAIT",
                                                 values["action_time_limit"], 1, 1800)
        backups = (env.get("TTP_BACKUP_ADDRS") or "").strip()
        if backups:
            values["backups"] = [parse_hostport(b, "TTP_BACKUP_ADDRS")
                                 for b in backups.split(",") if b.strip()]
            if len(values["backups"]) > MAX_BACKUPS:
                raise ControlConfigError(
                    f"TTP_BACKUP_ADDRS={backups!r} names {len(values['backups'])} backup "
                    f"controllers; at most {MAX_BACKUPS} are allowed"
                )
        # a rank must not give up on its controller before a backup could take charge
        interval = values["heartbeat_interval"]
        failover = 3 * interval * values["heartbeat_misses"] + 2 * interval
        if (env.get("TTP_CONTROLLER_LOST_TIMEOUT") or "").strip():
            if values["controller_lost_timeout"] < failover:
                raise ControlConfigError(
                    f"TTP_CONTROLLER_LOST_TIMEOUT={env['TTP_CONTROLLER_LOST_TIMEOUT']!r} is "
                    f"shorter than a failover to a backup controller ({failover:g}s = 3 x "
                    "TTP_HEARTBEAT_INTERVAL x TTP_HEARTBEAT_MISSES + 2 x TTP_HEARTBEAT_INTERVAL);"
                    f" allowed: {failover:g}..3600")
        else:
            values["controller_lost_timeout"] = max(120.0, failover)
        values.update(overrides)
        if values["curve_client_key"] and not values["curve_server_key"]:
            raise ControlConfigError(
                "TTP_CURVE_CLIENT_KEY is set but TTP_CURVE_SERVER_KEY is not: CURVE needs both"
            )
        _check_metrics_addr(values)
        return cls(**values)


_logging_done = False


def setup_logging(config: ControlConfig, *, force: bool = False) -> None:
    """Send the plugin's loggers (`mindspeed_tft.*`: control plane, recovery) to
    TTP_LOG_PATH (once per process)."""
    global _logging_done
    if _logging_done and not force:
        return
    _logging_done = True
    logger = logging.getLogger("mindspeed_tft")
    logger.setLevel(getattr(logging, config.log_level))
    fmt = logging.Formatter(
        "%(asctime)s %(levelname)s [pid %(process)d %(threadName)s] %(name)s: %(message)s"
    )
    name = LOG_FILE if config.log_mode == "ONLY_ONE" else f"ttp_log.{os.getpid()}.log"
    try:
        os.makedirs(config.log_path, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(os.path.join(config.log_path, name))
    except OSError as e:  # an unwritable log folder must not stop training
        handler = logging.StreamHandler(sys.stderr)
        logger.warning("cannot write logs to %s (%s); logging to stderr", config.log_path, e)
    handler.setFormatter(fmt)
    logger.addHandler(handler)
    if config.log_stdout:
        out = logging.StreamHandler(sys.stdout)
        out.setFormatter(fmt)
        logger.addHandler(out)
    for w in config.warnings:
        logger.warning("%s", w)
