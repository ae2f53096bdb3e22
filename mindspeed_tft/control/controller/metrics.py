"""The active controller's metrics endpoint: OpenMetrics / Prometheus text over HTTP.

Opt-in: `TFT_METRICS_PORT` (or the training script's `--tft-metrics-port`, which sets it)
makes the active controller, in rank 0's process or in `tft-run`'s node-0 launcher, serve
`http://TFT_METRICS_ADDR:PORT/metrics` (loopback unless `TTP_ALLOW_INSECURE=1`, see
`config`). It needs `prometheus_client` (`pip install mindspeed-tft[metrics]`), imported
only here, and this module is imported only when the port is set.

| metric | type | meaning |
| --- | --- | --- |
| `tft_controller_up` | gauge | 1: the controller's loop answered this scrape (0: nothing else is exported) |
| `tft_controller_state{state}` | gauge | 1 for the current state (INIT, NORMAL, ...), 0 for the others |
| `tft_world_size` | gauge | training ranks of the job |
| `tft_ranks_registered` | gauge | ranks that registered (rows of the rank table) |
| `tft_ranks_alive` | gauge | ranks registered and healthy (health `alive`) |
| `tft_ranks{health}` | gauge | registered ranks by health (alive, faulty, hung, lost, done, exiting, left) |
| `tft_heartbeat_age_max_seconds` | gauge | seconds since the longest-silent connected rank was heard from |
| `tft_incidents_total` | counter | incidents begun (faults and scale-outs; one under way included) |
| `tft_incidents_ended_total{kind,strategy,outcome}` | counter | incidents that ended, by the kind of their first fault (`none`: a scale-out), the strategy and the outcome (repaired, false_alarm, scaled_in, scaled_out, dumped, exited) |
| `tft_recovery_last_seconds`, `tft_recovery_median_seconds` | gauge | time to recover of the last recovery and the median of the last 1000 |
| `tft_iterations_lost_total` | counter | completed iterations repairs went back on |
| `tft_iteration` | gauge | the highest iteration a rank of the job reported |
| `tft_goodput_ratio` | gauge | productive step time / wall time (`goodput.goodput`) |

The time to recover runs from the incident's first `fault_detected` event to the event after
which training resumed (`repaired`, `scale_in`, `scale_out`), by the clock of those events:
it equals that stretch of the events file; the delay from the fault itself to its detection
is not in it (the controller cannot see it). The recovery metrics are absent before the first
recovery.

Goodput comes from the events file (`goodput.goodput` over what the process' events file
holds, read incrementally), not from the rank table: it is the fraction of wall time spent
in steps whose results count, which needs where each step started and ended and which
steps a rollback discarded. Heartbeats sample a rank's step only every interval and say
nothing of the steps between; the `iteration` events carry each step's end, and the
rollbacks (`repaired`, `scale_in`, `scale_out`) are there too. So it is the number
`tft-report` prints for the same file, and it is absent when this
process has no events file (`--tft-events-file` / `TFT_EVENTS_FILE`) or no event yet. It is
recomputed only when events were appended since the last scrape; the events are kept in
memory (as `report` does), which a job writing millions of events pays for.

Connections: a connection gets a thread only once its request begins to arrive; until then
the serving thread's selector watches it (at most `METRICS_WAITING` such connections, a newer
one closing the oldest), and one that does not begin its request within
`METRICS_READ_TIMEOUT` seconds is closed. Scrapes are answered by `METRICS_THREADS` threads;
at most `METRICS_QUEUE` requests wait for one and later ones are closed at once. So idle
connections hold no thread and a bounded number of files, and a scrape beside them is
answered at once.

Thread safety: the controller's loop thread owns its state. A scrape (in the HTTP server's
threads) asks the loop for a snapshot (`Controller.snapshot`, the loop answers between
frames), and reads the events file under its own lock.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ...events import events_path
from ...goodput import goodput
from ..wire.config import METRICS_PORT_ENV, ControlConfig, ControlConfigError
from ..wire.priority import leave_realtime
from ..wire.transport import hostport
from .ranktable import Health
from .states import State

log = logging.getLogger("mindspeed_tft.control.metrics")

#: seconds a scrape waits for the controller's loop to answer
SNAPSHOT_TIMEOUT = 2.0
INSTALL_HINT = "pip install 'mindspeed-tft[metrics]'"


class SnapshotSource(Protocol):
    """What the collector reads: the controller's `snapshot`."""

    def snapshot(self, timeout: float = ...) -> dict[str, Any]: ...


def prometheus() -> ModuleType:
    """The `prometheus_client` package, or a clear error saying how to install it."""
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401 - the metric families
    except ImportError:
        raise ControlConfigError(
            f"{METRICS_PORT_ENV} (--tft-metrics-port) is set but prometheus_client is not "
            f"installed: {INSTALL_HINT} (or set {METRICS_PORT_ENV}=0)") from None
    return prometheus_client


class EventsGoodput:
    """The goodput of the events file `path()` names, its new lines read at each call."""

    def __init__(self, path: Callable[[], str | None] = events_path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._file: str | None = None
        self._offset = 0
        self._events: list[dict[str, Any]] = []
        self._ratio: float | None = None
        self._stale = True

    def ratio(self) -> float | None:
        """Productive step time / wall time so far; None without an events file or event."""
        with self._lock:
            self._read_new()
            if self._stale and self._events:
                self._stale = False
                try:
                    self._ratio = goodput(self._events).ratio
                except (KeyError, TypeError, ValueError) as e:  # an event it cannot place
                    log.warning("goodput of %s not computed: %r", self._file, e)
                    self._ratio = None
            return self._ratio

    def _read_new(self) -> None:
        path = self._path()
        if path != self._file:
            self._file, self._offset, self._events, self._ratio = path, 0, [], None
        if path is None:
            return
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:  # a new file took its place
                    self._offset, self._events, self._ratio = 0, [], None
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        complete = data[:data.rfind(b"\n") + 1]  # a line being written waits for its end
        self._offset += len(complete)
        for line in complete.splitlines():
            if line.strip():
                try:
                    self._events.append(json.loads(line))
                except ValueError:
                    log.warning("%s: a line that is not JSON skipped", path)
                self._stale = True


class ControllerCollector:
    """A `prometheus_client` collector reading the controller when scraped."""

    def __init__(self, source: SnapshotSource, goodput_of: EventsGoodput | None = None) -> None:
        self.source = source
        self.goodput = goodput_of or EventsGoodput()

    def describe(self) -> list[Any]:
        return []  # nothing to check at registration: every scrape reads afresh

    def collect(self) -> Iterator[Any]:
        core = prometheus().core
        try:
            snap = self.source.snapshot(SNAPSHOT_TIMEOUT)
        except TimeoutError:
            snap = None
        yield core.GaugeMetricFamily("tft_controller_up", "1: the controller's loop answered "
                                     "this scrape", value=0 if snap is None else 1)
        if snap is None:
            return
        yield from _state(core, snap)
        yield from _ranks(core, snap)
        yield from _incidents(core, snap)
        ratio = self.goodput.ratio()
        if ratio is not None:
            yield core.GaugeMetricFamily(
                "tft_goodput_ratio", "Productive step time / wall time (goodput.goodput over "
                "the events file)", value=ratio)


def _state(core: Any, snap: dict[str, Any]) -> Iterator[Any]:
    state = core.GaugeMetricFamily("tft_controller_state", "1 for the controller's current "
                                   "state, 0 for the others", labels=["state"])
    for s in State:
        state.add_metric([s.value], 1 if snap["state"] == s.value else 0)
    yield state


def _ranks(core: Any, snap: dict[str, Any]) -> Iterator[Any]:
    rows = list(snap["ranks"].values())
    yield core.GaugeMetricFamily("tft_world_size", "Training ranks of the job",
                                 value=snap["world_size"])
    yield core.GaugeMetricFamily("tft_ranks_registered", "Ranks that registered",
                                 value=len(rows))
    health = {h.value: 0 for h in Health}
    for row in rows:
        health[row["health"]] = health.get(row["health"], 0) + 1
    yield core.GaugeMetricFamily("tft_ranks_alive", "Ranks registered and healthy",
                                 value=health[Health.ALIVE.value])
    by_health = core.GaugeMetricFamily("tft_ranks", "Registered ranks by health",
                                       labels=["health"])
    for name, count in health.items():
        by_health.add_metric([name], count)
    yield by_health
    if snap.get("heartbeat_age") is not None:
        yield core.GaugeMetricFamily(
            "tft_heartbeat_age_max_seconds", "Seconds since the longest-silent connected "
            "rank was heard from", value=snap["heartbeat_age"])
    steps = [row["step"] for row in rows
             if not row["fresh"] and row["health"] != Health.LEFT.value]
    if steps:
        yield core.GaugeMetricFamily("tft_iteration", "The highest iteration a rank of the "
                                     "job reported", value=max(steps))


def _incidents(core: Any, snap: dict[str, Any]) -> Iterator[Any]:
    stats = snap["incident_stats"]
    yield core.CounterMetricFamily("tft_incidents", "Incidents begun (faults and "
                                   "scale-outs)", value=snap["incidents"])
    ended = core.CounterMetricFamily(
        "tft_incidents_ended", "Incidents that ended, by the kind of their first fault, "
        "strategy and outcome", labels=["kind", "strategy", "outcome"])
    for row in stats["ended"]:
        ended.add_metric([row["kind"], row["strategy"], row["outcome"]], row["count"])
    yield ended
    if stats["recovery_last_seconds"] is not None:
        yield core.GaugeMetricFamily(
            "tft_recovery_last_seconds", "Time to recover of the last recovery (its first "
            "fault_detected event to training resuming)", value=stats["recovery_last_seconds"])
        yield core.GaugeMetricFamily(
            "tft_recovery_median_seconds", "Median time to recover (the last 1000 "
            "recoveries)", value=stats["recovery_median_seconds"])
    yield core.CounterMetricFamily("tft_iterations_lost", "Completed iterations repairs "
                                   "went back on", value=stats["iterations_lost"])


#: threads that answer scrapes, connections that may wait for one (more are closed at
#: once), connections that may wait for their request without a thread (beyond it the
#: oldest of them is closed), and seconds a connection may take to send its request
METRICS_THREADS = 4
METRICS_QUEUE = 16
METRICS_WAITING = 256
METRICS_READ_TIMEOUT = 5.0


class _QuietHandler(WSGIRequestHandler):
    # a slow request holds a thread this long at most (socket timeout); also how long a
    # connection may wait for its request to begin (`_Server`)
    timeout = METRICS_READ_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # a scrape every few seconds is not news


class _Server(WSGIServer):
    """A WSGI server answering on a bounded pool: `METRICS_THREADS` threads, at most
    `METRICS_QUEUE` connections waiting for one; a connection beyond them is closed at once,
    so idle connections cannot make the process start a thread each.

    A connection gets a thread only once its request begins to arrive: until then the
    serving thread's selector watches it, for the handler's `timeout` at most, and at most
    `METRICS_WAITING` of them (a newer one closes the oldest): idle connections hold
    neither a thread nor a queue place, and a scrape beside them is answered at once."""

    #: connections the kernel queues until they are accepted: as many as may wait (with
    #: socketserver's 5, a burst of connections overflowed it while the serving thread
    #: waited for the GIL, and each dropped handshake was retried a second later)
    request_queue_size = METRICS_WAITING

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pool = ThreadPoolExecutor(METRICS_THREADS, thread_name_prefix="tft-metrics-req")
        self._slots = threading.BoundedSemaphore(METRICS_THREADS + METRICS_QUEUE)
        self._selector = selectors.DefaultSelector()
        #: connections waiting for their request -> (the monotonic time they are closed at,
        #: the client's address); oldest first: every connection gets the same bound
        self._waiting: dict[socket.socket, tuple[float, Any]] = {}
        self._stop_asked = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self.shed = 0
        super().__init__(*args, **kwargs)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept connections and hand those whose request arrived to the pool, until
        `shutdown`."""
        self._stopped.clear()
        try:
            self._selector.register(self, selectors.EVENT_READ)
            while not self._stop_asked.is_set():
                for key, _ in self._selector.select(poll_interval):
                    if key.fileobj is self:
                        self._accept()
                    else:
                        self._readable(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop `serve_forever` (from another thread; it returns within its poll interval)."""
        self._stop_asked.set()
        self._stopped.wait()

    def _accept(self) -> None:
        try:
            request, client_address = self.get_request()
        except OSError:  # gone before it was accepted
            return
        self.process_request(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A new connection waits, without a thread, for its request."""
        if len(self._waiting) >= METRICS_WAITING:
            self.shed += 1
            self._drop(next(iter(self._waiting)))
        bound = float(self.RequestHandlerClass.timeout or METRICS_READ_TIMEOUT)  # type: ignore[attr-defined]
        self._waiting[request] = (time.monotonic() + bound, client_address)
        self._selector.register(request, selectors.EVENT_READ)

    def _readable(self, request: socket.socket) -> None:
        _, client_address = self._waiting.pop(request)
        self._selector.unregister(request)
        if not self._slots.acquire(blocking=False):
            self.shed += 1
            self.shutdown_request(request)
            return
        self._pool.submit(self._answer, request, client_address)

    def _expire(self, now: float) -> None:
        for request, (deadline, _) in list(self._waiting.items()):
            if deadline > now:
                break
            self._drop(request)

    def _drop(self, request: socket.socket) -> None:
        del self._waiting[request]
        self._selector.unregister(request)
        self.shutdown_request(request)

    def _answer(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except OSError:  # timed out or gone: nothing to report
            pass
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        for request in list(self._waiting):
            self._drop(request)
        self._selector.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class MetricsServer:
    """`prometheus_client`'s WSGI app over a threading HTTP server, stoppable (`stop`)."""

    def __init__(self, source: SnapshotSource, addr: str, port: int) -> None:
        client = prometheus()
        self.registry = client.CollectorRegistry(auto_describe=False)
        self.registry.register(ControllerCollector(source))
        server_class = type("_MetricsServer", (_Server,), {
            "address_family": _family(addr)})
        try:
            self._httpd: WSGIServer = make_server(addr, port, client.make_wsgi_app(self.registry),
                                      server_class, handler_class=_QuietHandler)
        except OSError as e:
            raise ControlConfigError(
                f"{METRICS_PORT_ENV}={port}: the metrics endpoint cannot listen on "
                f"{hostport(addr, port)} ({e.strerror or e}); allowed: a free port") from None
        self.addr, self.port = addr, int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._serve, name="tft-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        leave_realtime()  # started from the controller's loop; its request threads inherit
        self._httpd.serve_forever()

    @property
    def url(self) -> str:
        return f"http://{hostport(self.addr, self.port)}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def _family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def serve(source: SnapshotSource, config: ControlConfig) -> MetricsServer:
    """Serve `source`'s metrics on `config.metrics_addr:metrics_port` (must be set)."""
    if not config.metrics_port:
        raise ValueError("serve() needs config.metrics_port")
    return MetricsServer(source, config.metrics_addr, config.metrics_port)
