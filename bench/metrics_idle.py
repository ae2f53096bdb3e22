"""How long a metrics scrape takes with and without idle connections held open (issue 58,
item 6).

It serves the controller's metrics endpoint (`control.controller.metrics.MetricsServer`) in
this process for a source whose loop does not answer (the scrape is `tft_controller_up 0`:
what is measured is the connection handling, not the snapshot), scrapes it `--scrapes` times
alone, then opens `--idle` connections that send nothing, holds them open and scrapes it
`--scrapes` times more (each scrape a fresh connection, client timeout `--timeout` s). It
prints the median and the worst scrape of each, the scrapes that failed (closed or timed
out), the endpoint's request threads and how many idle connections were still open at the
end; the last line is one JSON object.

    python bench/metrics_idle.py
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mindspeed_tft.control.controller.metrics import MetricsServer  # noqa: E402


class Silent:
    """A controller whose loop does not answer."""

    def snapshot(self, timeout: float = 0) -> dict[str, Any]:
        raise TimeoutError


def scrapes(port: int, count: int, timeout: float) -> tuple[list[float], int]:
    """Seconds of each answered scrape, and how many failed."""
    took, failed = [], 0
    for _ in range(count):
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                        timeout=timeout) as reply:
                reply.read()
        except OSError:
            failed += 1
            continue
        took.append(time.perf_counter() - start)
    return took, failed


def still_open(sockets: list[socket.socket]) -> int:
    count = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            sock.recv(1)
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def summary(took: list[float], failed: int) -> dict[str, Any]:
    return {"median_s": round(statistics.median(took), 4) if took else None,
            "max_s": round(max(took), 4) if took else None, "failed": failed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=int, default=150)
    ap.add_argument("--scrapes", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    server = MetricsServer(Silent(), "127.0.0.1", 0)
    idle: list[socket.socket] = []
    try:
        alone = summary(*scrapes(server.port, args.scrapes, args.timeout))
        idle = [socket.create_connection(("127.0.0.1", server.port))
                for _ in range(args.idle)]
        beside = summary(*scrapes(server.port, args.scrapes, args.timeout))
        threads = sum(t.name.startswith("tft-metrics-req") for t in threading.enumerate())
        row = {"idle": args.idle, "alone": alone, "beside_idle": beside,
               "request_threads": threads, "idle_still_open": still_open(idle)}
    finally:
        for sock in idle:
            sock.close()
        server.stop()
    print(f"scrape alone:              {alone}")
    print(f"scrape beside {args.idle} idle:   {beside}")
    print(f"request threads: {row['request_threads']}, idle connections still open: "
          f"{row['idle_still_open']}/{args.idle}")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
