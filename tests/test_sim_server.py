"""The simulated SGLang server: what a daemon scrapes from it parses like SGLang 0.5.23,
the in-engine plugin follows step tables from the spool and writes tier statistics,
/set_internal_state refuses what SGLang refuses, restarts reset counters, outages look
like outages, and stop() leaves nothing running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from specgov.adapters.observation_builder import (
    ObservationBuilder,
    parse_loads,
    parse_server_info,
)
from specgov.adapters.prometheus_text import counter_by_dp, gauge_by_dp, parse_metrics
from specgov.adapters.spool_stats import TierStatsRecord, read_tier_stats
from specgov.adapters.spool_table import write_step_table
from specgov.adapters.telemetry import REALTIME_DECODE_MODE, REALTIME_TOKENS
from specgov.policies.common.observation import Observation
from specgov.policies.common.step_table import StepTable
from specgov.policies.engine.adaptive_config import AdaptiveConfigError, parse_adaptive_config
from specgov.simulator.replay.runner import (
    SPECGOV_SLOT_CANDIDATES,
    ServerSpec,
    specgov_adaptive_config,
)
from specgov.simulator.server import endpoints as ep
from specgov.simulator.server.cli import serve, sim_server_cmd
from specgov.simulator.server.core import SimServer, SimServerError
from specgov.simulator.workload.synthetic import SyntheticSpec, generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec
from specgov.simulator.workload.traces import Request, Trace

LOADS_INCLUDE = {"include": "core,memory,spec,queues"}
CANDIDATES = parse_adaptive_config(specgov_adaptive_config()).candidate_steps


def _trace(duration_s: float = 30.0, rate_rps: float = 8.0) -> Trace:
    return generate_trace(
        SyntheticSpec(
            duration_s=duration_s,
            rate_rps=rate_rps,
            mean_input_tokens=512,
            mean_output_tokens=128,
            seed=1,
        )
    )


def _wait_for(predicate: Callable[[], object], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _gauge(text: str, name: str) -> float | None:
    rv = gauge_by_dp(parse_metrics(text), name).get(None)
    return None if rv is None else rv.value


def _counter(text: str, name: str) -> float:
    rv = counter_by_dp(parse_metrics(text), name).get(None)
    return 0.0 if rv is None else rv.value


@pytest.fixture
def running() -> Iterator[Callable[..., SimServer]]:
    """Start servers; every one is stopped at teardown, even when a test fails."""
    started: list[SimServer] = []

    def start(trace: Trace | None = None, **kwargs: Any) -> SimServer:
        sim = SimServer(trace if trace is not None else _trace(), **kwargs)
        started.append(sim)
        sim.start()
        sim.wait_ready()
        return sim

    yield start
    for sim in started:
        sim.stop()


def _finished(sim: SimServer) -> int:
    return int(sim.state()["requests_finished"] or 0)


def _scrape(client: httpx.Client, builder: ObservationBuilder) -> Observation:
    metrics = parse_metrics(client.get("/metrics").text, source="sim /metrics")
    info = client.get("/server_info").json()
    loads = client.get("/v1/loads", params=LOADS_INCLUDE).json()
    return builder.feed(time.time(), metrics, info, loads)


# ----------------------------------------------------------------------- daemon view


def test_two_scrapes_give_the_daemon_a_complete_observation(
    running: Callable[..., SimServer], tmp_path: Path
) -> None:
    sim = running(speed=40.0, spool_dir=tmp_path / "spool", loop_trace=True)
    with httpx.Client(base_url=sim.url, timeout=5.0) as client:
        assert client.get("/health").status_code == 200
        model_info = client.get("/model_info").json()
        assert model_info["model_path"].startswith(ep.SIM_MODEL_PREFIX)
        assert model_info["model_path"] == "specgov-sim:llama-3.1-8b"
        assert client.get("/get_model_info").json() == model_info

        info = client.get("/server_info").json()
        assert set(client.get("/get_server_info").json()) == set(info)
        # The launch wrote its adaptive config file, as --speculative-adaptive-config.
        config = json.loads(Path(info["speculative_adaptive_config"]).read_text())
        assert config == specgov_adaptive_config()
        view = parse_server_info(info, adaptive_config=config)
        assert view.shape is not None and view.shape.algorithm == "EAGLE3"
        assert list(view.shape.candidate_steps) == CANDIDATES
        assert view.slot_candidates == SPECGOV_SLOT_CANDIDATES
        assert view.kv_capacity_tokens == info["max_total_num_tokens"] > 0

        builder = ObservationBuilder(adaptive_config=config)
        _wait_for(lambda: _finished(sim) >= 20, "requests to finish")
        _scrape(client, builder)
        done = _finished(sim)
        _wait_for(lambda: _finished(sim) >= done + 40, "more requests to finish")
        obs = _scrape(client, builder)

    needed = (
        "running_requests",
        "queued_requests",
        "token_usage",
        "kv_capacity_tokens",
        "gen_throughput_tok_s",
        "accept_length",
        "ttft_ms",
        "itl_ms",
        "tpot_ms",
        "shape",
        "staleness_s",
        "window_s",
        "generation_tokens",
        "verify_calls",
        "spec_num_steps",
        "slot_candidates",
    )
    missing = [name for name in needed if getattr(obs, name) is None]
    assert not missing, (missing, builder.last_report and builder.last_report.notes)
    assert obs.accept_length is not None and 1.0 <= obs.accept_length <= 8.0
    assert obs.spec_num_steps in CANDIDATES
    assert obs.kv_capacity_tokens == view.kv_capacity_tokens


def test_loads_and_server_info_follow_sglangs_shapes(running: Callable[..., SimServer]) -> None:
    # No spool: SGLang's own controller on its default config (the baseline).
    sim = running(_trace(duration_s=8.0), speed=100.0)
    assert sim.policy_name == "sglang-ema"
    _wait_for(lambda: sim.state()["status"] == "finished", "the trace to end")
    (result,) = sim.results()
    assert result.completed + result.aborted == len(_trace(duration_s=8.0).requests)
    with httpx.Client(base_url=sim.url, timeout=5.0) as client:
        info = client.get("/server_info").json()
        assert info["speculative_adaptive"] is True
        assert info["speculative_adaptive_config"] is None  # SGLang's default config
        assert info["version"] == "0.5.23"
        state = info["internal_states"][0]
        assert state["memory_usage"]["token_capacity"] == info["max_total_num_tokens"]
        assert state["avg_spec_accept_length"] > 1.0

        full = client.get("/v1/loads").json()
        view = parse_loads(full)
        assert len(view.ranks) == 1 and view.server_time_s is not None
        rank = view.ranks[0]
        # Idle after the trace: the idle publish says so.
        assert (rank.running_requests, rank.waiting_requests, rank.token_usage) == (0, 0, 0.0)
        assert rank.capacity_tokens == info["max_total_num_tokens"]
        load = full["loads"][0]
        assert {"memory", "speculative", "disaggregation", "queues"} <= set(load)
        assert load["decode_moments"][0] > 0 and load["total_prefill_busy_us"] > 0

        core = client.get("/v1/loads", params={"include": "core"}).json()["loads"][0]
        assert not {"memory", "speculative", "queues"} & set(core)
        assert client.get("/v1/loads", params={"dp_rank": "1"}).json()["loads"] == []
        assert client.get("/v1/loads", params={"dp_rank": "x"}).status_code == 400
        # SGLang validates sections in LoadSnapshot.to_dict, outside the endpoint's try.
        assert client.get("/v1/loads", params={"include": "core,bogus"}).status_code == 500
        text = client.get("/v1/loads", params={"format": "prometheus"}).text
        assert 'sglang_num_running_reqs{dp_rank="0"} 0' in text
        assert 'sglang_spec_accept_length{dp_rank="0"}' in text


def test_before_the_first_publish_loads_are_the_seeded_default() -> None:
    launch = ep.LaunchInfo(
        model="m",
        gpu="g",
        host="127.0.0.1",
        port=1,
        kv_capacity_tokens=1000,
        effective_max_running_requests=8,
        chunked_prefill_size=512,
        mem_fraction_static=0.8,
        weight_gib=1.0,
        kv_cache_gib=2.0,
        graph_gib=0.5,
        total_gib=8.0,
        speculative_algorithm="EAGLE3",
    )
    body = ep.loads_body(launch, ep.LiveState(), include=None, dp_rank=None, now_s=1.0e9)
    assert body["loads"][0]["timestamp"] == 0.0
    rank = parse_loads(body).ranks[0]
    assert rank.running_requests is None and rank.published_at_s is None
    with pytest.raises(ep.InvalidIncludeError, match="bogus"):
        ep.loads_body(launch, ep.LiveState(), include="bogus", dp_rank=None, now_s=1.0)


# ------------------------------------------------------------------- plugin + spool


def _windows_since(spool: Path, start_s: float) -> list[TierStatsRecord]:
    return [
        r
        for r in read_tier_stats(spool).records
        if r.snapshot.window_start_s >= start_s and r.snapshot.tiers
    ]


def test_plugin_follows_step_tables_and_writes_tier_stats(
    running: Callable[..., SimServer], tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    started = time.time()
    sim = running(speed=40.0, spool_dir=spool, loop_trace=True, stats_interval_s=0.25)
    assert sim.policy_name == "specgov-plugin"
    _wait_for(lambda: _windows_since(spool, 0.0), "tier statistics in the spool")
    record = _windows_since(spool, 0.0)[0]
    # Windows are stamped in wall-clock epoch seconds, like the daemon's clock...
    assert started - 1.0 <= record.snapshot.window_start_s <= time.time() + 1.0
    # ... and step times are the simulated GPU's (ms), not the accelerated wall time.
    timed = [t for t in record.snapshot.tiers if t.step_time_count]
    assert timed
    for tier in timed:
        assert 1e-3 < tier.step_time_sum_s / tier.step_time_count < 0.5

    with httpx.Client(base_url=sim.url, timeout=5.0) as client:
        for version, steps in ((1, 0), (2, 2)):
            table = StepTable(((1, steps),), version=version, produced_at_s=time.time(), ttl_s=60)
            write_step_table(spool, table, CANDIDATES)

            def in_force(v: int = version) -> bool:
                return (sim.state()["plugin"]["table"] or {}).get("version") == v

            _wait_for(in_force, f"table version {version} to be followed")
            after = time.time() + 0.1  # margin: the engine may run a tick ahead

            def under_table(since: float = after) -> bool:
                return bool(_windows_since(spool, since))

            _wait_for(under_table, "a window under the table")
            for rec in _windows_since(spool, after):
                assert {t.steps for t in rec.snapshot.tiers} == {steps}

            def gauge_is(s: int = steps) -> bool:
                return _gauge(client.get("/metrics").text, "sglang:spec_num_steps") == s

            _wait_for(gauge_is, f"spec_num_steps gauge {steps}")

    # Expiry is judged on the wall clock: a table that died two minutes ago is ignored.
    stale = StepTable(((1, 1),), version=3, produced_at_s=time.time() - 120.0, ttl_s=30.0)
    write_step_table(spool, stale, CANDIDATES)
    _wait_for(lambda: sim.state()["plugin"]["table"] is None, "the expired table to be dropped")
    plugin = sim.state()["plugin"]
    assert plugin["spool_ignored"].get("expired", 0) > 0
    assert plugin["mode"] == "table" and plugin["errors"] == 0


# --------------------------------------------------------------- set_internal_state


def test_set_internal_state_accepts_and_refuses_like_sglang(
    running: Callable[..., SimServer],
) -> None:
    sim = running(_trace(duration_s=8.0), speed=100.0)
    _wait_for(lambda: sim.state()["status"] == "finished", "the trace to end")
    with httpx.Client(base_url=sim.url, timeout=5.0) as client:

        def post(args: Any, method: str = "POST") -> Any:
            response = client.request(method, "/set_internal_state", json={"server_args": args})
            assert response.status_code == 200
            return response.json()

        def internal() -> dict[str, Any]:
            state: dict[str, Any] = client.get("/server_info").json()["internal_states"][0]
            return state

        assert post({"max_running_requests": 8}) == [False]
        assert post({"dspark_force_budget_frac": 0.5}) == [False]
        assert post({"pp_max_micro_batch_size": 0}) == [False]
        # Validated as a whole: one refused key applies nothing.
        assert post({"speculative_accept_threshold_acc": 0.3, "bogus": 1}) == [False]
        assert internal()["speculative_accept_threshold_acc"] == 1.0
        assert "avg_spec_accept_length" in internal()

        assert post({"speculative_accept_threshold_single": 0.5}, method="PUT") == [True]
        state = internal()
        assert state["speculative_accept_threshold_single"] == 0.5
        # The launch args keep the launch value; the lifetime acceptance starts over.
        assert client.get("/server_info").json()["speculative_accept_threshold_single"] == 1.0
        assert "avg_spec_accept_length" not in state
        assert "speculative" not in client.get("/v1/loads").json()["loads"][0]
        assert post({"pp_max_micro_batch_size": 4}) == [True]
        assert internal()["pp_max_micro_batch_size"] == 4

        for bad in (
            {"server_args": {"speculative_accept_threshold_acc": "0.5"}},
            {"server_args": {"speculative_accept_threshold_acc": True}},
            {"server_args": [1]},
            {"other": 1},
        ):
            response = client.post("/set_internal_state", json=bad)
            assert response.status_code == 400, bad
            error = response.json()
            assert error["object"] == "error" and error["code"] == 400 and error["message"]
        not_json = client.post("/set_internal_state", content=b"{", headers={"x": "y"})
        assert not_json.status_code == 400


def test_api_key_protects_everything_but_health_and_metrics(
    running: Callable[..., SimServer],
) -> None:
    sim = running(_trace(duration_s=4.0), speed=100.0, api_key="s3cret")
    with httpx.Client(base_url=sim.url, timeout=5.0) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.get("/server_info").status_code == 401
        assert client.post("/set_internal_state", json={"server_args": {}}).status_code == 401
        assert client.get("/v1/loads", headers={"Authorization": "Bearer nope"}).status_code == 401
        info = client.get("/server_info", headers={"Authorization": "Bearer s3cret"})
        assert info.status_code == 200
        assert "s3cret" not in info.text


# ------------------------------------------------------------- restart and outages


def test_restart_resets_counters_and_outages_look_like_outages(
    running: Callable[..., SimServer], tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    sim = running(speed=40.0, spool_dir=spool, loop_trace=True)
    config = specgov_adaptive_config()
    builder = ObservationBuilder(adaptive_config=config)
    with httpx.Client(base_url=sim.url, timeout=5.0) as client:
        _wait_for(lambda: _finished(sim) >= 100, "requests to finish")
        _scrape(client, builder)
        before = _counter(client.get("/metrics").text, "sglang:num_requests_total")
        writers_before = set(read_tier_stats(spool).cursor)

        sim.restart()
        assert sim.generation == 1
        assert _counter(client.get("/metrics").text, "sglang:num_requests_total") < before
        _scrape(client, builder)
        assert builder.last_report is not None and builder.last_report.restart_detected
        # A fresh plugin instance, and a new statistics writer (a new process, to a daemon).
        _wait_for(lambda: set(read_tier_stats(spool).cursor) - writers_before, "a new writer")

        # Connections refused while the port is closed; back when the outage ends.
        sim.pause(30.0)
        with pytest.raises(httpx.TransportError):
            client.get("/health")
        sim.resume()
        _wait_for(lambda: sim.healthy, "the port to re-open")
        assert client.get("/health").status_code == 200

        # 503 on every SGLang route; the simulator's own control routes still answer.
        sim.pause(30.0, mode="503")
        assert client.get("/metrics").status_code == 503
        assert client.get("/health").status_code == 503
        assert client.get("/specgov-sim/state").json()["outage"] == "503"
        assert client.post("/specgov-sim/outage", json={"seconds": 1}).status_code == 400
        sim.resume()
        _wait_for(lambda: client.get("/health").status_code == 200, "the 503 outage to end")

        # A restart driven over HTTP, as an end-to-end test in another process would.
        for bad in ({"down_s": -1}, {"down_s": "1"}, {"down": 1}):
            assert client.post("/specgov-sim/restart", json=bad).status_code == 400
        accepted = client.post("/specgov-sim/restart", json={"down_s": 30.0})
        assert accepted.status_code == 202
        assert accepted.json()["previous_generation"] == 1
        _wait_for(lambda: sim.state()["outage"] == "refuse", "the restart's down window")
        with pytest.raises(httpx.TransportError):
            client.get("/health")
        sim.resume()  # end the down window early
        sim.wait_ready()
        assert sim.generation == 2
        assert client.get("/server_info").status_code == 200


def test_restart_with_a_starting_phase_answers_503_on_health(
    running: Callable[..., SimServer],
) -> None:
    sim = running(speed=40.0, loop_trace=True)
    sim.restart(starting_s=30.0, wait=False)
    _wait_for(lambda: sim.generation == 1, "the new generation")
    with httpx.Client(base_url=sim.url, timeout=5.0) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/metrics").status_code == 200  # a starting server has /metrics
        with pytest.raises(SimServerError, match="already in progress"):
            sim.restart()
    sim.stop()  # interrupts the starting phase
    assert not sim.healthy


# ---------------------------------------------------------------- lifecycle, errors


def _sim_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("specgov-sim", "specgov-stats-writer"))
    ]


def test_stop_joins_every_thread_and_flushes_the_last_window(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    sim = SimServer(_trace(duration_s=60.0), speed=40.0, spool_dir=spool)
    sim.start()
    sim.wait_ready()
    url = sim.url
    _wait_for(lambda: _finished(sim) >= 20, "requests to finish")
    assert _sim_threads()
    sim.stop()
    sim.stop()  # idempotent
    assert _sim_threads() == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2.0)
    state = sim.state()
    assert state["status"] == "stopped"
    assert state["plugin"]["stats_written"] >= state["plugin"]["stats_windows"] >= 1
    assert read_tier_stats(spool).records
    with pytest.raises(SimServerError, match="not running"):
        sim.restart()


def test_serve_blocks_until_asked_to_stop() -> None:
    stop = threading.Event()
    seen: list[str] = []
    sim = SimServer(_trace(duration_s=4.0), speed=100.0)

    def ready(server: SimServer) -> None:
        seen.append(server.url)
        stop.set()

    result: list[int] = []

    def run() -> None:
        result.append(serve(sim, on_ready=ready, stop_event=stop))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30.0)
    assert result == [0] and seen == [sim.url]
    assert not sim.healthy and _sim_threads() == []


def test_bad_settings_are_refused_with_the_setting_named(tmp_path: Path) -> None:
    trace = _trace(duration_s=4.0)
    for kwargs, name in (
        ({"speed": 0.0}, "speed"),
        ({"speed": float("nan")}, "speed"),
        ({"port": -1}, "port"),
        ({"host": ""}, "host"),
        ({"stats_interval_s": 0}, "stats_interval_s"),
    ):
        with pytest.raises(SimServerError, match=name):
            SimServer(trace, **kwargs)
    unsorted = [Request(1.0, 10, 10), Request(0.5, 10, 10)]
    with pytest.raises(SimServerError, match="sorted by arrival_s"):
        SimServer(unsorted)
    with pytest.raises(AdaptiveConfigError):
        SimServer(trace, spool_dir=tmp_path, adaptive_config={"1": {"candidate_steps": []}})
    sim = SimServer(trace, ServerSpec(), speed=10.0)
    with pytest.raises(SimServerError, match="not running"):
        sim.restart()
    with pytest.raises(SimServerError, match="mode"):
        sim.pause(1.0, mode="sometimes")  # type: ignore[arg-type]


# ------------------------------------------------------------- `specgov sim-server`

CLI_TRACE = "synthetic:duration=20,rate=3,seed=5"
READY_TIMEOUT_S = 90.0  # a child process importing the simulator on a busy machine


def _specgov_argv() -> list[str]:
    exe = Path(sys.executable).with_name("specgov")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "specgov.controller.cli.main"]


class _SimServerProcess:
    """`specgov sim-server ARGS` in a child process; stopped with SIGTERM."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        # No SPECGOV_* variables: click reads SPECGOV_SIM_SERVER_<OPTION> auto-envvars.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGOV_")}
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [*_specgov_argv(), "sim-server", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> str:
        """The URL from the ready line."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            match = re.search(r"simulated SGLang server on (\S+) \((\S+)\)", self.log())
            if match:
                return match[1]
            if self.proc.poll() is not None:
                raise AssertionError(f"sim-server exited ({self.proc.returncode}):\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"sim-server not ready:\n{self.log()}")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30.0)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()


@pytest.fixture
def sim_process(tmp_path: Path) -> Iterator[Callable[[list[str]], _SimServerProcess]]:
    started: list[_SimServerProcess] = []

    def start(args: list[str]) -> _SimServerProcess:
        proc = _SimServerProcess(args, tmp_path / f"sim-{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def test_every_sim_server_option_changes_the_server(
    sim_process: Callable[[list[str]], _SimServerProcess], tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    host = "127.0.0.2"  # loopback, but not the default address
    port = _free_port(host)
    sim = sim_process(
        ["--port", str(port), "--host", host, "--spool-dir", str(spool), "--trace", CLI_TRACE]
        + ["--speed", "40", "--loop", "--gpu", "h200", "--model", "qwen3-8b"]
        + ["--spec-steps", "2", "--acceptance-profile", "ngram", "--seed", "7"]
    )
    url = sim.wait_ready()
    assert url == f"http://{host}:{port}"
    with httpx.Client(base_url=url, timeout=5.0) as client:
        state = client.get("/specgov-sim/state").json()
        info = client.get("/server_info").json()
        model_info = client.get("/model_info").json()
        # --port, --host: where it listens and what it reports.
        assert (info["host"], info["port"]) == (host, port)
        # --speed, --loop, --trace, --seed.
        assert state["speed"] == 40.0 and "--speed 40" in info["launch_command"]
        assert state["loop_trace"] is True
        expected = generate_trace(parse_synthetic_spec(CLI_TRACE))
        assert state["trace_requests"] == len(expected.requests)
        assert state["seed"] == 7
        # --gpu, --model, --spec-steps, --acceptance-profile.
        assert state["server"]["gpu"] == "h200"
        assert model_info["model_path"] == "specgov-sim:qwen3-8b"
        assert state["server"]["spec_steps"] == info["speculative_num_steps"] == 2
        assert state["server"]["acceptance_profile"] == "ngram"
        # --spool-dir: specgov's plugin runs on it and writes tier statistics there.
        assert state["policy"] == "specgov-plugin" and state["spool_dir"] == str(spool)
        assert Path(state["adaptive_config"]).parent == spool.resolve()
        _wait_for(lambda: read_tier_stats(spool).records, "tier statistics in the spool", 60.0)
    assert sim.stop() == 0


def test_sim_server_defaults_and_drafter(
    sim_process: Callable[[list[str]], _SimServerProcess],
) -> None:
    # --drafter ngram: SGLang cannot adapt n-gram speculation, so static steps run.
    sim = sim_process(["--port", "0", "--drafter", "ngram", "--trace", CLI_TRACE])
    url = sim.wait_ready()
    with httpx.Client(base_url=url, timeout=5.0) as client:
        state = client.get("/specgov-sim/state").json()
        info = client.get("/server_info").json()
        assert client.get("/model_info").json()["model_path"] == "specgov-sim:llama-3.1-8b"
    assert info["host"] == "127.0.0.1" and info["port"] == int(url.rsplit(":", 1)[1])
    assert state["server"]["drafter"] == "ngram" and info["speculative_algorithm"] == "NGRAM"
    assert state["policy"] == "static:3" and state["spool_dir"] is None
    assert (state["speed"], state["loop_trace"], state["seed"]) == (1.0, False, 0)
    assert state["server"]["gpu"] == "h100"
    assert sim.stop() == 0


def test_a_plain_sim_server_runs_without_speculation(
    sim_process: Callable[[list[str]], _SimServerProcess], running: Callable[..., SimServer]
) -> None:
    # --speculative-algorithm NONE: SGLang launched without the flag. No drafter in
    # memory (a larger KV pool than the speculative server's), no verify steps, and it
    # still serves generation.
    spec = running([])
    sim = sim_process(["--port", "0", "--trace", "none", "--speculative-algorithm", "none"])
    url = sim.wait_ready()
    with httpx.Client(base_url=url, timeout=30.0) as client:
        info = client.get("/server_info").json()
        state = client.get("/specgov-sim/state").json()
        r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 40}})
        metrics = client.get("/metrics").text
    with httpx.Client(base_url=spec.url, timeout=30.0) as client:
        spec_info = client.get("/server_info").json()
    assert info["speculative_algorithm"] is None and info["speculative_num_steps"] is None
    assert info["speculative_draft_model_path"] is None
    assert spec_info["speculative_algorithm"] == "EAGLE3"
    assert info["max_total_num_tokens"] > spec_info["max_total_num_tokens"]
    assert "--speculative-algorithm NONE" in info["launch_command"]
    assert state["policy"] == "none" and state["server"]["speculative"] is False
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 40
    assert _counter(metrics, "sglang:spec_verify_calls_total") == 0.0
    assert sim.stop() == 0
    # Any other name must be the drafter's own algorithm.
    result = CliRunner().invoke(
        sim_server_cmd, ["--trace", "none", "--speculative-algorithm", "NGRAM"]
    )
    assert result.exit_code == 1, result.output
    assert "the drafter 'eagle3' runs EAGLE3; give NONE" in result.output


def test_sim_server_option_defaults_are_the_server_specs() -> None:
    defaults = {p.name: p.default for p in sim_server_cmd.params}
    spec = ServerSpec()
    for name in ("gpu", "model", "drafter", "spec_steps", "acceptance_profile"):
        assert defaults[name] == getattr(spec, name), name
    assert defaults["port"] == 30000  # SGLang's default --port
    assert defaults["trace"] == "synthetic:demo" and defaults["speed"] == 1.0
    # The module entry runs the same command.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGOV_")}
    out = subprocess.run(
        [sys.executable, "-m", "specgov.simulator.server.cli", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert out.stdout.startswith("Usage: specgov sim-server [OPTIONS]")
    assert "--spec-steps" in out.stdout and "--acceptance-profile" in out.stdout


def test_sim_server_refuses_bad_options_in_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    for args, needle in (
        (["--speed", "0"], "--speed"),
        (["--port", "70000"], "--port"),
        (["--spec-steps", "0"], "--spec-steps"),
        (["--startup-s", "-1"], "expected seconds >= 0 or 'catalog', got '-1'"),
        (["--startup-s", "catalog", "--model", "nope"], "--startup-s"),
    ):
        result = runner.invoke(sim_server_cmd, args)
        assert result.exit_code == 2 and needle in result.output, (args, result.output)
    for args, needle in (
        (["--gpu", "nope", "--trace", CLI_TRACE], "nope"),
        (["--trace", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
    ):
        result = runner.invoke(sim_server_cmd, args)
        assert result.exit_code == 1 and needle in result.output, (args, result.output)
        assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = runner.invoke(sim_server_cmd, ["--port", str(port), "--trace", CLI_TRACE])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: cannot serve on 127.0.0.1:{port}: ")


def _decode_tokens_at(client: httpx.Client, sim: SimServer) -> tuple[float, float, float]:
    """(wall s, simulated s, decode tokens so far), read together."""
    wall_s = time.time()
    sim_s = float(sim.state()["sim_time_s"])
    snap = parse_metrics(client.get("/metrics").text, source="sim /metrics")
    tokens = counter_by_dp(snap, REALTIME_TOKENS, match={"mode": REALTIME_DECODE_MODE})
    return wall_s, sim_s, tokens[None].value if None in tokens else 0.0


def test_server_info_says_the_speed_that_turns_wall_rates_into_simulated_ones(
    running: Callable[..., SimServer],
) -> None:
    speed = 20.0
    sim = running(_trace(duration_s=120.0, rate_rps=8.0), speed=speed, loop_trace=True)
    with httpx.Client(base_url=sim.url, timeout=5.0) as client:
        info = client.get("/server_info").json()
        assert info[ep.SIM_SPEED_KEY] == speed
        _wait_for(lambda: _finished(sim) >= 20, "requests to finish")
        first = _decode_tokens_at(client, sim)
        _wait_for(lambda: time.time() - first[0] >= 2.0, "a 2 s wall window")
        second = _decode_tokens_at(client, sim)
    tokens = second[2] - first[2]
    assert tokens > 0
    wall_rate = tokens / (second[0] - first[0])  # what a daemon measures
    simulated_rate = tokens / (second[1] - first[1])  # the server's own time
    assert wall_rate / info[ep.SIM_SPEED_KEY] == pytest.approx(simulated_rate, rel=0.05)
    # A real SGLang's /server_info has no such key: the body builder adds it only when asked.
    serving = sim.serving()
    assert serving is not None
    assert ep.SIM_SPEED_KEY not in ep.server_info_body(serving[1], ep.LiveState())
    # The daemon reads the speed under its own copy of the key (it may not import the
    # simulator): the two must agree.
    from specgov.controller.daemon import server_speed

    assert server_speed.SIM_SPEED_KEY == ep.SIM_SPEED_KEY
