"""Every environment variable mindspeed-tft (and its `mindio_ttp`, sdk/) reads or sets, in
one table.

A row names the variable, whether it is public (a user may set it; part of the stable API)
or internal (the package's processes talk through it; never set it by hand), its default,
the values allowed, where it comes from (this project, MindIO TFT's name for the same
setting, torch's launcher, the system), the one module that reads it, the modules that set
it for this process or a child, and what it does. Each variable is read in one module:
other code asks that module (`launched_by_tft`, `ControlConfig.from_env`, ...). The
variables torch's launcher gives each worker (RANK, MASTER_PORT, ...) are read here, through
`launcher_value`, for every layer that needs them.

`tests/test_envvars.py` parses the package and sdk/ and fails when a variable read there is
missing from the table, when a row names a variable nobody reads or sets, or when a row's
reader or setters are not the modules that do it; it also checks that docs/usage.md carries
`markdown_table()` (``python -m mindspeed_tft.envvars`` prints it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: where a variable's name comes from
TFT, MINDIO, TORCH, MINDCLUSTER, SYSTEM = ("mindspeed-tft", "MindIO TFT", "torch",
                                           "MindCluster", "system")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: who reads it, who sets it, what it may hold."""

    name: str
    public: bool
    default: str
    allowed: str
    origin: str
    reader: str | None  # module (dotted path) that reads it; None: only another program
    doc: str
    set_by: tuple[str, ...] = ()  # modules that set it (for themselves or their children)


_CONFIG = "mindspeed_tft.control.wire.config"
_SECONDS = "seconds, "


def _ttp(name: str, default: str, allowed: str, doc: str) -> EnvVar:
    """A control-plane setting read by `ControlConfig.from_env` (SPEC 4)."""
    origin = MINDIO if name.startswith("TTP_") or name in ("CONTROLLER_ADDR", "PROCESSOR_ADDR") \
        else TFT
    return EnvVar(name, True, default, allowed, origin, _CONFIG, doc)


TABLE: tuple[EnvVar, ...] = (
    # switches and user tools
    EnvVar("HIGH_AVAILABILITY", True, "unset", "comma list of dump, retry, recover, "
           "elastic-training", MINDIO, "mindspeed_tft.arguments",
           "switches the features on; wins over the command line"),
    EnvVar("TFT_EVENTS_FILE", True, "unset", "a file path", TFT, "mindspeed_tft.events",
           "the events file (JSON Lines) when `--tft-events-file` is not given",
           ("mindspeed_tft.events", "mindspeed_tft.tools.drill")),
    EnvVar("TFT_INJECT", True, "unset", "fault spec, e.g. `kill:rank=1,step=5,phase=backward`",
           TFT, "mindspeed_tft.faults", "faults to inject (tests, drills)",
           ("mindspeed_tft.tools.drill",)),
    EnvVar("TFT_INJECT_STATE_DIR", True, "unset", "a folder", TFT, "mindspeed_tft.faults",
           "where fired injections are marked, so each fires once per job",
           ("mindspeed_tft.tools.drill",)),
    EnvVar("TFT_INJECT_HANG_SECONDS", True, "3600", "a positive number", TFT,
           "mindspeed_tft.faults", "how long an injected hang lasts if nothing stops it"),
    EnvVar("TFT_MAX_WORKER_RESTARTS", True, "8", "a whole number >= 0", TFT,
           "mindspeed_tft.launcher.options",
           "`tft-run`'s restart budget with worker reboot (`--max-restarts` wins)"),
    # the control plane (ControlConfig)
    _ttp("TTP_ADDR", "127.0.0.1", "IPv4 or IPv6 literal", "the controller's address"),
    _ttp("CONTROLLER_ADDR", "TTP_ADDR", "IP literal (wildcard allowed)",
         "the address the controller binds"),
    _ttp("PROCESSOR_ADDR", "TTP_ADDR", "IP literal, not a wildcard",
         "the address processors connect to"),
    _ttp("TTP_PORT", "8000", "1..65535", "the controller's port"),
    _ttp("TTP_HEARTBEAT_INTERVAL", "2", _SECONDS + "0.05..60", "seconds between heartbeats"),
    _ttp("TTP_HEARTBEAT_MISSES", "3", "1..100", "missed heartbeats before a rank is lost"),
    _ttp("TTP_NORMAL_ACTION_TIME_LIMIT", "180", _SECONDS + "30..1800",
         "how long an action (stop, repair, dump...) may take"),
    _ttp("TFT_REPLACEMENT_WAIT", "the action time limit", _SECONDS + "1..1800",
         "how long an incident waits for a lost rank's replacement"),
    _ttp("TFT_NODE_REPLACEMENT_WAIT", "0", _SECONDS + "0..1800",
         "how long a rank lost with its node's launcher waits for a replacement launcher "
         "(0: none is coming)"),
    _ttp("TTP_REGISTER_TIMEOUT", "600", _SECONDS + "1..86400",
         "how long all ranks have to register"),
    _ttp("TTP_HANG_TIMEOUT_MIN", "60", _SECONDS + "0.1..86400", "floor of the hang timeout"),
    _ttp("TTP_HANG_TIMEOUT_FACTOR", "5", "1..1000",
         "hang timeout = factor x the slowest recent step"),
    _ttp("TTP_HANG_INITIAL_TIMEOUT", "1800", _SECONDS + "1..86400",
         "hang timeout before the first step"),
    _ttp("TTP_PARK_TIMEOUT", "30", _SECONDS + "0.5..900",
         "how long a stopped rank has to come back before it counts as hung"),
    _ttp("TTP_EXIT_GRACE", "10", _SECONDS + "0.5..600",
         "how long an exit order waits for the training thread"),
    _ttp("TTP_CONTROLLER_LOST_TIMEOUT", "120", _SECONDS + "a failover's time..3600",
         "a rank with no controller for this long exits 77"),
    _ttp("TTP_BACKUP_ADDRS", "none (tft-run: nodes 1 and 2)", "up to 2 `ip:port`",
         "backup controllers"),
    _ttp("TTP_CURVE_SERVER_KEY", "off", "an existing file", "CURVE server certificate"),
    _ttp("TTP_CURVE_CLIENT_KEY", "none", "an existing file",
         "CURVE client secret certificate (processors)"),
    _ttp("TTP_CURVE_AUTHORIZED_KEYS", "the client key", "an existing file or folder",
         "client public certificates the controller accepts"),
    EnvVar("TTP_JOB_TOKEN", True, "none (tft-run on one node makes one; so does mindio_ttp's "
           "tft_start_controller)", "16..256 printable characters", MINDIO, _CONFIG,
           "the per-job secret every registration carries",
           ("mindspeed_tft.launcher.run", "mindio_ttp._token")),
    _ttp("TTP_ALLOW_INSECURE", "0", "0, 1",
         "1: a non-loopback controller or metrics endpoint without authentication"),
    _ttp("TTP_LOG_PATH", "logs", "a folder", "the control plane's log folder"),
    _ttp("TTP_LOG_LEVEL", "INFO", "DEBUG, INFO, WARNING, ERROR", "log level"),
    _ttp("TTP_LOG_MODE", "ONLY_ONE", "ONLY_ONE, PER_PROC", "one log file, or one per process"),
    _ttp("TTP_LOG_STDOUT", "0", "0, 1", "1: log to stdout too"),
    EnvVar("TFT_METRICS_PORT", True, "off", "0..65535 (0: off)", TFT, _CONFIG,
           "the controller's metrics endpoint (`--tft-metrics-port` sets it)",
           ("mindspeed_tft.arguments",)),
    _ttp("TFT_METRICS_ADDR", "127.0.0.1", "IP literal; non-loopback needs TTP_ALLOW_INSECURE=1",
         "the address the metrics endpoint binds"),
    _ttp("TFT_CONTROL_NICE", "-10", "-20..0 (0: off)",
         "nice value of the control plane's threads"),
    _ttp("TFT_CONTROL_RTPRIO", "1", "0..99 (0: off)",
         "SCHED_RR priority of the control plane's threads"),
    # internal: how the package's own processes talk
    EnvVar("TFT_CONTROLLER_IN_LAUNCHER", False, "unset", "1", TFT, "mindspeed_tft.arguments",
           "this worker's launcher hosts the controller and restarts failed workers",
           ("mindspeed_tft.launcher.agent",)),
    EnvVar("TFT_LAUNCHER_PID", False, "unset", "a pid", TFT, "mindspeed_tft.launcher.lifetime",
           "the launcher a worker must not outlive", ("mindspeed_tft.launcher.lifetime",)),
    EnvVar("TFT_WORKER_RESTART_COUNT", False, "unset", "a whole number", TFT,
           "mindspeed_tft.launcher.agent", "how often this worker was restarted alone",
           ("mindspeed_tft.launcher.agent",)),
    EnvVar("TFT_PREDECESSOR_PID", False, "unset", "a pid", TFT, "mindspeed_tft.launcher.spare",
           "the dead worker a restarted one replaces", ("mindspeed_tft.launcher.agent",)),
    EnvVar("TFT_SPARE", False, "unset", "1", TFT, "mindspeed_tft.launcher.spare",
           "this process is a warm spare", ("mindspeed_tft.launcher.pool",)),
    EnvVar("TFT_SPARE_SOCKET", False, "unset", "a socket path", TFT,
           "mindspeed_tft.launcher.spare", "the launcher's socket a spare waits on",
           ("mindspeed_tft.launcher.pool",)),
    EnvVar("TFT_SPARE_ID", False, "unset", "a whole number", TFT, "mindspeed_tft.launcher.spare",
           "the spare's number on its node (logs)", ("mindspeed_tft.launcher.pool",)),
    EnvVar("TFT_SPARE_LAUNCHER_PID", False, "unset", "a pid", TFT,
           "mindspeed_tft.launcher.spare", "the launcher that started the spare",
           ("mindspeed_tft.launcher.pool",)),
    EnvVar("TTP_STOP_CLEAN_BEFORE_DUMP", False, "unset", "1", MINDIO, "mindio_ttp._actions",
           "the framework cleans before a dump (the SDK's switch)", ("mindio_ttp._runtime",)),
    # other programs' variables the package reads
    EnvVar("MINDX_TASK_ID", False, "unset", "any", MINDCLUSTER, "mindio_ttp._runtime",
           "set: MindSpeed-LLM leaves the controller to MindCluster"),
    EnvVar("RANK", False, "0", "a whole number", TORCH, "mindspeed_tft.envvars",
           "the worker's global rank", ("mindspeed_tft.plugin",)),
    EnvVar("WORLD_SIZE", False, "1", "a whole number", TORCH, "mindspeed_tft.envvars",
           "the job's world size", ("mindspeed_tft.plugin",)),
    EnvVar("LOCAL_RANK", False, "0", "a whole number", TORCH, "mindspeed_tft.envvars",
           "the worker's rank on its node"),
    EnvVar("MASTER_ADDR", False, "unset", "a host", TORCH, "mindspeed_tft.envvars",
           "the rendezvous store's host (groups are rebuilt on it)"),
    EnvVar("MASTER_PORT", False, "unset", "a port", TORCH, "mindspeed_tft.envvars",
           "the rendezvous store's port (its connections survive a stop)"),
    EnvVar("TORCHELASTIC_RUN_ID", False, "unset", "any", TORCH, "mindspeed_tft.envvars",
           "set: torchrun (torch.distributed.elastic) started this worker"),
    EnvVar("PET_MAX_RESTARTS", False, "unset", "a whole number", TORCH,
           "mindspeed_tft.launcher.options", "torchrun's environment form of --max-restarts"),
    EnvVar("GLOO_SOCKET_IFNAME", False, "unset", "interface names", TORCH,
           "mindspeed_tft.platform.gloo_device", "gloo's interfaces, as torch reads it"),
    EnvVar("TORCH_GLOO_LAZY_INIT", False, "1 for groups of 3+", "0, 1", TORCH,
           "mindspeed_tft.platform.gloo_device", "gloo's lazily connected pairs"),
    EnvVar("PATH", False, "-", "-", SYSTEM, "mindspeed_tft.megatron.helpers",
           "where Megatron-LM's helper build finds make, the compiler and python3"),
    EnvVar("CXX", False, "g++", "a compiler command", SYSTEM, "mindspeed_tft.megatron.helpers",
           "the compiler Megatron-LM's helper build runs"),
)

BY_NAME = {row.name: row for row in TABLE}

#: the variables torch's launcher gives each worker, read by `launcher_value`
LAUNCHER_VARIABLES = tuple(row.name for row in TABLE
                           if row.origin == TORCH and row.reader == __name__)


def launcher_value(name: str) -> str | None:
    """The value torch's launcher (torchrun, `tft-run`) gave this worker for `name`, one of
    `LAUNCHER_VARIABLES`; None when unset."""
    if name not in LAUNCHER_VARIABLES:
        raise ValueError(f"{name!r} is not a launcher variable; allowed: "
                         f"{', '.join(LAUNCHER_VARIABLES)}")
    return os.environ.get(name)


def markdown_table(public: bool = True) -> str:
    """The public (or internal) rows as a Markdown table (docs/usage.md carries it)."""
    lines = ["| variable | default | allowed | what it does |", "| --- | --- | --- | --- |"]
    lines += [f"| `{row.name}` | {row.default} | {row.allowed} | {row.doc} |"
              for row in TABLE if row.public == public]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
