"""One rate limit for repeated log lines, used by the spool (plugin and daemon side) and
the daemon itself.

A fault that repeats every poll (an unreadable spool, a server that is down) must not
write a log line every second: the first line of a kind is logged at once, the rest
within ``interval_s`` are counted, and the count goes out with the next line logged
for that kind. ``resolve(kind)`` says the condition cleared, so its next occurrence is
logged at once. Every message is escaped and bounded (:func:`escape_upstream`): text
from upstream (a body, an exception, a path another user chose) never reaches a log
raw.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from specgov.adapters.errors import escape_upstream

__all__ = ["DEFAULT_LOG_INTERVAL_S", "MAX_LOGGED_CHARS", "LogThrottle"]

DEFAULT_LOG_INTERVAL_S: Final = 60.0
# A log line quotes a few messages (a URL, a cause, a fix); longer is not one of ours.
MAX_LOGGED_CHARS: Final = 2000


@dataclass
class _Kind:
    last_logged_s: float
    suppressed: int = 0


@dataclass
class LogThrottle:
    """Per-kind rate limit for log lines (see the module docstring). Thread-safe.

    ``clock`` should be monotonic (a wall-clock step would otherwise hold a kind back
    for the step's length; a clock that went backwards logs at once).
    ``on_suppressed(kind)`` is called for every line not written (a metric counter).
    """

    logger: logging.Logger
    clock: Callable[[], float]
    interval_s: float = DEFAULT_LOG_INTERVAL_S
    on_suppressed: Callable[[str], None] | None = None
    _kinds: dict[str, _Kind] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def log(self, level: int, kind: str, message: str) -> bool:
        """Log ``message`` unless ``kind`` was logged within ``interval_s``; True if written."""
        now = self.clock()
        with self._lock:
            state = self._kinds.get(kind)
            if state is not None and 0.0 <= now - state.last_logged_s < self.interval_s:
                state.suppressed += 1
                held = True
            else:
                self._kinds[kind] = _Kind(last_logged_s=now)
                held = False
        if held:
            if self.on_suppressed is not None:
                self.on_suppressed(kind)
            return False
        text = escape_upstream(message, MAX_LOGGED_CHARS)
        if state is not None and state.suppressed:
            text += (
                f" ({state.suppressed} similar message(s) suppressed in the last "
                f"{now - state.last_logged_s:.0f} s)"
            )
        self.logger.log(level, "%s", text)
        return True

    def warning(self, kind: str, message: str) -> bool:
        return self.log(logging.WARNING, kind, message)

    def error(self, kind: str, message: str) -> bool:
        return self.log(logging.ERROR, kind, message)

    def suppressed(self, kind: str) -> int:
        """Lines of ``kind`` held back since the last one written."""
        with self._lock:
            state = self._kinds.get(kind)
            return 0 if state is None else state.suppressed

    def resolve(self, kind: str) -> int:
        """The condition behind ``kind`` cleared: the next one is logged at once.
        Returns how many lines of it were suppressed since the last one written."""
        with self._lock:
            state = self._kinds.pop(kind, None)
        return 0 if state is None else state.suppressed
