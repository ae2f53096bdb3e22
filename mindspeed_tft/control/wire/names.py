"""The protocol's vocabulary: message type names, the values some fields allow, and the
bounds of ranks, steps and texts.

A leaf of `wire/`: the typed messages (`fields`, `messages`, `order_types`, `results`) and
the framing (`protocol`, which re-exports these names) all read them, and it imports none
of them.
"""

from __future__ import annotations

MAX_RANK = (1 << 24) - 1
MAX_STEP = (1 << 62)
MAX_TEXT = 4096
#: the longest reason a launcher's `exited` report gives for not restarting a worker
MAX_EXIT_REASON = 1024
MAX_RANKS_PER_MESSAGE = 1 << 21


class MsgType:
    """Message type names (strings on the wire)."""

    # processor -> controller
    REGISTER = "register"
    HEARTBEAT = "hb"
    REPORT = "report"
    RESULT = "result"
    BYE = "bye"
    # launcher -> controller: a worker of another node's launcher ended
    EXITED = "exited"
    # controller -> processor
    REGISTERED = "registered"
    ACK = "ack"
    ACTION = "action"
    REJECT = "reject"
    REDIRECT = "redirect"
    # backup controller <-> active controller
    BACKUP = "backup"
    SYNC = "sync"


#: actions a controller can order; processors run the callback registered for each name
ACTIONS = ("pause", "hold", "stop", "clean", "repair", "rollback", "dump", "rename", "resume",
           "exit", "scale_in", "scale_out")
#: what a processor can report (SPEC 6): see `classify.FaultKind`
REPORT_KINDS = ("uce", "comm", "normal", "unknown", "hang")
DATA_STATUS = ("updated", "updating")
ROLES = ("active", "standby")
