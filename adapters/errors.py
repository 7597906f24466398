"""Typed errors of specgov's SGLang telemetry adapters.

Three kinds (``ScrapeError.kind``, the ``kind`` label of the daemon's
``specgov_scrape_errors_total``), so the daemon can decide what to do without parsing
messages:

* :class:`TemporaryScrapeError` (``"temporary"``) — worth retrying with backoff: a
  timeout, a refused or dropped connection, ``503`` (SGLang answers 503 while starting or
  shutting down) or any other 5xx, ``429``.
* :class:`ResponseFormatError` (``"format"``), a temporary error too: a body that does not
  parse (garbage, or a ``/metrics`` body cut short by a proxy or a server restart mid-
  answer). The next scrape may well parse, so it is treated like an outage — the last
  good table stays alive for the same bound — and counted apart from one.
* :class:`PermanentScrapeError` (``"permanent"``) — retrying cannot help: ``401``/``403``
  (missing or wrong ``--api-key``), ``404`` (the endpoint does not exist: not an SGLang
  0.5.x server, or ``/metrics`` without ``--enable-metrics``), another 4xx.

Every error names the URL (or the source of a body) and what was expected there.
Messages carry text from upstream (a body's first bytes, a label value, an exception's
text): :func:`escape_upstream` makes each part one printable line of bounded length (NUL,
ESC, CR, newlines and other control or invisible characters escaped as ``\\xNN``,
``\\uNNNN``; overlong text cut with a marker that gives its full length), so nothing raw
reaches a log. No IO here: the pure parsers raise :class:`ResponseFormatError` too.
"""

from __future__ import annotations

import reprlib
from typing import ClassVar, Final

from specgov.policies.common.errors import PermanentError, SpecgovError, TemporaryError

# Bounds of the parts of a message (characters, after escaping). A detail quotes at most
# a line or a value; a URL or an expected form longer than this is not one we built.
DETAIL_MAX_CHARS: Final = 512
URL_MAX_CHARS: Final = 256
EXPECTED_MAX_CHARS: Final = 512

_SHORT_ESCAPES: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    short = _SHORT_ESCAPES.get(ch)
    if short is not None:
        return short
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape_upstream(text: object, limit: int = DETAIL_MAX_CHARS) -> str:
    """``text`` as one printable line of at most about ``limit`` characters.

    Every character ``str.isprintable`` refuses (C0/C1 controls such as NUL, ESC, CR and
    newline; DEL; format characters such as bidi overrides; line and paragraph
    separators; lone surrogates) is written as a Python-style escape. Text longer than
    ``limit`` is cut and ends with ``"... [cut: N characters in all]"``. Only the first
    ``limit`` characters are looked at, so a huge input costs no more than a short one.
    """
    if not isinstance(text, str):
        text = str(text)
    total = len(text)
    head = text[:limit]
    out = head if head.isprintable() else "".join(_escape_char_or_not(ch) for ch in head)
    cut = total > limit
    if len(out) > limit:  # escapes made it longer: cut, and never inside an escape
        out = out[:limit]
        slash = out.rfind("\\", max(0, limit - 10))
        out = out[:slash] if slash >= 0 else out
        cut = True
    return f"{out}... [cut: {total} characters in all]" if cut else out


def _escape_char_or_not(ch: str) -> str:
    return ch if ch.isprintable() else _escape_char(ch)


def eliding_repr(*, chars: int, digits: int, items: int) -> reprlib.Repr:
    """A :mod:`reprlib` ``Repr`` for messages: three levels deep, strings and other
    objects cut at *chars*, ints at *digits*, every container at *items* entries."""
    shown = reprlib.Repr()
    shown.maxlevel = 3
    shown.maxstring = chars
    shown.maxother = chars
    shown.maxlong = digits
    for name in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque"):
        setattr(shown, name, items)
    return shown


_REPR: Final = eliding_repr(chars=160, digits=60, items=8)


def bounded_repr(value: object, limit: int = DETAIL_MAX_CHARS) -> str:
    """``repr(value)`` for a message: nested containers and long strings elided
    (:mod:`reprlib`), so a huge upstream body is never rendered whole, then escaped."""
    return escape_upstream(_REPR.repr(value), limit)


class ScrapeError(SpecgovError):
    """Talking to an SGLang server failed; ``url`` and ``expected`` say where and what.

    ``url``, ``expected`` and ``detail`` are stored escaped and bounded
    (:func:`escape_upstream`), so ``str(error)`` is safe to log as it is.
    """

    kind: ClassVar[str] = "temporary"

    def __init__(
        self,
        url: str,
        expected: str,
        detail: str,
        *,
        status_code: int | None = None,
        attempts: int = 1,
    ) -> None:
        self.url = escape_upstream(url, URL_MAX_CHARS)
        self.expected = escape_upstream(expected, EXPECTED_MAX_CHARS)
        self.detail = escape_upstream(detail, DETAIL_MAX_CHARS)
        self.status_code = status_code
        self.attempts = attempts
        status = "" if status_code is None else f" (HTTP {status_code})"
        tries = "" if attempts <= 1 else f" after {attempts} attempts"
        super().__init__(f"{self.url}{status}{tries}: {self.detail}; expected {self.expected}")


class TemporaryScrapeError(ScrapeError, TemporaryError):
    """A failure that may clear by itself (timeout, connection refused, 503, 5xx, 429)."""

    kind: ClassVar[str] = "temporary"


class PermanentScrapeError(ScrapeError, PermanentError):
    """A failure retrying cannot fix (401/403 bad key, 404 wrong server, other 4xx)."""

    kind: ClassVar[str] = "permanent"


class ResponseFormatError(TemporaryScrapeError, ValueError):
    """A body (Prometheus text or JSON) is not in the form SGLang 0.5.23 produces.

    Temporary (kind ``"format"``): a truncated or garbled body is not retried at once,
    but the next scrape may parse. ``url`` is the URL it came from, or a label such as
    ``"<metrics text>"`` when a pure parser was handed the text directly.
    """

    kind: ClassVar[str] = "format"
