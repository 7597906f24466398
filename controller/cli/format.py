"""How the CLI renders numbers, times and decision messages for people.

One place so every command says the same thing the same way: a missing value is
"unknown" (never ``None`` or ``nan``), numbers are rounded with thousands separators,
durations read "1m52s", instants read as local ISO time or relative to now ("in
1m52s", "12s ago"), never as epoch floats. JSON output is never passed through here:
it keeps the daemon's exact values.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, TypeGuard

import click

from specgov.policies.common.errors import SpecgovError

if TYPE_CHECKING:
    from rich.table import Table

UNKNOWN: Final = "unknown"

# Below this share of requests meeting the SLO, the server is overloaded at the replayed
# load: goodput ratios then compare runs where most requests failed, and saying so
# comes before any ratio.
OVERLOAD_SLO_ATTAINMENT: Final = 0.5

# Epoch seconds in a message: 10 integer digits (2001..2286), with or without a fraction.
_EPOCH_IN_TEXT: Final = re.compile(r"\b(until|at) (1[0-9]{9}(?:\.[0-9]+)?) s\b")
# "table v2 [1:4, 8:3, ...]": the summary names the version; the slots are in the table.
_TABLE_LIST: Final = re.compile(r"(table v[0-9]+) \[[^\]]*\]")
# The guardrails' note carrying the inner policy's word: "policy NAME: REASON: [NAME: ]TEXT".
_INNER: Final = re.compile(r"^policy (\S+): ([a-z_]+)(?:: (?:\1: )?(.*))?$")


def is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def number(value: Any, digits: int = 1, unit: str = "") -> str:
    """``1234.56 -> "1,234.6"``; None, NaN and inf -> "unknown"; a unit is appended."""
    if not is_number(value) or not math.isfinite(value):
        return UNKNOWN if value is None or is_number(value) else str(value)
    text = f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"
    return f"{text} {unit}" if unit else text


def cell(value: Any, digits: int = 1) -> str:
    """A plan table's cell: None or NaN "-" (nothing to say: no price, no passing
    rate), a flag yes/no, a float rounded with thousands separators, anything else as is."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def percent(fraction: Any, digits: int = 0) -> str:
    """``0.123 -> "12%"``; unknown as above."""
    if not is_number(fraction) or not math.isfinite(fraction):
        return UNKNOWN
    return f"{100.0 * fraction:.{digits}f}%"


def text(value: Any) -> str:
    """Any table cell: None -> "unknown", floats rounded, booleans as yes/no."""
    if value is None:
        return UNKNOWN
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return number(value, 2 if abs(value) < 10 else 1)
    return str(value)


def duration(seconds: Any) -> str:
    """``112 -> "1m52s"``, ``0.4 -> "0.4s"``, ``7260 -> "2h01m"``, ``90000 -> "1d01h"``."""
    if not is_number(seconds) or not math.isfinite(seconds):
        return UNKNOWN
    s = abs(float(seconds))
    sign = "-" if seconds < 0 else ""
    if s < 10:
        return f"{sign}{s:.1f}s"
    whole = round(s)
    if whole < 60:
        return f"{sign}{whole}s"
    if whole < 3600:
        return f"{sign}{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{sign}{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{sign}{whole // 86400}d{whole % 86400 // 3600:02d}h"


def relative(at_s: Any, now_s: float) -> str:
    """An instant relative to now: "in 1m52s", "12s ago", "now"."""
    if not is_number(at_s) or not math.isfinite(at_s):
        return UNKNOWN
    delta = float(at_s) - now_s
    if abs(delta) < 0.5:
        return "now"
    return f"in {duration(delta)}" if delta > 0 else f"{duration(-delta)} ago"


def clock(at_s: Any, now_s: float | None = None) -> str:
    """Local time of an instant: "12:38:46" within the same day as ``now_s``, else the
    ISO date and time "2026-12-01T12:38:46+00:00"."""
    if not is_number(at_s) or not math.isfinite(at_s):
        return UNKNOWN
    when = datetime.fromtimestamp(float(at_s)).astimezone()
    if now_s is not None and datetime.fromtimestamp(now_s).astimezone().date() == when.date():
        return when.strftime("%H:%M:%S")
    return when.isoformat(timespec="seconds")


def instant(at_s: Any, now_s: float) -> str:
    """Both: "12:40:03 (in 1m52s)"."""
    if not is_number(at_s) or not math.isfinite(at_s):
        return UNKNOWN
    return f"{clock(at_s, now_s)} ({relative(at_s, now_s)})"


def humanize_epochs(message: str, now_s: float) -> str:
    """Rewrite "until 1796128720.1 s" in a message as "until 12:40:03 (in 1m52s)".

    Only exact epoch numbers are rewritten; a rounded one ("1.79611e+09") is left as
    written rather than shown as a time it is not.
    """
    return _EPOCH_IN_TEXT.sub(
        lambda m: f"{m.group(1)} {instant(float(m.group(2)), now_s)}", message
    )


def _split_top_level(message: str, sep: str = "; ") -> list[str]:
    """Split at ``sep`` outside brackets and parentheses (policy details nest "; ")."""
    parts: list[str] = []
    depth = 0
    start = 0
    i = 0
    while i < len(message):
        ch = message[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif depth == 0 and message.startswith(sep, i):
            parts.append(message[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(message[start:])
    return [p for p in parts if p]


def _strip_detail(part: str) -> str:
    """Drop a trailing parenthesised detail ("... (slot 1: k=4 B=1.9 ...)")."""
    if part.endswith(")"):
        depth = 0
        for i in range(len(part) - 1, -1, -1):
            if part[i] == ")":
                depth += 1
            elif part[i] == "(":
                depth -= 1
                if depth == 0:
                    head = part[:i].rstrip()
                    # Keep short parentheticals such as "(expected gain +2.1%)".
                    return head if len(part) - i > 40 and head else part
    return part


def decision_summary(message: Any, *, width: int = 110) -> str:
    """One line for a decision: the guardrails' headline and notes, without the inner
    policy's per-slot detail (that stays in the full message: --verbose, JSON).

    The inner policy's own headline is added only when it still fits in ``width``.
    """
    if not isinstance(message, str) or not message:
        return ""
    kept: list[str] = []
    inner: str | None = None
    for part in _split_top_level(message):
        part = _TABLE_LIST.sub(r"\1", _strip_detail(part))
        match = _INNER.match(part)
        if match is not None and kept:
            name, reason, rest = match.groups()
            inner = f"policy {name} ({reason}): {rest}" if rest else f"policy {name} ({reason})"
            break
        kept.append(part)
    line = "; ".join(kept)
    if inner is not None and len(line) + 2 + len(inner) <= width:
        line = f"{line}; {inner}"
    if len(line) > width:
        line = line[: width - 1].rstrip() + "…"
    return line


def throughput(wall_rate_tok_s: Any, speed: float | None) -> str:
    """A rate the daemon measured over its own (wall) clock, in the server's time.

    Against a real server that is real tokens per second. The simulated server runs
    *speed* simulated seconds per wall second, so its own (simulated) rate is the wall
    rate / *speed*: that is the headline, labelled "simulated", with the wall rate beside
    it when they differ.
    """
    if not is_number(wall_rate_tok_s):
        return number(None)
    if speed is None:
        return f"{number(wall_rate_tok_s, 0)} tok/s"
    simulated = f"{number(wall_rate_tok_s / speed, 0)} tok/s simulated"
    if speed == 1:
        return simulated
    return f"{simulated} ({number(wall_rate_tok_s, 0)} per wall second at {speed:g}x)"


def goodput_legend(slo: dict[str, Any], *, baseline: str | None) -> str:
    """What "goodput" and "vs ema" mean, printed under every table that shows them."""
    limits = [f"TPOT <= {slo['tpot_ms']:g} ms"] if slo.get("tpot_ms") is not None else []
    if slo.get("ttft_ms") is not None:
        limits.append(f"TTFT <= {slo['ttft_ms']:g} ms")
    text = (
        "goodput: output tokens per second (simulated) of the requests that met the SLO "
        f"({' and '.join(limits) or 'none set'}); SLO %: the share of requests that met it."
    )
    if baseline is not None:
        text += f" vs ema: goodput / {baseline}'s goodput on the same trace."
    return text


def is_overloaded(row: dict[str, Any]) -> bool:
    """A run (a replay JSON policy row) where most requests missed the SLO."""
    attained = row.get("slo_attainment")
    return is_number(attained) and attained < OVERLOAD_SLO_ATTAINMENT


def vs_baseline(row: dict[str, Any], base: dict[str, Any] | None) -> str:
    """The "vs ema" cell: *row*'s goodput over the baseline's, marked when *row* is
    overloaded (the ratio then compares runs that mostly failed the SLO)."""
    if base is None or not is_number(base.get("goodput_tok_s")) or base["goodput_tok_s"] <= 0:
        return "-"
    ratio = f"{row['goodput_tok_s'] / base['goodput_tok_s']:.3f}x"
    return ratio + " (overloaded)" if is_overloaded(row) else ratio


def overload_note(rows: Sequence[dict[str, Any]]) -> str | None:
    """Say the server is overloaded when most requests missed the SLO: a goodput ratio
    between such runs is not a headline."""
    low = [r for r in rows if is_overloaded(r)]
    if not low:
        return None
    names = ", ".join(f"{r['name']} {percent(r['slo_attainment'])}" for r in low)
    return (
        f"OVERLOADED: fewer than {percent(OVERLOAD_SLO_ATTAINMENT)} of requests met the SLO "
        f"({names}): the server cannot serve this load within the SLO, whatever the policy; "
        "compare policies at a load it can serve (lower --rate-scale) or add capacity."
    )


# The cells a table of replay summaries (a replay JSON policy row each) can show, by
# column header: one rounding per quantity, whichever command shows it.
SUMMARY_CELLS: Final[dict[str, Callable[[dict[str, Any], dict[str, Any] | None], str]]] = {
    "tok/s": lambda r, base: number(r["throughput_tok_s"], 0),
    "goodput tok/s": lambda r, base: number(r["goodput_tok_s"], 0),
    "vs ema": vs_baseline,
    "SLO %": lambda r, base: percent(r["slo_attainment"], 1),
    "TTFT p99 ms": lambda r, base: number(r["ttft_ms"]["p99"]),
    "TPOT p50 ms": lambda r, base: number(r["tpot_ms"]["p50"], 2),
    "TPOT p99 ms": lambda r, base: number(r["tpot_ms"]["p99"], 2),
    "ITL p99 ms": lambda r, base: number(r["itl_ms"]["p99"], 2),
    "acc len": lambda r, base: number(r["mean_accept_length"], 2),
    "retract": lambda r, base: str(r["retractions"]),
    "KV peak": lambda r, base: percent(r["kv_peak_fraction"]),
    "switches": lambda r, base: str(r["tier_switches"]),
}


def summary_table(
    rows: Sequence[dict[str, Any]],
    base: dict[str, Any] | None,
    *,
    name_header: str,
    columns: Sequence[str],
    title: str,
    caption: str,
) -> Table:
    """One row per replay summary: its name, then the *columns* (``SUMMARY_CELLS``
    headers); "vs ema" compares with *base*."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    table.add_column(name_header, justify="left")
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["name"], *(SUMMARY_CELLS[col](r, base) for col in columns))
    return table


def table_slots(table: Any) -> str:
    """A step table as "bs>=1: 4, bs>=8: 3"; "none" when there is none."""
    if not isinstance(table, dict) or not table.get("slots"):
        return "none"
    return ", ".join(f"bs>={slot}: {steps}" for slot, steps in table["slots"])


__all__ = [
    "OVERLOAD_SLO_ATTAINMENT",
    "UNKNOWN",
    "clock",
    "decision_summary",
    "duration",
    "goodput_legend",
    "humanize_epochs",
    "instant",
    "is_number",
    "is_overloaded",
    "number",
    "overload_note",
    "percent",
    "relative",
    "summary_table",
    "table_slots",
    "text",
    "user_errors",
]


EXIT_USAGE = 2  # the README's code for bad usage, input or configuration


class BadInput(SpecgovError, click.ClickException):
    """A bad option value, policy spec, catalog name or trace file: one line, exit 2."""

    exit_code = EXIT_USAGE


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn input errors (the ValueError/OSError subclasses the simulator raises for a bad
    option, trace or catalog) into one clean line and exit code 2 (bad usage or
    configuration); click's own errors pass as they are."""
    try:
        yield
    except click.ClickException:
        raise
    except (ValueError, OSError) as exc:
        raise BadInput(str(exc)) from None


def stderr_progress(
    description: str, unit: str, *, enabled: bool
) -> tuple[Callable[[str, int, int], None] | None, Callable[[], None]]:
    """A transient rich progress bar on stderr, one line per task: ``(update, stop)``,
    ``update(task, done, total)`` drawing "DESCRIPTION [bar] done/total UNIT elapsed"
    (``{task.description}`` in *description* is the task's name). Not *enabled* (stderr
    is not a terminal): no update and a stop that does nothing, so JSON on stdout and
    captured output stay clean."""
    if not enabled:
        return None, lambda: None
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn(description),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} " + unit),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr, force_terminal=True),
        transient=True,
    )
    tasks: dict[str, TaskID] = {}
    bar.start()

    def update(task: str, done: int, total: int) -> None:
        if task not in tasks:
            tasks[task] = bar.add_task(task, total=total)
        bar.update(tasks[task], completed=done, total=total)

    return update, bar.stop
