"""Admission: which connections a controller keeps, so that no peer can lock a rank out.

A controller's ROUTER accepts every TCP connection (libzmq has no per-connection veto
before the handshake), so what a peer can hold is bounded here, after the fact, by
connection class:

- *admitted*: a connection that proved it belongs to the job. A REGISTER or BACKUP frame
  carrying the job's token (`TTP_JOB_TOKEN`; under CURVE it also came over a handshake the
  ZAP handler accepted for an authorized key), or any frame from a routing id a rank
  registered (the same process reconnected: ROUTER_HANDOVER keeps its id). Admitted
  connections count against the rank cap (`rank_cap`, 2 x W + 64: a connection per rank
  twice over while a replaced process' connection times out, two backups, a margin); a
  registration beyond it is refused for now. Only holders of the token can be admitted.
- *pending*: everything else (in the ZMTP or CURVE handshake, or past it without a valid
  REGISTER: idle DEALERs, peers without the token, raw TCP). They have their own bound,
  separate from the ranks': each is closed `deadline` seconds after it was accepted, plus
  `transport.STORM_ALLOWANCE_S` (1 ms) for every connection pending when it was (in a
  registration storm every rank's handshake is queued at once, and a CURVE handshake costs
  ~0.5 ms of the I/O thread here, so 16,000 of them take seconds); and beyond `pending_cap`
  the controller closes the oldest pending connections of the source address holding the
  most, once the frames already queued are read: a REGISTER among them admits its
  connection first, however many accepts were counted before it (closing while counting
  them once pushed out a rank whose REGISTER was being read, and its REGISTERED reply was
  lost). A connection younger than its grace (`GRACE_S`, at most half the deadline) is not
  pushed out while the open files last: peers that connect again the moment they are
  dropped cannot rotate the room faster than a rank's handshake (under CURVE on a loaded
  machine, tens of milliseconds) and its REGISTER. A newcomer is never refused, so a
  rank's (replacement) process connecting while hostile peers hold the pending room is
  admitted as soon as its REGISTER is read (within milliseconds), which pushes only the
  hostile peers out.

The controller's loop feeds this the ROUTER's monitor events (`on_event`: accepted and
disconnected carry the connection's file descriptor) and, for every frame that admits,
the descriptor it came from (`zmq.SRCFD`). libzmq offers no call to close one of a ROUTER's
connections, so `close` shuts the connection down (`shutdown(2)` on a duplicate of the
descriptor, after checking it still leads to the peer accepted on it); libzmq then sees
the end of the stream and drops it as if the peer had left.
"""

from __future__ import annotations

import heapq
import logging
import socket
from collections import OrderedDict
from typing import NamedTuple

import zmq

from ..wire.transport import storm_allowance

log = logging.getLogger("mindspeed_tft.control.admission")

#: pending connections a controller keeps beyond one per rank (a registration storm is W
#: connections at once, all pending until their REGISTER is read)
PENDING_MARGIN = 1024
#: open files a controller keeps for itself (sockets, logs, ZeroMQ mailboxes)
FD_RESERVE = 256
#: seconds a new connection is never pushed out to make room (at most half the deadline):
#: time for its handshake and first frame, however fast newer connections come
GRACE_S = 1.0


class Peer(NamedTuple):
    """One accepted connection: when, until when it may stay pending, and from where."""

    since: float
    expires: float
    family: int
    addr: tuple[str, int] | None  # (ip, port); None if it could not be read


def peer_of(fd: int) -> tuple[int, tuple[str, int] | None]:
    """(address family, (ip, port)) of the TCP connection on `fd`, read without taking the
    descriptor over; (AF_UNSPEC, None) when it is not (or no longer) a connected socket."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return socket.AF_UNSPEC, None
    try:
        name = sock.getpeername()
        return sock.family, (str(name[0]), int(name[1]))
    except OSError:
        return sock.family, None
    finally:
        sock.detach()


def close_connection(fd: int, peer: Peer) -> bool:
    """Shut down the connection libzmq holds on `fd` if it still leads to `peer` (the
    descriptor may have been closed and reused since); True if it was shut down."""
    if peer.addr is None:
        return False
    try:
        dup = socket.fromfd(fd, peer.family, socket.SOCK_STREAM)
    except OSError:
        return False
    try:
        if dup.getpeername()[:2] != peer.addr:
            return False
        dup.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        dup.close()


class Admission:
    """The connections of one controller's ROUTER by class (see the module docstring).

    rank_cap: the most admitted connections; pending_cap: the most pending ones, fewer when
    open files run short (`files`: what admitted ones leave of the process' open-files
    limit); deadline: seconds a pending connection is kept (plus the storm allowance for
    the connections pending when it was accepted)."""

    def __init__(self, rank_cap: int, pending_cap: int, deadline: float) -> None:
        if rank_cap < 1 or pending_cap < 1:
            raise ValueError(f"rank_cap={rank_cap} and pending_cap={pending_cap} must be >= 1")
        if not deadline > 0:
            raise ValueError(f"deadline={deadline} must be > 0")
        self.rank_cap = rank_cap
        self.pending_cap = pending_cap
        self.deadline = deadline
        self.grace = min(GRACE_S, deadline / 2)
        #: the open-files limit the connections live within (None: not known)
        self.files: int | None = None
        #: fd -> peer, oldest first
        self.pending: OrderedDict[int, Peer] = OrderedDict()
        #: (expires, since, fd) of the pending connections, soonest first (an entry whose
        #: connection was admitted or closed since is skipped when it comes up)
        self._expiry: list[tuple[float, float, int]] = []
        #: source ip -> its pending fds, oldest first
        self._by_source: dict[str, OrderedDict[int, None]] = {}
        self.admitted: dict[int, Peer] = {}
        #: pending connections closed at their deadline / to make room for newer ones
        self.expired = 0
        self.pushed_out = 0
        #: registrations refused because `rank_cap` connections were admitted
        self.refused = 0

    def room(self) -> int:
        """The most pending connections now: `pending_cap`, or what the admitted ones and
        the reserve leave of the open files if that is less (but at least 64)."""
        if self.files is None:
            return self.pending_cap
        return min(self.pending_cap, max(64, self.files - FD_RESERVE - len(self.admitted)))

    def limit(self) -> int:
        """The most pending connections, young ones included: what the admitted ones and
        the reserve leave of the open files (four times the room if that is not known)."""
        if self.files is None:
            return 4 * self.room()
        return max(self.room(), self.files - FD_RESERVE - len(self.admitted))

    def crowded(self) -> bool:
        """More pending connections than there is room for?"""
        return len(self.pending) > self.room()

    def _next_expiry(self) -> tuple[float, float, int] | None:
        """The soonest deadline of a connection still pending."""
        heap = self._expiry
        while heap:
            _, since, fd = heap[0]
            peer = self.pending.get(fd)
            if peer is not None and peer.since == since:
                return heap[0]
            heapq.heappop(heap)
        return None

    def due(self, now: float) -> bool:
        """Is a pending connection past its deadline, or are there too many?"""
        if not self.pending:
            return False
        soonest = self._next_expiry()
        return (soonest is not None and soonest[0] <= now) or len(self.pending) > self.room()

    # -- monitor events ----------------------------------------------------------------
    def on_event(self, event: int, fd: int, now: float) -> None:
        """An accepted or disconnected connection (the ROUTER's monitor)."""
        if event == zmq.EVENT_ACCEPTED:
            self._forget(fd)  # a descriptor reused after a disconnect we did not see
            family, addr = peer_of(fd)
            # the handshakes of the connections pending now may be queued ahead of its own
            expires = now + self.deadline + storm_allowance(len(self.pending))
            self.pending[fd] = Peer(now, expires, family, addr)
            heapq.heappush(self._expiry, (expires, now, fd))
            self._by_source.setdefault(self._source(addr), OrderedDict())[fd] = None
        elif event == zmq.EVENT_DISCONNECTED:
            self._forget(fd)

    @staticmethod
    def _source(addr: tuple[str, int] | None) -> str:
        return addr[0] if addr is not None else "?"

    def _forget(self, fd: int) -> Peer | None:
        self.admitted.pop(fd, None)
        peer = self.pending.pop(fd, None)
        if peer is not None:
            source = self._source(peer.addr)
            fds = self._by_source.get(source)
            if fds is not None:
                fds.pop(fd, None)
                if not fds:
                    del self._by_source[source]
        return peer

    # -- frames ------------------------------------------------------------------------
    def is_pending(self, fd: int) -> bool:
        return fd in self.pending

    def has_room(self, fd: int) -> bool:
        """May the connection `fd` be admitted (it is already, or fewer than `rank_cap`
        are)? A frame's input says so to the core (`inputs.Frame.room`)."""
        return fd in self.admitted or len(self.admitted) < self.rank_cap

    def admit(self, fd: int) -> bool:
        """A frame from `fd` proved it belongs to the job: admit it (True), or refuse it
        (False) while `rank_cap` connections are admitted. An fd the monitor has not
        announced (closed since) is taken as admitted: it holds no room."""
        if fd in self.admitted:
            return True
        if len(self.admitted) >= self.rank_cap:
            self.refused += 1
            if self.refused <= 10 or self.refused % 1000 == 0:
                log.warning("refused registration #%d: %d connections admitted, at most %d",
                            self.refused, len(self.admitted), self.rank_cap)
            return False
        peer = self._forget(fd)
        if peer is not None:
            self.admitted[fd] = peer
        return True

    # -- bounds --------------------------------------------------------------------------
    def enforce(self, now: float) -> int:
        """Close the pending connections past their deadline, then the oldest of the
        biggest sources beyond the room: those past their grace, and beyond the open files'
        limit the young ones too; returns how many were closed."""
        closed = 0
        while (soonest := self._next_expiry()) is not None and soonest[0] <= now:
            fd = heapq.heappop(self._expiry)[2]
            self._close(fd, self.pending[fd])
            self.expired += 1
            closed += 1
        room = self.room()
        over = len(self.pending) - room
        if over > 0:
            over += room // 32  # some room, so a flood is not handled per accept
            closed += self._push_out(over, now - self.grace)
        over = len(self.pending) - self.limit()
        if over > 0:
            closed += self._push_out(over, now)
        total = self.expired + self.pushed_out
        if closed and (total - closed < 10 or total // 1000 > (total - closed) // 1000):
            log.warning("closed %d pending connections (%d at their %gs deadline, %d to make "
                        "room; %d pending, at most %d)", self.expired + self.pushed_out,
                        self.expired, self.deadline, self.pushed_out, len(self.pending), room)
        return closed

    def _push_out(self, over: int, accepted_by: float) -> int:
        """Close up to `over` pending connections accepted by `accepted_by`, the oldest of
        the source holding the most first; returns how many."""
        heap = [(-len(fds), src) for src, fds in self._by_source.items()]
        heapq.heapify(heap)
        closed = 0
        while closed < over and heap:
            count, src = heapq.heappop(heap)
            fd = next(iter(self._by_source[src]))
            peer = self.pending[fd]
            if peer.since > accepted_by:
                continue  # its oldest is too young: so are the others of its source
            self._close(fd, peer)
            self.pushed_out += 1
            closed += 1
            if count + 1 < 0:
                heapq.heappush(heap, (count + 1, src))
        return closed

    def _close(self, fd: int, peer: Peer) -> None:
        self._forget(fd)
        close_connection(fd, peer)

    def view(self) -> dict[str, int]:
        """Counters for snapshots."""
        return {"admitted": len(self.admitted), "pending": len(self.pending),
                "open": len(self.admitted) + len(self.pending),
                "closed_at_deadline": self.expired, "closed_for_room": self.pushed_out,
                "refused_over_cap": self.refused}
