"""The controller's metrics endpoint (`mindspeed_tft.control.controller.metrics`), scraped over HTTP and
read with `prometheus_client`'s own parser.

A real controller process of the control-plane harness serves the endpoint (`TFT_METRICS_PORT`
in its environment, read by `ControlConfig.from_env`); two ranks train, rank 1 kills itself
and is restarted as a launcher would, and the job is repaired (recover). The scrapes before,
during and after show the state, the ranks, the incident counters and the time to recover,
which must equal the stretch of the events file from the detection to `repaired`.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mindspeed_tft.control.controller.flow import IncidentStats, Outcome
from mindspeed_tft.control.controller.metrics import EventsGoodput, MetricsServer, prometheus
from mindspeed_tft.control.wire.config import ControlConfig, ControlConfigError
from mindspeed_tft.launcher.options import LauncherError, launch_options
from mindspeed_tft.report import goodput
from tests.control.ctl_harness import Job, wait_for
from tests.jobs import free_port

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples | None:
    """Every sample of one scrape, by (name, labels); None when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def state_of(samples: Samples) -> str:
    (state,) = [dict(labels)["state"] for (name, labels), v in samples.items()
                if name == "tft_controller_state" and v == 1]
    return state


def test_a_repaired_kill_shows_on_the_endpoint(tmp_path: Path) -> None:
    port = free_port()
    job = Job(tmp_path, 2, features="dump,recover", interval=0.15, misses=4,
              env={"TFT_METRICS_PORT": str(port)})
    try:
        job.start_controller()
        first = wait_for(lambda: scrape(port), 10, what="the metrics endpoint")
        assert state_of(first) == "INIT"
        assert value(first, "tft_controller_up") == 1
        assert value(first, "tft_world_size") == 2
        assert value(first, "tft_ranks_registered") == 0
        assert value(first, "tft_incidents_total") == 0
        assert value(first, "tft_recovery_last_seconds") is None  # no recovery yet

        job.start_worker(0, steps=80, step_time=0.02)
        job.start_worker(1, steps=80, step_time=0.02, fault="kill@10")
        normal = wait_for(lambda: (s := scrape(port)) and state_of(s) == "NORMAL"
                          and value(s, "tft_ranks_alive") == 2 and s, 15, what="NORMAL")
        assert value(normal, "tft_ranks_registered") == 2
        assert value(normal, "tft_ranks", health="alive") == 2
        assert value(normal, "tft_incidents_total") == 0
        assert 0 <= value(normal, "tft_heartbeat_age_max_seconds") < 1.0  # lost after 0.6
        # the events of a controller alone hold no step: goodput is there, and 0
        assert value(normal, "tft_goodput_ratio") == 0

        job.workers[1].wait(20)  # it killed itself at iteration 10
        during = wait_for(lambda: (s := scrape(port)) and value(s, "tft_incidents_total") == 1
                          and s, 10, what="the incident counted")
        # under way: it waits for rank 1's restarted process, which is not started yet
        assert state_of(during) in ("ABNORMAL", "ENV_CLEAR")
        assert not [k for k in during if k[0] == "tft_incidents_ended_total"]
        assert value(during, "tft_ranks", health="lost") == 1
        job.restart(1)
        after = wait_for(lambda: (s := scrape(port)) and value(
            s, "tft_incidents_ended_total", kind="lost", strategy="recover",
            outcome="repaired") == 1 and s, 20, what="the repair counted")
        assert value(after, "tft_incidents_total") == 1
        assert state_of(after) == "NORMAL"
        assert value(after, "tft_ranks_alive") == 2 and value(after, "tft_ranks_registered") == 2
        assert value(after, "tft_iterations_lost_total") == 0
        events = job.events()
        detected = next(e["time"] for e in events if e["event"] == "fault_detected")
        repaired = next(e["time"] for e in events if e["event"] == "repaired")
        assert value(after, "tft_recovery_last_seconds") == repaired - detected > 0
        assert value(after, "tft_recovery_median_seconds") == repaired - detected
        lock_step = next(e["lock_step"] for e in events if e["event"] == "strategy")
        assert value(after, "tft_iteration") >= lock_step >= 9
        assert job.controllers[0].wait(30) == 0
    finally:
        job.cleanup()


def test_incident_stats_keep_kinds_outcomes_and_the_median() -> None:
    stats = IncidentStats()
    stats.add(Outcome("lost", "recover", "repaired", 4.0, 0))
    stats.add(Outcome("uce", "load_checkpoint", "repaired", 2.0, 3))
    stats.add(Outcome("lost", "recover", "repaired", 9.0, 0))
    stats.add(Outcome("unknown", "dump", "dumped", None, 0))
    view = stats.view()
    assert view["ended"] == [
        {"kind": "lost", "strategy": "recover", "outcome": "repaired", "count": 2},
        {"kind": "uce", "strategy": "load_checkpoint", "outcome": "repaired", "count": 1},
        {"kind": "unknown", "strategy": "dump", "outcome": "dumped", "count": 1}]
    assert (view["recoveries"], view["recovery_last_seconds"],
            view["recovery_median_seconds"], view["iterations_lost"]) == (3, 9.0, 4.0, 3)
    json.dumps(view)  # it travels in snapshots


@pytest.mark.parametrize(("env", "names"), [
    ({"TFT_METRICS_PORT": "http"}, ("TFT_METRICS_PORT", "1..65535")),
    ({"TFT_METRICS_PORT": "65536"}, ("TFT_METRICS_PORT", "1..65535")),
    ({"TFT_METRICS_PORT": "-1"}, ("TFT_METRICS_PORT", "1..65535")),
    ({"TFT_METRICS_ADDR": "localhost"}, ("TFT_METRICS_ADDR", "IPv4 or IPv6")),
    ({"TFT_METRICS_PORT": "9100", "TFT_METRICS_ADDR": "0.0.0.0"},
     ("TFT_METRICS_ADDR", "TTP_ALLOW_INSECURE=1")),
    ({"TFT_METRICS_PORT": "9100", "TFT_METRICS_ADDR": "10.1.2.3",
      "TTP_CURVE_SERVER_KEY": __file__}, ("TFT_METRICS_ADDR", "TTP_ALLOW_INSECURE=1")),
])
def test_bad_metrics_settings_are_refused_by_name(env: dict[str, str],
                                                  names: tuple[str, ...]) -> None:
    with pytest.raises(ControlConfigError) as error:
        ControlConfig.from_env(env)
    assert all(name in str(error.value) for name in names), str(error.value)


def test_metrics_settings() -> None:
    assert (ControlConfig.from_env({}).metrics_port, ControlConfig.from_env({}).metrics_addr) \
        == (0, "127.0.0.1")
    assert ControlConfig.from_env({"TFT_METRICS_PORT": " "}).metrics_port == 0
    assert ControlConfig.from_env({"TFT_METRICS_PORT": "0",
                                   "TFT_METRICS_ADDR": "0.0.0.0"}).metrics_port == 0  # off
    v6 = ControlConfig.from_env({"TFT_METRICS_PORT": "9100", "TFT_METRICS_ADDR": "[::1]"})
    assert (v6.metrics_port, v6.metrics_addr, v6.warnings) == (9100, "::1", [])
    insecure = ControlConfig.from_env({"TFT_METRICS_PORT": "9100", "TFT_METRICS_ADDR": "0.0.0.0",
                                       "TTP_ALLOW_INSECURE": "1"})
    assert insecure.metrics_addr == "0.0.0.0"
    assert any("INSECURE: the metrics endpoint" in w for w in insecure.warnings)


def test_the_flag_reaches_the_config_through_the_environment(tmp_path: Path) -> None:
    def launch(*script_args: str) -> dict[str, str]:
        env = {"TFT_METRICS_PORT": "9000"}
        args = [*script_args, "--save", str(tmp_path)]  # high availability needs one
        launch_options(argparse.Namespace(training_script_args=args), env)
        return env

    env = launch("--enable-high-availability", "--tft-metrics-port", "9100")
    assert ControlConfig.from_env(env).metrics_port == 9100  # the flag wins
    assert launch("--tft-metrics-port", "9100") == {"TFT_METRICS_PORT": "9000"}  # HA off
    assert launch("--enable-high-availability") == {"TFT_METRICS_PORT": "9000"}  # no flag
    with pytest.raises(LauncherError, match="--tft-metrics-port.*allowed: 1..65535"):
        launch("--enable-high-availability", "--tft-metrics-port", "65536")


def test_without_prometheus_client_the_error_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ControlConfigError, match=r"pip install 'mindspeed-tft\[metrics\]'"):
        prometheus()


def test_a_busy_port_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ControlConfigError, match=f"TFT_METRICS_PORT={port}.*cannot listen"):
            MetricsServer(lambda timeout=0: {}, "127.0.0.1", port)  # type: ignore[arg-type]


def test_goodput_is_the_reports_over_complete_lines(tmp_path: Path) -> None:
    events = [{"time": 99.0, "event": "state", "rank": -1, "state": "INIT", "prev": None},
              {"time": 101.0, "event": "iteration", "rank": 0, "iteration": 1, "loss": 1.0},
              {"time": 102.0, "event": "iteration", "rank": 0, "iteration": 2, "loss": 0.9},
              {"time": 103.5, "event": "iteration", "rank": 0, "iteration": 3, "loss": 0.8}]
    path = tmp_path / "events.jsonl"
    lines = [json.dumps(e) + "\n" for e in events]
    reader = EventsGoodput(lambda: str(path))
    assert reader.ratio() is None  # no file yet
    path.write_text("".join(lines[:3]) + lines[3][:20])  # the last line half written
    assert reader.ratio() == goodput(events[:3]).ratio == pytest.approx(2 / 3)
    with open(path, "a") as f:
        f.write(lines[3][20:])
    assert reader.ratio() == goodput(events).ratio == pytest.approx(3.75 / 4.5)
    assert EventsGoodput(lambda: None).ratio() is None  # no events file in this process


def test_idle_connections_hold_a_bounded_pool_and_time_out(monkeypatch) -> None:
    """Hundreds of idle connections: the endpoint starts no thread beyond its pool and
    closes the idle ones after the read timeout; a scrape then answers."""
    import threading
    import time

    from mindspeed_tft.control.controller import metrics

    monkeypatch.setattr(metrics._QuietHandler, "timeout", 0.5)
    class Silent:  # a controller whose loop does not answer: tft_controller_up 0
        def snapshot(self, timeout: float = 0) -> dict:
            raise TimeoutError

    server = MetricsServer(Silent(), "127.0.0.1", 0)
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(150)]
        time.sleep(0.5)
        assert threading.active_count() - before <= metrics.METRICS_THREADS
        closed = 0
        for sock in idle:
            sock.settimeout(3)
            try:
                closed += sock.recv(1) == b""  # closed by the server: shed or timed out
            except OSError:
                pass
            sock.close()
        assert closed == len(idle), (closed, server._httpd.shed)  # type: ignore[attr-defined]
        reply = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
        assert b"tft_controller_up" in reply.read()  # answered
    finally:
        server.stop()


def test_a_scrape_is_answered_beside_idle_connections(monkeypatch) -> None:
    """150 idle connections held open (their read timeout 60 s): a scrape is answered while
    every one of them is still open and unanswered, and no thread beyond the pool started.
    (An endpoint whose threads wait on idle connections sheds the scrape, or answers it
    only once the idle ones have timed out.)"""
    import threading

    from mindspeed_tft.control.controller import metrics

    monkeypatch.setattr(metrics._QuietHandler, "timeout", 60.0)

    class Silent:  # a controller whose loop does not answer: tft_controller_up 0
        def snapshot(self, timeout: float = 0) -> dict:
            raise TimeoutError

    server = MetricsServer(Silent(), "127.0.0.1", 0)
    idle = []
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(150)]
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                    timeout=30) as reply:
            assert b"tft_controller_up 0.0" in reply.read()
        still_open = 0
        for sock in idle:
            sock.setblocking(False)
            try:
                sock.recv(1)  # b"": closed; bytes: answered
            except BlockingIOError:
                still_open += 1
        assert still_open == len(idle)
        workers = [t for t in threading.enumerate() if t.name.startswith("tft-metrics-req")]
        assert len(workers) <= metrics.METRICS_THREADS
        assert server._httpd.shed == 0  # type: ignore[attr-defined]
    finally:
        for sock in idle:
            sock.close()
        server.stop()
