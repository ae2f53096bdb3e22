"""A stranger on the job's host with the job's rendezvous store (torch's TCPStore): it holds
idle connections to it and writes bad values to the keys the job reads.

`python -m tests.hostile_store PORT SECONDS OUT [--connections N] [--write]` waits (bounded
by SECONDS) until the store at 127.0.0.1:PORT accepts, opens N plain TCP connections to it
and holds them, and with `--write` sets every key of `BAD_KEYS` to each of `BAD_VALUES` in
turn, every 0.1 s, through a TCPStore client of its own. It stops at SECONDS or SIGTERM and
writes to OUT (JSON): `held` (connections open at the end), `writes`, `errors`, and
`samples`: [unix time, connections to PORT established on this host] every 0.2 s. Meant to
run as another user (`nobody`): nothing here needs the job's files.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

from tests.hostile import established

#: the keys of the store the job's processes read (`mindspeed_tft.events.LOGGED_KEY`, the
#: injection ledger's prefix, the launcher's node record and backup endpoint)
BAD_KEYS = ("tft/iterations/logged", "tft_inject/fired/fired-9-kill-rank0-step0-forward",
            "mindspeed_tft/launcher/node/0", "mindspeed_tft/launcher/backup/0")
BAD_VALUES = (b"abc", b"999999", b"-1", b"9" * 5000, b"\xff\x00{", b"")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("seconds", type=float)
    parser.add_argument("out")
    parser.add_argument("--connections", type=int, default=0)
    parser.add_argument("--write", action="store_true")
    opts = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    deadline = time.monotonic() + opts.seconds
    report: dict = {"held": 0, "writes": 0, "errors": 0, "samples": []}
    held: list[socket.socket] = []
    while not stop and time.monotonic() < deadline:  # the store comes up with the job
        try:
            socket.create_connection(("127.0.0.1", opts.port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    client = None
    next_sample = 0.0
    turn = 0
    while not stop and time.monotonic() < deadline:
        while len(held) < opts.connections:
            try:
                held.append(socket.create_connection(("127.0.0.1", opts.port), timeout=5))
            except OSError:
                report["errors"] += 1
                break
        if opts.write:
            try:
                if client is None:
                    from torch.distributed import TCPStore

                    client = TCPStore("127.0.0.1", opts.port, is_master=False,
                                      wait_for_workers=False, timeout=timedelta(seconds=5))
                value = BAD_VALUES[turn % len(BAD_VALUES)]
                for key in BAD_KEYS:
                    client.set(key, value)
                    report["writes"] += 1
                turn += 1
            except Exception:  # the store went away (the job ended), or it dropped us
                report["errors"] += 1
                client = None
        if time.monotonic() >= next_sample:
            report["samples"].append([time.time(), established(opts.port)])
            next_sample = time.monotonic() + 0.2
        time.sleep(0.1)
    report["held"] = len(held)
    Path(opts.out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
