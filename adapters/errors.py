"""Typed errors of specgov's SGLang telemetry adapters.

Two families, so the daemon can decide what to do without parsing messages:

* :class:`TemporaryScrapeError` — worth retrying with backoff: a timeout, a refused or
  dropped connection, ``503`` (SGLang answers 503 while starting or shutting down) or any
  other 5xx, ``429``.
* :class:`PermanentScrapeError` — retrying cannot help: ``401``/``403`` (missing or wrong
  ``--api-key``), ``404`` (the endpoint does not exist: not an SGLang 0.5.x server, or
  ``/metrics`` without ``--enable-metrics``), another 4xx, or a body that does not parse
  (:class:`ResponseFormatError`).

Every error names the URL (or the source of a body) and what was expected there.
No IO here: the pure parsers raise :class:`ResponseFormatError` too.
"""

from __future__ import annotations


class ScrapeError(Exception):
    """Talking to an SGLang server failed; ``url`` and ``expected`` say where and what."""

    def __init__(
        self,
        url: str,
        expected: str,
        detail: str,
        *,
        status_code: int | None = None,
        attempts: int = 1,
    ) -> None:
        self.url = url
        self.expected = expected
        self.detail = detail
        self.status_code = status_code
        self.attempts = attempts
        status = "" if status_code is None else f" (HTTP {status_code})"
        tries = "" if attempts <= 1 else f" after {attempts} attempts"
        super().__init__(f"{url}{status}{tries}: {detail}; expected {expected}")


class TemporaryScrapeError(ScrapeError):
    """A failure that may clear by itself (timeout, connection refused, 503, 5xx, 429)."""


class PermanentScrapeError(ScrapeError):
    """A failure retrying cannot fix (401/403 bad key, 404 wrong server, bad body)."""


class ResponseFormatError(PermanentScrapeError, ValueError):
    """A body (Prometheus text or JSON) is not in the form SGLang 0.5.23 produces.

    ``url`` is the URL it came from, or a label such as ``"<metrics text>"`` when a pure
    parser was handed the text directly.
    """
