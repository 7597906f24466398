"""The fleet governor's hands on the gateway: SGLang's model gateway ``smg`` (1.13).

How a replica leaves and rejoins the gateway, as ``smg`` 1.13.0 does it (checked against
the real binary, ``tests/test_fleet_gateway.py``):

* ``GET /workers`` lists the registered workers (``id``, ``url``, ``is_healthy``,
  ``status``: ``ready``, ``draining``, ...).
* ``DELETE /workers/{id}`` answers 202 and drains: the worker gets status ``draining``
  and no new request, the requests it is serving run to the end, then it leaves the
  list. This is the drain the governor uses.
* ``POST /workers {"url": ...}`` registers a worker again (409 while the old entry is
  still draining); the gateway reads its ``/server_info`` and ``/model_info`` and
  health-checks it before routing to it.

Not the discovery file: smg 1.13 reads a ``--discovery-provider file`` manifest
(``{"version": 1, "workers": [{"url": ...}]}``) and drains a worker dropped from it the
same way, but only at its next reread (seconds later), and with file discovery it routes
in its multi-model mode, where a ``/generate`` body without a ``model`` field is refused
(400 ``missing_model``): SGLang-native clients break. The ``/workers`` API acts at once
and keeps ``/generate`` as SGLang's.

Access: smg started with ``--control-plane-api-keys 'id:name:admin:KEY'`` answers 401 on
``/workers`` without ``Authorization: Bearer KEY`` (checked against the binary; generation
routes are not affected). The governor sends the key from ``SPECGOV_FLEET_GATEWAY_TOKEN``
(:func:`gateway_token`) when it is set; a gateway reachable beyond loopback should have one.

Every wait is bounded (``timeout_s``) and polls at ``poll_s``. Errors are typed:
:class:`GatewayError` with ``temporary`` True for what may pass (connection refused,
timeouts, 5xx, a worker still draining), False for what will not (a 4xx the gateway
means).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpx

from specgov.policies.common.errors import SpecgovError

DEFAULT_TIMEOUT_S: Final = 5.0
DEFAULT_POLL_S: Final = 0.25
TOKEN_ENV: Final = "SPECGOV_FLEET_GATEWAY_TOKEN"
# smg 1.13's count of the generation requests its router received, per label set (router
# and backend type, endpoint, streaming). Counted on arrival: measured against its
# workers' finished and in-flight counts (sum finished < it <= sum finished + in flight).
SMG_ROUTER_REQUESTS: Final = "smg_router_requests_total"


def gateway_token(env: Mapping[str, str] = os.environ) -> str | None:
    """The gateway's control-plane key from ``SPECGOV_FLEET_GATEWAY_TOKEN`` (None: unset)."""
    token = env.get(TOKEN_ENV, "").strip()
    return token or None


class GatewayError(SpecgovError):
    """A gateway call that failed; ``temporary``: it may succeed if retried later."""

    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__(message)
        self.temporary = temporary


@dataclass(frozen=True)
class GatewayWorker:
    id: str
    url: str
    healthy: bool
    status: str
    load: float


def _parse_worker(raw: object, where: str) -> GatewayWorker:
    if not isinstance(raw, dict):
        raise GatewayError(f"{where}: expected a worker object", temporary=False)
    wid, url = raw.get("id"), raw.get("url")
    if not isinstance(wid, str) or not isinstance(url, str):
        raise GatewayError(f"{where}: a worker needs string id and url", temporary=False)
    load = raw.get("load", 0)
    return GatewayWorker(
        id=wid,
        url=url.rstrip("/"),
        healthy=bool(raw.get("is_healthy", False)),
        status=str(raw.get("status", "unknown")),
        load=float(load) if isinstance(load, int | float) else 0.0,
    )


class SmgGateway:
    """A client of one ``smg`` gateway's worker API (module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        token: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._poll_s = poll_s
        self._sleep = sleep
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        # No proxy from the environment: the gateway is on the operator's network.
        self._client = httpx.Client(
            timeout=timeout_s, transport=transport, trust_env=False, headers=headers
        )

    def close(self) -> None:
        self._client.close()

    def _call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        try:
            return self._client.request(method, f"{self.url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise GatewayError(
                f"gateway {self.url}: {method} {path} failed: {exc}", temporary=True
            ) from exc

    def workers(self) -> list[GatewayWorker]:
        r = self._call("GET", "/workers")
        if r.status_code != 200:
            raise GatewayError(
                f"gateway {self.url}: GET /workers answered {r.status_code}",
                temporary=r.status_code >= 500,
            )
        try:
            raw = r.json()
        except ValueError as exc:
            raise GatewayError(f"gateway {self.url}: /workers is not JSON", temporary=True) from exc
        items = raw.get("workers") if isinstance(raw, dict) else None
        if not isinstance(items, list):
            raise GatewayError(
                f"gateway {self.url}: /workers has no 'workers' list", temporary=False
            )
        return [_parse_worker(w, f"/workers[{i}]") for i, w in enumerate(items)]

    def find(self, worker_url: str) -> GatewayWorker | None:
        want = worker_url.rstrip("/")
        return next((w for w in self.workers() if w.url == want), None)

    def drain(self, worker_url: str) -> None:
        """Stop new requests to ``worker_url``; those it serves finish (module docstring)."""
        worker = self.find(worker_url)
        if worker is None:
            raise GatewayError(f"gateway {self.url}: no worker at {worker_url}", temporary=False)
        r = self._call("DELETE", f"/workers/{worker.id}")
        if r.status_code not in (200, 202, 204):
            raise GatewayError(
                f"gateway {self.url}: DELETE /workers/{worker.id} answered {r.status_code}: "
                f"{r.text[:200]}",
                temporary=r.status_code >= 500,
            )

    def add(self, worker_url: str) -> None:
        r = self._call("POST", "/workers", {"url": worker_url})
        if r.status_code == 409:
            raise GatewayError(
                f"gateway {self.url}: {worker_url} is still registered (draining)", temporary=True
            )
        if r.status_code not in (200, 201, 202):
            raise GatewayError(
                f"gateway {self.url}: POST /workers answered {r.status_code}: {r.text[:200]}",
                temporary=r.status_code >= 500,
            )

    def _wait(self, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: GatewayError | None = None
        while True:
            try:
                if done():
                    return
                last = None
            except GatewayError as exc:
                if not exc.temporary:
                    raise
                last = exc
            if time.monotonic() >= deadline:
                why = f" (last error: {last})" if last is not None else ""
                raise GatewayError(
                    f"gateway {self.url}: {what} not done after {timeout_s:g} s{why}",
                    temporary=True,
                )
            self._sleep(self._poll_s)

    def wait_drained(self, worker_url: str, timeout_s: float) -> None:
        """Until the drained worker has left the gateway (its requests are done)."""
        self._wait(lambda: self.find(worker_url) is None, f"draining {worker_url}", timeout_s)

    def wait_healthy(self, worker_url: str, timeout_s: float) -> None:
        """Until ``worker_url`` is registered, healthy and ready for requests."""

        def ready() -> bool:
            w = self.find(worker_url)
            return w is not None and w.healthy and w.status == "ready"

        self._wait(ready, f"{worker_url} to be healthy in the gateway", timeout_s)


def gateway_requests(metrics_url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float | None:
    """The requests smg's router has received (:data:`SMG_ROUTER_REQUESTS`, every label
    set summed), from its Prometheus endpoint (``smg launch --prometheus-port``); None
    when it does not answer or exports no such count. The fleet's demand: requests the
    gateway refused or failed count too, as they would not at the replicas."""
    from specgov.adapters.prometheus_text import parse_metrics

    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            r = client.get(f"{metrics_url.rstrip('/')}/metrics")
        r.raise_for_status()
        snap = parse_metrics(r.text, families={SMG_ROUTER_REQUESTS})
    except (httpx.HTTPError, ValueError):
        return None
    found = [v for k, v in snap.counters.items() if k.name == SMG_ROUTER_REQUESTS]
    return sum(found) if found else None


@contextlib.contextmanager
def launched_smg(
    binary: str | os.PathLike[str],
    worker_urls: Sequence[str],
    *,
    port: int,
    metrics_port: int,
    policy: str = "round_robin",
    host: str = "127.0.0.1",
    healthy_within_s: float = 60.0,
) -> Iterator[SmgGateway]:
    """A real ``smg launch`` on ``host:port`` over ``worker_urls`` (its Prometheus
    endpoint on ``metrics_port``), each worker healthy in it, and the governor's client
    of it; the gateway process is stopped on exit. For the simulated fleet's benchmark
    and tests: a production gateway is the operator's, started by its own manager."""
    argv = [os.fspath(binary), "launch", "--host", host, "--port", str(port)]
    argv += ["--worker-urls", *worker_urls, "--policy", policy]
    argv += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gw = SmgGateway(f"http://{host}:{port}", poll_s=0.1)
    try:
        for url in worker_urls:
            gw.wait_healthy(url, healthy_within_s)
        yield gw
    finally:
        gw.close()
        proc.kill()
        proc.wait(30)
