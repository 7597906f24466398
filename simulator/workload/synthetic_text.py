"""The command line's text for synthetic traces (parsing), and the one place a command
opens a trace (``open_trace``: a file or ``synthetic:...``).

CLI syntax (``parse_synthetic_spec``), keys separated by commas, no spaces::

    synthetic                            all defaults (SyntheticSpec())
    synthetic:KEY=VALUE[,KEY=VALUE...]   defaults with overrides
    synthetic:demo[,KEY=VALUE...]        DEFAULT_DEMO_SPEC with overrides

    duration=S        duration_s            rate=R          rate_rps
    arrival=A         poisson|gamma|onoff   cv=X            burstiness_cv
    on=S / off=S      on_s / off_s          diurnal=A       diurnal_amplitude (0..1)
    period=S          diurnal_period_s      ramp=T:M+T:M..  ramp points, or ramp=none
    in=N / out=N      mean_*_tokens         in_sigma=X / out_sigma=X
    max_in=N / max_out=N  max_*_tokens      seed=N
    turns=N           turns per conversation (1: independent requests)
    think=S           think_time_s          turn_in=N       mean_turn_input_tokens
    phases=MIX@S+MIX@S...   with MIX = DOMAIN[:WEIGHT][|DOMAIN[:WEIGHT]...]
    DOMAIN.in=N, DOMAIN.out=N, DOMAIN.in_sigma=X, DOMAIN.out_sigma=X   per-domain lengths

Bounds, like a trace file's: ``duration`` at most 30 days, and at most
:data:`MAX_EXPECTED_REQUESTS` (2,000,000) requests expected over it; beyond either, a
``SyntheticSpecError`` naming the key (exit 2 from the CLI) before anything is drawn.

Example: ``synthetic:duration=600,rate=8,arrival=gamma,cv=2,seed=3,``
``phases=code@200+chat:3|rag:1@200+rag@200,rag.in=4096``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from specgov.simulator.workload.synthetic import (
    DEFAULT_DEMO_SPEC,
    DOMAIN_LABEL_RE,
    DOMAIN_SPEC_KEYS,
    SPEC_KEYS,
    DomainLengths,
    Phase,
    SyntheticSpec,
    SyntheticSpecError,
    generate_trace,
)
from specgov.simulator.workload.traces import Trace

__all__ = ["open_trace", "parse_synthetic_spec"]

_FIELD_TO_KEY = {f: k for k, (f, _) in SPEC_KEYS.items()}
_VALID_KEYS = ", ".join([*SPEC_KEYS, *(f"DOMAIN.{k}" for k in DOMAIN_SPEC_KEYS)])


def _parse_value(key: str, raw: str, expected: str) -> Any:
    fname = SPEC_KEYS[key][0]

    def bad() -> SyntheticSpecError:
        return SyntheticSpecError(
            key, f"synthetic spec key {key!r}: cannot read {raw!r}; expected {expected}"
        )

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise bad() from None
        if not math.isfinite(value):
            raise bad()
        return value

    if fname == "arrival":
        return raw
    if fname in ("max_input_tokens", "max_output_tokens", "seed", "turns"):
        if not re.fullmatch(r"\d+", raw):
            raise bad()
        return int(raw)
    if fname in ("diurnal_period_s", "ramp") and raw == "none":
        return None
    if fname == "ramp":
        points = []
        for part in raw.split("+"):
            t, sep, m = part.partition(":")
            if not sep:
                raise bad()
            points.append((number(t), number(m)))
        return tuple(points)
    if fname == "phases":
        phases = []
        for part in raw.split("+"):
            mix, sep, seconds = part.rpartition("@")
            if not sep or not mix:
                raise bad()
            weights: dict[str, float] = {}
            for item in mix.split("|"):
                name, colon, weight = item.partition(":")
                if not DOMAIN_LABEL_RE.fullmatch(name) or name in weights:
                    raise bad()
                weights[name] = number(weight) if colon else 1.0
            try:
                phases.append(Phase(number(seconds), weights))
            except SyntheticSpecError as exc:
                raise SyntheticSpecError(key, f"synthetic spec key {key!r}: {exc}") from None
        return tuple(phases)
    return number(raw)


def parse_synthetic_spec(text: str) -> SyntheticSpec:
    """Parse the CLI syntax (module docstring) into a validated ``SyntheticSpec``.

    Raises ``SyntheticSpecError`` naming the key and the expected form.
    """
    stripped = text.strip()
    head, colon, body = stripped.partition(":")
    if head != "synthetic" or (colon and not body):
        raise SyntheticSpecError(
            "spec",
            f"synthetic spec {text!r}: expected 'synthetic', 'synthetic:demo[,KEY=VALUE...]' "
            f"or 'synthetic:KEY=VALUE[,KEY=VALUE...]' with keys {_VALID_KEYS}",
        )
    items = body.split(",") if body else []
    base = SyntheticSpec()
    if items and items[0] == "demo":
        base = DEFAULT_DEMO_SPEC
        items = items[1:]
    changes: dict[str, Any] = {}
    lengths: dict[str, dict[str, float]] = {}
    seen: set[str] = set()
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key or not raw:
            raise SyntheticSpecError(
                "spec",
                f"synthetic spec {text!r}: item {item!r} is not KEY=VALUE (keys: {_VALID_KEYS})",
            )
        if key in seen:
            raise SyntheticSpecError(key, f"synthetic spec {text!r}: key {key!r} is given twice")
        seen.add(key)
        domain, dot, sub = key.partition(".")
        if dot:
            if sub not in DOMAIN_SPEC_KEYS or not DOMAIN_LABEL_RE.fullmatch(domain):
                raise SyntheticSpecError(
                    key, f"synthetic spec {text!r}: unknown key {key!r}; valid keys: {_VALID_KEYS}"
                )
            fname, expected = DOMAIN_SPEC_KEYS[sub]
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise SyntheticSpecError(
                    key, f"synthetic spec key {key!r}: cannot read {raw!r}; expected {expected}"
                )
            lengths.setdefault(domain, {})[fname] = value
            continue
        if key not in SPEC_KEYS:
            raise SyntheticSpecError(
                key, f"synthetic spec {text!r}: unknown key {key!r}; valid keys: {_VALID_KEYS}"
            )
        changes[SPEC_KEYS[key][0]] = _parse_value(key, raw, SPEC_KEYS[key][1])
    if lengths:
        merged = dict(base.domain_lengths)
        for domain, overrides in lengths.items():
            try:
                merged[domain] = dataclasses.replace(
                    merged.get(domain, DomainLengths()), **overrides
                )
            except SyntheticSpecError as exc:
                key = _domain_key(domain, exc.field.removeprefix("DomainLengths."))
                raise SyntheticSpecError(
                    key, f"synthetic spec {text!r}, key {key!r}: {exc}"
                ) from None
        changes["domain_lengths"] = merged
    try:
        return dataclasses.replace(base, **changes)
    except SyntheticSpecError as exc:
        match = re.fullmatch(r"domain_lengths\['([^']*)'\](?:\.(\w+))?", exc.field)
        if match is not None and match.group(2) is None:
            # The domain itself is wrong (no phase uses it): name the keys that set it.
            given = sorted(k for k in seen if k.startswith(match.group(1) + "."))
            key = ",".join(given) or f"{match.group(1)}.*"
        elif match is not None:
            key = _domain_key(match.group(1), match.group(2))
        else:
            key = _FIELD_TO_KEY.get(exc.field.split("[")[0], exc.field)
        raise SyntheticSpecError(key, f"synthetic spec {text!r}, key {key!r}: {exc}") from None


def _domain_key(domain: str, fname: str | None) -> str:
    """The CLI key for a per-domain length field (``DOMAIN.*`` when the field is unknown)."""
    for sub, (candidate, _) in DOMAIN_SPEC_KEYS.items():
        if candidate == fname:
            return f"{domain}.{sub}"
    return f"{domain}.*"


def open_trace(
    source: str,
    fmt: str | None = None,
    *,
    rate_scale: float = 1.0,
    window_start_s: float | None = None,
    window_end_s: float | None = None,
    sample: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
) -> Trace:
    """A trace from the command line's TRACE: a file (read by ``load_trace`` in ``fmt``)
    or ``synthetic[:key=value,...]`` (generated), with the same window / rate / sample /
    max-requests options applied either way. The one place every command opens a trace."""
    from pathlib import Path

    from specgov.simulator.workload.trace_files import load_trace
    from specgov.simulator.workload.traces import transform_trace

    options: dict[str, Any] = {
        "window_start_s": window_start_s,
        "window_end_s": window_end_s,
        "rate_scale": rate_scale,
        "sample_fraction": sample,
        "max_requests": max_requests,
        "seed": seed,
    }
    if source == "synthetic" or source.startswith("synthetic:"):
        return transform_trace(generate_trace(parse_synthetic_spec(source)), **options)
    return load_trace(Path(source), fmt, **options)
