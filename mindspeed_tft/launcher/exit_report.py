"""A launcher's report of a worker's end to the controller of another node (`exited`).

Node 0's launcher hosts the controller and tells it in-process that a worker ended
(`Controller.report_process_exit`). Every other node's launcher sends the same report over
the network: one `exited` frame (the rank, the pid of the process that ended, its exit
code, why the launcher will not restart it when it will not, the job's token) from a
DEALER of its own to the active controller at `TTP_ADDR:TTP_PORT`, with the CURVE client
keys its workers use. Without it such a worker's end is known only once its heartbeats
stop (interval x misses, 6 s with the defaults), and its replacement is refused until
then (its rank is still held by the dead process' connection).

A report is fire-and-forget and never blocks the launcher: the socket is made per report
and closed at once with a linger (libzmq's I/O thread delivers the frame in the
background); one that does not arrive costs what the heartbeats cost. The controller takes
it only with the job's token, under CURVE only from the key the rank registered with (a
job with neither gets no reports: it keeps the heartbeats), and only about the process
registered for the rank (`inbox.Inbox._on_exited`).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

log = logging.getLogger("mindspeed_tft.launcher")

#: milliseconds a report may wait for its connection before libzmq drops it (also the
#: longest a launcher's end waits for an unsent one: `close`)
LINGER_MS = 2000


class ExitReporter:
    """Sends `exited` frames to the active controller (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self._ctx: Any = None
        self._curve: Any = None
        self._seq = itertools.count(1)

    @property
    def enabled(self) -> bool:
        """Whether reports are sent: the controller takes them only with the job's token or
        under CURVE."""
        return self.config.job_token is not None or bool(self.config.curve)

    def report(self, rank: int, pid: int, returncode: int,
               no_replacement: str | None = None) -> bool:
        """Send one report (True: handed to libzmq; False: not sent, because the controller
        would not take it, or it could not be, which is logged). Never raises: a report
        must not take the launcher down."""
        if not self.enabled:
            return False
        cfg = self.config
        try:
            self._send(rank, pid, returncode, no_replacement)
        except Exception as error:
            log.warning("rank %d: could not report its end to the controller at %s:%d: %s: %s",
                        rank, cfg.processor_addr, cfg.port, type(error).__name__, error)
            return False
        return True

    def _send(self, rank: int, pid: int, returncode: int, no_replacement: str | None) -> None:
        import zmq

        from mindspeed_tft.control.wire.protocol import MAX_EXIT_REASON, MsgType, encode
        from mindspeed_tft.control.wire.transport import CurveKeys, connect_dealer, new_routing_id

        cfg = self.config
        payload: dict[str, Any] = {"pid": pid, "code": returncode}
        if cfg.job_token is not None:
            payload["token"] = cfg.job_token
        if no_replacement is not None:
            payload["no_replacement"] = no_replacement[:MAX_EXIT_REASON]
        if self._ctx is None:
            # the processors' client keys (None without CURVE)
            self._curve = CurveKeys.from_config(cfg, server=False)
            self._ctx = zmq.Context()
        sock = connect_dealer(self._ctx, cfg.processor_addr, cfg.port,
                              routing_id=new_routing_id(), max_bytes=cfg.max_message_bytes,
                              curve=self._curve)
        try:
            sock.send(encode(MsgType.EXITED, rank, next(self._seq), payload), zmq.NOBLOCK)
        finally:
            sock.close(LINGER_MS)

    def close(self) -> None:
        """Free the context once the reports still unsent are out (at most `LINGER_MS`)."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()
