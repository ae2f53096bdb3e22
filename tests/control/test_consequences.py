"""A stopped rank's peers see their collectives fail before their own stop arrives: such a
communication error is a consequence of the stop, not a fault of its own.

Two raw connections play the ranks (real controller process, real protocol frames), so the
order of the messages is exact: rank 0 reports an error, the controller holds both (they
answer where they are) and sends them the stop, and rank 1 reports "Connection closed by
peer" after its stop was sent but before it answered it. The decision names rank 0 only;
rank 1's report is withdrawn.
"""

from __future__ import annotations

from pathlib import Path

import zmq

from mindspeed_tft.control.wire.protocol import MsgType, decode, encode
from tests.control.ctl_harness import Job, wait_for

CLOSED = ("RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
          "[127.0.0.1]:33716")


class RawRank:
    """A registered rank whose every frame the test writes itself."""

    def __init__(self, ctx: zmq.Context, port: int, rank: int, world: int) -> None:
        self.rank = rank
        self.seq = 0
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.send(MsgType.REGISTER, {"world_size": world, "pid": 1000 + rank, "host": "raw"})
        assert self.recv().type == MsgType.REGISTERED

    def send(self, mtype: str, payload: dict) -> None:
        self.seq += 1
        self.sock.send(encode(mtype, self.rank, self.seq, payload))

    def recv(self, timeout: float = 10.0):
        assert self.sock.poll(int(timeout * 1000), zmq.POLLIN), f"rank {self.rank}: nothing"
        return decode(self.sock.recv())

    def recv_action(self, name: str, timeout: float = 10.0) -> dict:
        while True:
            msg = self.recv(timeout)
            if msg.type == MsgType.ACTION and msg.payload["name"] == name:
                return msg.payload

    def progress(self, step: int) -> None:
        self.send(MsgType.HEARTBEAT, {"step": step, "status": "updated"})


def test_comm_error_after_the_stop_is_its_consequence(tmp_path: Path) -> None:
    job = Job(tmp_path, 2, features="dump", interval=1.0, misses=20)
    ctx = zmq.Context()
    try:
        port = job.start_controller()
        ranks = [RawRank(ctx, port, r, 2) for r in (0, 1)]
        job.wait_state("NORMAL", 10)
        for r in ranks:
            r.progress(3)
        ranks[0].send(MsgType.REPORT, {"kind": "unknown", "message": "ValueError: boom",
                                       "step": 3, "status": "updated"})
        for r in ranks:
            hold = r.recv_action("hold")
            r.send(MsgType.RESULT, {"id": hold["id"], "action": "hold", "ok": True,
                                    "result": {"step": 3, "status": "updated"}})
        stops = [r.recv_action("stop") for r in ranks]
        assert [s["payload"]["lock_step"] for s in stops] == [3, 3]
        ranks[1].send(MsgType.REPORT, {"kind": "comm", "message": CLOSED, "step": 3,
                                       "status": "updated"})
        wait_for(lambda: any(e["event"] == "fault_withdrawn" for e in job.events()), 10,
                 what="rank 1's report withdrawn")
        for r, stop in zip(ranks, stops, strict=True):
            r.send(MsgType.RESULT, {"id": stop["id"], "action": "stop", "ok": True,
                                    "result": {"step": 3, "status": "updated", "parked": True}})
        strategy = wait_for(lambda: next((e for e in job.events() if e["event"] == "strategy"),
                                         None), 10, what="the decision")
        assert strategy["strategy"] == "dump" and strategy["faults"] == {"0": "unknown"}
        detected = [(e["ranks"], e["kind"]) for e in job.events() if e["event"] == "fault_detected"]
        withdrawn = [(e["ranks"], e["kind"]) for e in job.events() if e["event"] == "fault_withdrawn"]
        assert detected == [([0], "unknown"), ([1], "comm")]
        assert withdrawn == [([1], "comm")]
    finally:
        ctx.destroy(linger=0)
        job.cleanup()
