"""`specgov doctor`: preflight checks against a real SGLang server, before going live.

One line per check, each with the fix when it is not ``ok``; exit 0 when nothing failed
(warnings allowed), 1 when a check failed, 2 for bad usage or an invalid configuration.

What each check reads (SGLang 0.5.23):

* ``reachable``: ``GET /health`` (200 ready; 503 starting, stopping, or its one-token
  health generation got no answer).
* ``server_info``: ``GET /server_info`` (with the API key when the server has one).
* ``version``: ``/server_info`` ``version`` against the SGLang version specgov's contract
  tests check, and specgov's own version.
* ``metrics``: ``/server_info`` ``enable_metrics`` and ``GET /metrics``: every metric
  family the daemon reads (``adapters.telemetry.METRICS_READ``) must be there. SGLang
  creates a labelled series on its first use, so a freshly started server that served no
  request yet lacks some: that is a warning, run again after a few requests.
* ``speculation``: ``speculative_algorithm`` and ``speculative_eagle_topk``; adaptive
  speculation in 0.5.23 supports EAGLE/EAGLE3 (and NEXTN, an EAGLE alias) with topk 1
  only (``sglang_adaptive_unsupported_reason``, SGLang's own wording).
* ``adaptive``: ``speculative_adaptive`` on, and the ``speculative_adaptive_config`` file
  readable *from here* (the daemon reads it at the path the server reports, so it must
  be mounted at the same path) and valid by SGLang's rules.
* ``plugin``: SGLang 0.5.23 does not list loaded plugins over HTTP; what this relies on
  is the plugin's own output: statistics files in the spool's ``stats/``, written by the
  plugin on TP rank 0 about once a second while the server runs decode batches. Fresh
  files (under :data:`STATS_FRESH_S`) prove that the plugin is loaded, found the spool
  and can write it.
* ``spool``: the directory exists and passes the same ownership and mode rules as the
  daemon and the plugin (``adapters.spool.check_spool_dir``: a trusted owner, never
  writable by others, group-writable only for the configured spool group), and this
  user can write it and read the plugin's statistics.
* ``clock``: the server's HTTP ``Date`` header against this machine's clock (1 s
  resolution), judged against the table TTL (``guardrails.table_ttl_s``): step tables
  carry an absolute expiry that the plugin judges by its own clock, so a server clock
  ahead by the TTL sees every table expired on arrival. It fails past
  ``min(10 s, TTL x (1 - keepalive_fraction))``.
* ``gateway`` (with ``--fleet FILE``, the fleet governor's file): ``GET /workers`` on the
  file's smg gateway answers, and lists every replica of the file, healthy and ``ready``.
  Unreachable, or a replica missing, fails; one unhealthy or draining, or a worker the
  file does not name (the governor never moves it), warns.

In ``--mode observe`` (the daemon decides and records, publishes nothing) the plugin,
adaptive and spool checks warn instead of failing: observe mode needs none of them.
"""

from __future__ import annotations

import email.utils
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import click

from specgov.controller.cli import options as opt
from specgov.controller.cli.format import BadInput

if TYPE_CHECKING:
    import httpx

    from specgov.controller.fleet.gateway import GatewayWorker
    from specgov.controller.fleet.move import FleetFile
    from specgov.policies.engine.adaptive_config import AdaptiveConfig

Status = Literal["ok", "warn", "fail", "skip"]

SUPPORTED_SGLANG: Final = "0.5.23"
# The plugin writes a statistics window about once a second while decoding; older than
# this means it stopped (or the server is idle).
STATS_FRESH_S: Final = 30.0
CLOCK_WARN_S: Final = 2.0
# Past this a table's expiry (guardrails.table_ttl_s) is misjudged.
CLOCK_FAIL_S: Final = 10.0
# The families behind the decisions: accept length, load, latency windows (the others
# in METRICS_READ refine what these give, and a server without them still works).
ESSENTIAL_METRICS: Final = frozenset(
    {
        "sglang:generation_tokens_total",
        "sglang:spec_verify_calls_total",
        "sglang:num_requests_total",
        "sglang:prompt_tokens_total",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:request_time_per_output_token_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:time_to_first_token_seconds",
    }
)
EXIT_READY: Final = 0
EXIT_NOT_READY: Final = 1


@dataclass(frozen=True, slots=True)
class Check:
    """One preflight check: ``fix`` says what to do when ``status`` is not ok."""

    name: str
    status: Status
    detail: str
    fix: str | None = None


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    server_url: str
    spool_dir: Path | None
    mode: Literal["observe", "plugin"] = "plugin"
    api_key: str | None = None
    api_key_env: str | None = None
    spool_group: int | None = None
    timeout_s: float = 5.0
    health_timeout_s: float = 30.0
    # guardrails.table_ttl_s and keepalive_fraction (from the config, whose defaults
    # are the guard's): how much clock skew the tables bear.
    table_ttl_s: float = field(kw_only=True)
    keepalive_fraction: float = field(kw_only=True)
    fleet: FleetFile | None = None  # --fleet: also check its gateway


class _Answer:
    """One HTTP answer, or why there was none."""

    def __init__(
        self, response: httpx.Response | None, error: str | None, elapsed_s: float
    ) -> None:
        self.response = response
        self.error = error
        self.elapsed_s = elapsed_s

    @property
    def status(self) -> int | None:
        return None if self.response is None else self.response.status_code


def _get(
    client: httpx.Client, path: str, *, timeout_s: float, headers: Mapping[str, str]
) -> _Answer:
    import httpx

    start = time.monotonic()
    try:
        resp = client.get(path, timeout=timeout_s, headers=dict(headers))
    except httpx.TimeoutException:
        return _Answer(None, f"no answer within {timeout_s:g} s", time.monotonic() - start)
    except httpx.HTTPError as exc:
        return _Answer(None, f"{type(exc).__name__}: {exc}", time.monotonic() - start)
    return _Answer(resp, None, time.monotonic() - start)


def _degrade(status: Status, mode: str) -> Status:
    """Observe mode needs neither plugin nor spool: their failures are warnings there."""
    return "warn" if status == "fail" and mode == "observe" else status


class Doctor:
    """Runs every check in order against one server; see the module docstring."""

    def __init__(
        self,
        options: DoctorOptions,
        client: httpx.Client,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.o = options
        self.client = client
        self.clock = clock
        self.checks: list[Check] = []
        self.info: dict[str, Any] | None = None
        self._date: tuple[str, float] | None = None  # (Date header, local time at arrival)

    def add(self, name: str, status: Status, detail: str, fix: str | None = None) -> None:
        self.checks.append(Check(name, status, detail, fix if status != "ok" else None))

    def _headers(self) -> dict[str, str]:
        return {} if not self.o.api_key else {"Authorization": f"Bearer {self.o.api_key}"}

    # ---------------------------------------------------------------- the checks

    def run(self) -> list[Check]:
        server_up = self.reachable()
        if server_up:
            self.server_info()
        if self.info is not None:
            self.version()
            self.metrics()
            adaptive = self.speculation_and_adaptive()
        else:
            for name in ("version", "metrics", "speculation", "adaptive"):
                self.add(name, "skip", "needs an answer from /server_info (above)")
            adaptive = False
        self.spool()
        self.plugin(adaptive)
        self.clock_check()
        if self.o.fleet is not None:
            self.gateway(self.o.fleet)
        return self.checks

    def reachable(self) -> bool:
        from specgov.adapters.sglang_http import HEALTH_PATH

        answer = _get(
            self.client, HEALTH_PATH, timeout_s=self.o.health_timeout_s, headers=self._headers()
        )
        url = f"{self.o.server_url}{HEALTH_PATH}"
        if answer.response is None:
            self.add(
                "reachable",
                "fail",
                f"GET {url}: {answer.error}",
                "start the server, or point --server (server.url) at it; from a container "
                "the server's address is not 127.0.0.1 unless both share a pod",
            )
            return False
        self._date = (answer.response.headers.get("Date", ""), self.clock())
        if answer.status == 200:
            self.add("reachable", "ok", f"GET {url}: 200 in {answer.elapsed_s * 1000:.0f} ms")
            return True
        if answer.status == 503:
            self.add(
                "reachable",
                "fail",
                f"GET {url}: 503 (starting, stopping, or its health generation got no answer)",
                "wait for the server to finish loading; a 503 that lasts means the server "
                "cannot generate: read its log",
            )
            return True  # /server_info may still answer; the other checks say more
        self.add(
            "reachable",
            "fail",
            f"GET {url}: HTTP {answer.status}, which SGLang's /health never answers",
            "--server must be the SGLang server's own URL, not a gateway or proxy",
        )
        return False

    def server_info(self) -> None:
        from specgov.adapters.sglang_http import SERVER_INFO_PATH

        answer = _get(
            self.client, SERVER_INFO_PATH, timeout_s=self.o.timeout_s, headers=self._headers()
        )
        where = f"GET {self.o.server_url}{SERVER_INFO_PATH}"
        if answer.response is None:
            self.add("server_info", "fail", f"{where}: {answer.error}", "see `reachable`")
            return
        if answer.status in (401, 403):
            env = self.o.api_key_env or "SPECGOV_SGLANG_API_KEY"
            sent = "a key was sent and refused" if self.o.api_key else "no key was sent"
            self.add(
                "server_info",
                "fail",
                f"{where}: HTTP {answer.status}: the server has --api-key ({sent})",
                f"export {env}=<the server's --api-key> (the variable server.api_key_env names)",
            )
            return
        if answer.status != 200:
            self.add(
                "server_info",
                "fail",
                f"{where}: HTTP {answer.status}",
                "--server must be an SGLang 0.5.x server (it serves /server_info)",
            )
            return
        try:
            body = answer.response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self.add(
                "server_info",
                "fail",
                f"{where}: the body is not a JSON object",
                "--server must be an SGLang 0.5.x server",
            )
            return
        self.info = body
        self.add("server_info", "ok", f"{where}: 200")

    def version(self) -> None:
        from importlib import metadata

        try:
            own = metadata.version("specgov")
        except metadata.PackageNotFoundError:
            own = "unknown"
        assert self.info is not None
        theirs = self.info.get("version")
        detail = f"SGLang {theirs if isinstance(theirs, str) else 'unknown'}, specgov {own}"
        if theirs == SUPPORTED_SGLANG:
            self.add("version", "ok", detail)
        else:
            self.add(
                "version",
                "warn",
                f"{detail}; specgov's interfaces are checked against SGLang {SUPPORTED_SGLANG}",
                f"run SGLang {SUPPORTED_SGLANG}, or check `specgov status` and the contract "
                "notes in docs/architecture.md before trusting the telemetry",
            )

    def metrics(self) -> None:
        from specgov.adapters.errors import ResponseFormatError
        from specgov.adapters.prometheus_text import parse_metrics
        from specgov.adapters.sglang_http import METRICS_PATH
        from specgov.adapters.telemetry import METRICS_READ

        assert self.info is not None
        relaunch = "relaunch the server with --enable-metrics"
        if self.info.get("enable_metrics") is False:
            self.add("metrics", "fail", "the server runs without --enable-metrics", relaunch)
            return
        answer = _get(
            self.client,
            METRICS_PATH,
            timeout_s=self.o.timeout_s,
            headers={"Accept": "text/plain; version=0.0.4"},
        )
        where = f"GET {self.o.server_url}{METRICS_PATH}"
        if answer.response is None or answer.status != 200:
            why = answer.error if answer.response is None else f"HTTP {answer.status}"
            self.add("metrics", "fail", f"{where}: {why}", relaunch)
            return
        try:
            snapshot = parse_metrics(answer.response.text, source=where)
        except ResponseFormatError as exc:
            self.add(
                "metrics",
                "fail",
                str(exc)[:300],
                "--server must be the SGLang server itself (its /metrics is Prometheus text)",
            )
            return
        if not any(name.startswith("sglang:") for name in snapshot.types):
            self.add("metrics", "fail", f"{where}: no sglang: metric families", relaunch)
            return
        missing = sorted(n for n in ESSENTIAL_METRICS if not snapshot.has_metric(n))
        optional = sorted(n for n in METRICS_READ - ESSENTIAL_METRICS if not snapshot.has_metric(n))
        absent = f"; {len(optional)} optional families absent" if optional else ""
        if missing:
            self.add(
                "metrics",
                "warn",
                f"{len(ESSENTIAL_METRICS) - len(missing)} of {len(ESSENTIAL_METRICS)} "
                f"families the daemon's decisions need are exported; missing: "
                f"{', '.join(missing)}{absent}",
                "SGLang creates labelled series on first use: send a few requests and run "
                "again; if they stay missing, the server is not SGLang 0.5.23",
            )
            return
        self.add(
            "metrics",
            "ok",
            f"all {len(ESSENTIAL_METRICS)} families the daemon's decisions need{absent}",
        )

    def speculation_and_adaptive(self) -> bool:
        """Returns whether the server runs adaptive speculation the plugin can steer."""
        from specgov.adapters.launch_config import sglang_adaptive_unsupported_reason

        assert self.info is not None
        algorithm = self.info.get("speculative_algorithm")
        topk = self.info.get("speculative_eagle_topk")
        flags = (
            "specgov sglang-args --shape EAGLE3:3 --slots '1=0,1,3,5,7;8=0,1,3;32=0,1' "
            "prints the flags"
        )
        if not isinstance(algorithm, str) or algorithm.upper() in ("", "NONE"):
            self.add(
                "speculation",
                "fail",
                "the server runs without speculative decoding",
                f"relaunch with --speculative-algorithm EAGLE3 and a draft model ({flags})",
            )
            self.add("adaptive", "skip", "needs speculative decoding")
            return False
        reason = sglang_adaptive_unsupported_reason(
            algorithm.upper(), topk if isinstance(topk, int) else 1
        )
        if reason is not None:
            self.add(
                "speculation",
                _degrade("fail", self.o.mode),
                f"{algorithm}, topk {topk}: adaptive speculation is not supported ({reason}); "
                "the daemon can observe but the plugin cannot steer",
                f"for plugin mode relaunch with EAGLE/EAGLE3 and --speculative-eagle-topk 1 "
                f"({flags})",
            )
            self.add("adaptive", "skip", "not supported for this algorithm")
            return False
        steps = self.info.get("speculative_num_steps")
        self.add("speculation", "ok", f"{algorithm}, topk {topk}, {steps} steps at start")
        if self.info.get("speculative_adaptive") is not True:
            self.add(
                "adaptive",
                _degrade("fail", self.o.mode),
                "the server runs without --speculative-adaptive: its step count is fixed",
                f"relaunch with --speculative-adaptive [--speculative-adaptive-config FILE] "
                f"({flags})",
            )
            return False
        return self._adaptive_config()

    def _adaptive_config(self) -> bool:
        from specgov.policies.engine.adaptive_config import (
            DEFAULT_ADAPTIVE_CONFIG,
            parse_adaptive_config,
        )

        assert self.info is not None
        path = self.info.get("speculative_adaptive_config")
        if path is None:
            config = parse_adaptive_config(DEFAULT_ADAPTIVE_CONFIG, source="SGLang's default")
            self.add("adaptive", "ok", f"on, SGLang's default config: {_slots(config)}")
            return True
        fix = (
            f"mount the server's adaptive config at {path} where the daemon runs (the "
            "daemon reads the path /server_info reports)"
        )
        try:
            raw = json.loads(Path(str(path)).read_text())
            config = parse_adaptive_config(raw, source=str(path))
        except OSError as exc:
            self.add("adaptive", "fail", f"on, but {path} cannot be read here: {exc}", fix)
            return False
        except ValueError as exc:
            self.add(
                "adaptive",
                "fail",
                f"on, but {path} is not a config SGLang accepts: {str(exc)[:300]}",
                "regenerate it with `specgov sglang-args ... --config-out FILE`",
            )
            return False
        self.add("adaptive", "ok", f"on, {path}: {_slots(config)}")
        return True

    def spool(self) -> None:
        from specgov.adapters.spool import STATS_DIRNAME, SpoolSecurityError, check_spool_dir

        spool = self.o.spool_dir
        if spool is None:
            self.add(
                "spool",
                _degrade("fail", self.o.mode),
                "no spool directory configured (spool.dir is null)",
                "set --spool-dir (spool.dir) to the directory the server has as SPECGOV_SPOOL_DIR",
            )
            return
        if not spool.is_dir():
            self.add(
                "spool",
                _degrade("fail", self.o.mode),
                f"{spool} does not exist here",
                "create it as the daemon's user (docs/spool-security.md) and mount the same "
                "directory in the server, as SPECGOV_SPOOL_DIR",
            )
            return
        st = spool.stat()
        detail = f"{spool}: owner uid {st.st_uid}, gid {st.st_gid}, mode {st.st_mode & 0o7777:04o}"
        try:
            check_spool_dir(spool, group_gid=self.o.spool_group)
        except SpoolSecurityError as exc:
            self.add("spool", _degrade("fail", self.o.mode), f"{detail}: {exc}", _after_fix(exc))
            return
        except OSError as exc:
            self.add("spool", _degrade("fail", self.o.mode), f"{detail}: {exc}", None)
            return
        if not os.access(spool, os.W_OK | os.X_OK):
            self.add(
                "spool",
                _degrade("fail", self.o.mode),
                f"{detail}: this user (uid {os.geteuid()}) cannot write it",
                "run the daemon as the spool's owner (docs/spool-security.md)",
            )
            return
        stats = spool / STATS_DIRNAME
        if stats.is_dir() and not os.access(stats, os.R_OK | os.X_OK):
            self.add(
                "spool",
                _degrade("fail", self.o.mode),
                f"{detail}: this user cannot read {stats}",
                "share a group between the server and the daemon and set "
                "SPECGOV_SPOOL_GROUP for the server (docs/spool-security.md)",
            )
            return
        self.add("spool", "ok", f"{detail}; writable by this user")

    def plugin(self, adaptive: bool) -> None:
        from specgov.adapters.spool import STATS_DIRNAME

        if not adaptive:
            self.add("plugin", "skip", "needs adaptive speculation the plugin can steer")
            return
        spool = self.o.spool_dir
        if spool is None or not spool.is_dir():
            self.add("plugin", "skip", "needs the spool directory (above)")
            return
        install = (
            "install specgov in the server's Python environment, start it with "
            f"SGLANG_PLUGINS=specgov and SPECGOV_SPOOL_DIR={spool}, send a request, run again"
        )
        newest: tuple[float, Path] | None = None
        unreadable: list[str] = []
        try:
            files = list((spool / STATS_DIRNAME).glob("tier_stats.*.json"))
        except OSError:
            files = []
        for path in files:
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if not os.access(path, os.R_OK):
                unreadable.append(path.name)
            if newest is None or mtime > newest[0]:
                newest = (mtime, path)
        if newest is None:
            self.add(
                "plugin",
                _degrade("fail", self.o.mode),
                f"no statistics from the plugin in {spool / STATS_DIRNAME}: it is not loaded, "
                "not pointed at this spool, or the server ran no decode batch yet",
                install,
            )
            return
        age_s = self.clock() - newest[0]
        if age_s > STATS_FRESH_S:
            self.add(
                "plugin",
                _degrade("fail", self.o.mode),
                f"the plugin's last statistics are {age_s:.0f} s old ({newest[1].name})",
                "send a request and run again; if they stay old, the server restarted "
                f"without the plugin: {install}",
            )
            return
        if unreadable:
            self.add(
                "plugin",
                _degrade("fail", self.o.mode),
                f"{len(unreadable)} statistics files cannot be read by this user "
                f"(e.g. {unreadable[0]})",
                "set SPECGOV_SPOOL_GROUP to a group the daemon's user is in, for the server "
                "(docs/spool-security.md)",
            )
            return
        writer = newest[1].name.split(".")[1]
        self.add(
            "plugin",
            "ok",
            f"loaded: statistics written {max(age_s, 0.0):.0f} s ago by {writer}",
        )

    def clock_check(self) -> None:
        if self._date is None:
            self.add("clock", "skip", "needs an answer from /health (above)")
            return
        date, arrived = self._date
        if not date:
            self.add("clock", "skip", "the server sent no Date header to compare with")
            return
        try:
            theirs = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            self.add("clock", "skip", f"the server's Date header {date[:60]!r} is not a date")
            return
        # The header is truncated to whole seconds: its middle is the best estimate.
        skew = arrived - (theirs + 0.5)
        ttl_s = self.o.table_ttl_s
        detail = f"this machine is {skew:+.1f} s from the server (Date header, ±1 s)"
        ahead_s = -skew  # the server's clock ahead of this one: tables age that much early
        if ahead_s >= ttl_s:
            detail += (
                f"; with the table TTL of {ttl_s:g} s (guardrails.table_ttl_s) every table "
                "would have expired when the plugin reads it"
            )
        elif ahead_s > CLOCK_WARN_S:
            detail += (
                f"; a table (TTL {ttl_s:g} s) would be followed for only {ttl_s - ahead_s:.0f} s"
            )
        fix = "synchronise both clocks (NTP); step tables expire by absolute time"
        # Past the TTL's margin (the part after the daemon re-issues a table) the plugin
        # falls back between two re-issues; beyond CLOCK_FAIL_S expiry is misjudged anyway.
        fail_s = min(CLOCK_FAIL_S, ttl_s * (1.0 - self.o.keepalive_fraction))
        if abs(skew) <= min(CLOCK_WARN_S, fail_s):
            self.add("clock", "ok", detail)
        elif abs(skew) <= fail_s:
            self.add("clock", "warn", detail, fix)
        else:
            self.add("clock", "fail", detail, fix)

    def gateway(self, fleet: FleetFile) -> None:
        from specgov.controller.fleet.gateway import GatewayError, SmgGateway, gateway_token

        gw = SmgGateway(fleet.gateway, timeout_s=self.o.timeout_s, token=gateway_token())
        try:
            workers = gw.workers()
        except GatewayError as exc:
            self.add(
                "gateway",
                "fail",
                f"smg at {fleet.gateway}: {exc}",
                "start smg (smg launch --worker-urls ...) or correct gateway: in the fleet file",
            )
            return
        finally:
            gw.close()
        self.add("gateway", *judge_gateway(fleet, workers))


def judge_gateway(fleet: FleetFile, workers: list[GatewayWorker]) -> tuple[Status, str, str | None]:
    """The ``gateway`` check's verdict on the workers smg lists for ``fleet``."""
    by_url = {w.url: w for w in workers}
    missing = [r.name for r in fleet.replicas if r.url not in by_url]
    if missing:
        return (
            "fail",
            f"smg at {fleet.gateway} does not list {', '.join(missing)} "
            f"({len(workers)} worker(s) registered)",
            'register them (smg launch --worker-urls, or POST /workers {"url": ...})',
        )
    unwell = [
        f"{r.name} ({by_url[r.url].status}{'' if by_url[r.url].healthy else ', unhealthy'})"
        for r in fleet.replicas
        if not by_url[r.url].healthy or by_url[r.url].status != "ready"
    ]
    known = {r.url for r in fleet.replicas}
    strangers = sorted(w.url for w in workers if w.url not in known)
    n = len(fleet.replicas)
    if unwell:
        return (
            "warn",
            f"smg lists all {n} replicas, not all serving: {', '.join(unwell)}",
            ("wait for the replica's health check, or see its server log"),
        )
    if strangers:
        return (
            "warn",
            f"smg lists all {n} replicas and {', '.join(strangers)}",
            ("add them to the fleet file's replicas, or the governor never moves them"),
        )
    return "ok", f"smg at {fleet.gateway} lists all {n} replicas, healthy and ready", None


def _slots(config: AdaptiveConfig) -> str:
    steps = sorted({k for s in config.slots for k in s.candidate_steps})
    bounds = [s.bound for s in config.slots]
    return (
        f"{len(bounds)} slots from batch {bounds[0]} to {bounds[-1]}, "
        f"candidate steps {','.join(str(k) for k in steps)}"
    )


def _after_fix(exc: BaseException) -> str | None:
    text = str(exc)
    return text.split("fix: ", 1)[1] if "fix: " in text else None


# ------------------------------------------------------------------------ output

_MARK: Final[dict[str, str]] = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def render_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        line = f"{_MARK[c.status]}  {c.name:<{width}}  {c.detail}"
        if c.fix:
            line += f"  -> fix: {c.fix}"
        lines.append(line)
    failed = [c.name for c in checks if c.status == "fail"]
    warned = [c.name for c in checks if c.status == "warn"]
    if failed:
        lines.append(f"not ready: {len(failed)} failed ({', '.join(failed)})")
    else:
        tail = f" with {len(warned)} warning(s) ({', '.join(warned)})" if warned else ""
        lines.append(f"ready{tail}")
    return "\n".join(lines)


def run_doctor(options: DoctorOptions, *, clock: Callable[[], float] = time.time) -> list[Check]:
    """Every check against ``options.server_url``, in order."""
    import httpx

    with httpx.Client(
        base_url=options.server_url.rstrip("/"),
        follow_redirects=False,
        headers={"User-Agent": "specgov-doctor/0.1"},
    ) as client:
        return Doctor(options, client, clock=clock).run()


@click.command(name="doctor")
@click.option("--server", default=None, help="SGLang base URL (default: server.url).")
@opt.config_option("The daemon's config file: server URL, API key variable, spool directory.")
@click.option(
    "--spool-dir", type=click.Path(path_type=Path), default=None,
    help="The spool shared with the server (default: spool.dir).",
)  # fmt: skip
@click.option(
    "--mode", type=click.Choice(["observe", "plugin"]), default="plugin", show_default=True,
    help="What to be ready for: observe needs no plugin, adaptive config or spool.",
)  # fmt: skip
@click.option(
    "--timeout-s", type=click.FloatRange(min=0, min_open=True), default=5.0,
    show_default=True, help="Timeout of each request (the health check gets 30 s).",
)  # fmt: skip
@click.option(
    "--fleet", "fleet_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="A fleet file (specgov fleet): also check that its smg gateway lists its replicas.",
)  # fmt: skip
@opt.output_option("One line per check with its fix for people, or one JSON object for scripts.")
def doctor_cmd(
    server: str | None,
    config_file: Path | None,
    spool_dir: Path | None,
    mode: Literal["observe", "plugin"],
    timeout_s: float,
    fleet_file: Path | None,
    output: str,
) -> None:
    """Check an SGLang server before putting specgov next to it.

    One line per check with the fix; exit 0 when ready (warnings allowed), 1 when a
    check failed, 2 for bad usage or configuration. Run it where the daemon will run,
    as the daemon's user: the spool and adaptive-config checks read the files from here.
    """
    from specgov.adapters.spool import SPOOL_GROUP_ENV, SpoolError, resolve_gid
    from specgov.controller.daemon.config import load_config
    from specgov.controller.daemon.config_values import ConfigError
    from specgov.controller.fleet.move import FleetFileError, load_fleet_file

    try:
        fleet = None if fleet_file is None else load_fleet_file(fleet_file)
        config = load_config(config_file)
        group = resolve_gid(
            getattr(config.spool, "group", None) or os.environ.get(SPOOL_GROUP_ENV) or None,
            where=f"spool.group or env {SPOOL_GROUP_ENV}",
        )
    except (ConfigError, SpoolError, FleetFileError, ValueError) as exc:
        raise BadInput(str(exc)) from None
    url = server if server is not None else config.server.url
    if not url.startswith(("http://", "https://")) or not math.isfinite(timeout_s):
        raise click.UsageError(f"--server: expected an http(s) URL, got {url!r}")
    options = DoctorOptions(
        server_url=url.rstrip("/"),
        spool_dir=spool_dir if spool_dir is not None else config.spool.dir,
        mode=mode,
        api_key=config.server.api_key(),
        api_key_env=config.server.api_key_env,
        spool_group=group,
        timeout_s=timeout_s,
        health_timeout_s=max(30.0, timeout_s),
        table_ttl_s=float(config.guardrails["table_ttl_s"]),
        keepalive_fraction=float(config.guardrails["keepalive_fraction"]),
        fleet=fleet,
    )
    checks = run_doctor(options)
    ready = not any(c.status == "fail" for c in checks)
    if output == "json":
        click.echo(json.dumps({"ready": ready, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        click.echo(render_table(checks))
    raise SystemExit(EXIT_READY if ready else EXIT_NOT_READY)
