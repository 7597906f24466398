"""A launch configuration from a ``specgov replay`` report (``specgov sglang-args
--from-replay``): the offline one-off of the restart loop (``recommend.py``), read from a
replay JSON instead of replayed from live telemetry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specgov.adapters.launch_config import (
    ADAPTIVE_ALGORITHMS,
    DEFAULT_ADAPTIVE_CONFIG_PATH,
    DIGITS,
    SGLANG_VERSION,
    LaunchConfig,
    LaunchConfigError,
    SlotCandidates,
    build_launch_config,
    format_slots,
    make_shape,
    normalise_algorithm,
)
from specgov.policies.common.types import ALGORITHMS, SpecShape
from specgov.policies.common.validation import is_int, is_real
from specgov.policies.daemon.spec import PolicySpecError, static_steps


def _fail_report(where: str, expected: str, got: object) -> LaunchConfigError:
    return LaunchConfigError(f"replay report: {where}: {expected}, got {got!r}")


@dataclass(frozen=True, slots=True)
class _Run:
    name: str
    goodput_tok_s: float
    steps_per_slot: dict[int, dict[int, int]]
    static_steps: int | None  # K of a static:K run, None for the others


def _read_runs(report: Mapping[str, Any]) -> list[_Run]:
    if not isinstance(report, Mapping):
        raise _fail_report("top level", "expected a JSON object", type(report).__name__)
    policies = report.get("policies")
    if not isinstance(policies, list) or not policies:
        raise _fail_report(
            "key 'policies'", "expected a non-empty list (specgov replay --output json)", policies
        )
    runs = []
    for i, p in enumerate(policies):
        where = f"policies[{i}]"
        if not isinstance(p, Mapping):
            raise _fail_report(where, "expected an object", p)
        name = p.get("name")
        if not isinstance(name, str) or not name:
            raise _fail_report(f"{where}.name", "expected a policy name", name)
        try:
            static = static_steps(name)
        except PolicySpecError as exc:
            raise _fail_report(
                f"{where}.name", f"a well-formed policy name ({exc})", name
            ) from None
        goodput = p.get("goodput_tok_s")
        if not is_real(goodput) or goodput < 0:
            raise _fail_report(f"{where}.goodput_tok_s", "expected a number >= 0", goodput)
        raw_hist = p.get("steps_per_slot", {})
        if not isinstance(raw_hist, Mapping):
            raise _fail_report(f"{where}.steps_per_slot", "expected an object", raw_hist)
        hist: dict[int, dict[int, int]] = {}
        for slot_key, per_step in raw_hist.items():
            if not isinstance(slot_key, str) or not DIGITS.fullmatch(slot_key):
                raise _fail_report(f"{where}.steps_per_slot", "expected digit keys", slot_key)
            if not isinstance(per_step, Mapping):
                raise _fail_report(
                    f"{where}.steps_per_slot[{slot_key!r}]", "expected an object", per_step
                )
            counts: dict[int, int] = {}
            for step_key, n in per_step.items():
                if not isinstance(step_key, str) or not DIGITS.fullmatch(step_key):
                    raise _fail_report(
                        f"{where}.steps_per_slot[{slot_key!r}]", "expected digit keys", step_key
                    )
                if not is_int(n) or n < 0:
                    raise _fail_report(
                        f"{where}.steps_per_slot[{slot_key!r}][{step_key!r}]",
                        "expected a batch count >= 0",
                        n,
                    )
                counts[int(step_key)] = n
            hist[int(slot_key)] = counts
        runs.append(_Run(name, float(goodput), hist, static))
    return runs


def _report_algorithm(server: Mapping[str, Any], algorithm: str | None) -> str:
    if algorithm is not None:
        return normalise_algorithm(algorithm, "--algorithm")
    declared = server.get("algorithm")
    if declared is not None:
        return normalise_algorithm(declared, "replay report: server.algorithm")
    drafter = server.get("drafter")
    guess = drafter.replace("-", "").upper() if isinstance(drafter, str) else None
    if guess in ALGORITHMS and guess != "NONE":
        return guess
    raise LaunchConfigError(
        f"replay report: server.drafter {drafter!r} does not name an SGLang "
        "--speculative-algorithm; pass the algorithm explicitly (--algorithm)"
    )


def recommend_from_replay(
    report: Mapping[str, Any],
    *,
    algorithm: str | None = None,
    draft_model_path: str | None = None,
    min_share: float = 0.05,
    adaptive_config_path: str = DEFAULT_ADAPTIVE_CONFIG_PATH,
) -> LaunchConfig:
    """Recommend a launch configuration from a ``specgov replay --output json`` report.

    * The best ``static:K`` run by goodput (ties: fewer steps) gives
      ``--speculative-num-steps``.
    * If the best adaptive run (any policy other than ``none``/``static:K`` with a
      steps histogram) matches or beats it, each of its slots gets as candidates the
      steps used in at least ``min_share`` of that slot's decode batches (the most
      used one always). The best static step joins the busiest slot if no slot has it
      (SGLang requires ``--speculative-num-steps`` among the candidates). If that
      leaves a single step everywhere, adaptive speculation would only add start-up
      cost, and the static shape is recommended instead.
    * If ``none`` beats every speculative run, or the winner never drafts (0 steps:
      SGLang would still run the draft-extend pass), no speculation is recommended.

    The algorithm comes from ``algorithm``, else the report's ``server.algorithm``,
    else its ``server.drafter`` when that names one (``eagle3`` -> EAGLE3). The
    explanation is in ``rationale``. Raises :class:`LaunchConfigError`.
    """
    if not is_real(min_share) or not 0.0 < min_share <= 1.0:
        raise LaunchConfigError(f"min_share: expected a fraction in (0, 1], got {min_share!r}")
    runs = _read_runs(report)
    server = report.get("server", {})
    if not isinstance(server, Mapping):
        raise _fail_report("key 'server'", "expected an object", server)
    trace = report.get("trace", {})
    trace_name = trace.get("name", "?") if isinstance(trace, Mapping) else "?"
    lines = [
        f"replay of {trace_name!r} (seed {report.get('seed', '?')}, "
        f"{server.get('gpu', '?')} {server.get('model', '?')} + {server.get('drafter', '?')}):"
    ]
    ranked = _rank_runs(runs, lines)
    best_static, best_adaptive = ranked.best_static, ranked.best_adaptive
    none_run = ranked.none_run
    if none_run is not None and none_run.goodput_tok_s > ranked.best_spec_goodput_tok_s:
        return _no_speculation(
            lines,
            f"no speculation ({none_run.goodput_tok_s:,.1f} tok/s) beats every speculative run",
            adaptive_config_path,
        )
    launch = _Launcher.of(server, algorithm, lines, draft_model_path, adaptive_config_path)
    if best_adaptive is None or (
        best_static is not None and best_adaptive.goodput_tok_s < best_static[1].goodput_tok_s
    ):
        assert best_static is not None
        return launch.static_config(best_static[0], best_static[1].name)
    if launch.algo not in ADAPTIVE_ALGORITHMS or launch.topk != 1:
        lines.append(
            f"adaptive speculation is not available for {launch.algo} with topk {launch.topk}"
        )
        if best_static is None:
            raise LaunchConfigError(
                "replay report: only adaptive runs, but SGLang "
                f"{SGLANG_VERSION} cannot run adaptive speculation with {launch.algo}, "
                f"topk {launch.topk}"
            )
        return launch.static_config(best_static[0], best_static[1].name)
    return _adaptive_config(launch, best_adaptive, best_static, min_share)


@dataclass(frozen=True, slots=True)
class _Ranked:
    """The report's runs by kind, best first."""

    none_run: _Run | None
    statics: list[tuple[int, _Run]]
    adaptive_runs: list[_Run]

    @property
    def best_static(self) -> tuple[int, _Run] | None:
        return self.statics[0] if self.statics else None

    @property
    def best_adaptive(self) -> _Run | None:
        return self.adaptive_runs[0] if self.adaptive_runs else None

    @property
    def best_spec_goodput_tok_s(self) -> float:
        return max(
            [r.goodput_tok_s for _, r in self.statics[:1]]
            + [r.goodput_tok_s for r in self.adaptive_runs[:1]]
        )


def _rank_runs(runs: Sequence[_Run], lines: list[str]) -> _Ranked:
    """The runs ranked (none, static:K, adaptive), the best of each kind told in *lines*."""
    none_run = next((r for r in runs if r.name.strip().lower() == "none"), None)
    statics = sorted(
        ((r.static_steps, r) for r in runs if r.static_steps is not None),
        key=lambda kr: (-kr[1].goodput_tok_s, kr[0]),
    )
    adaptive_runs = sorted(
        (
            r
            for r in runs
            if r is not none_run
            and r.static_steps is None
            and any(sum(c.values()) > 0 for c in r.steps_per_slot.values())
        ),
        key=lambda r: (-r.goodput_tok_s, r.name),
    )
    if not statics and not adaptive_runs:
        raise LaunchConfigError(
            "replay report: no static:K and no adaptive run to recommend from "
            f"(policies: {[r.name for r in runs]}); replay with e.g. --policy static:1 "
            "--policy static:3 --policy sglang-ema"
        )
    ranked = _Ranked(none_run, statics, adaptive_runs)
    best_static, best_adaptive = ranked.best_static, ranked.best_adaptive
    if best_static is not None:
        others = ", ".join(f"{r.name} {r.goodput_tok_s:,.1f}" for _, r in statics[1:])
        lines.append(
            f"best static run {best_static[1].name} at {best_static[1].goodput_tok_s:,.1f} "
            "goodput tok/s" + (f" (others: {others})" if others else "")
        )
    if best_adaptive is not None:
        lines.append(
            f"best adaptive run {best_adaptive.name} at "
            f"{best_adaptive.goodput_tok_s:,.1f} goodput tok/s"
        )
    return ranked


def _no_speculation(lines: list[str], why: str, adaptive_config_path: str) -> LaunchConfig:
    lines.append(why + ": launch without speculation")
    return build_launch_config(
        SpecShape("NONE", 0, 0, 0, ()),
        rationale="\n".join(lines),
        adaptive_config_path=adaptive_config_path,
    )


@dataclass(frozen=True, slots=True)
class _Launcher:
    """The report's server (algorithm, tree width) and where the rationale accumulates:
    builds the launch configurations a recommendation ends in."""

    server: Mapping[str, Any]
    algo: str
    topk: int
    lines: list[str]
    draft_model_path: str | None
    adaptive_config_path: str

    @classmethod
    def of(
        cls,
        server: Mapping[str, Any],
        algorithm: str | None,
        lines: list[str],
        draft_model_path: str | None,
        adaptive_config_path: str,
    ) -> _Launcher:
        algo = _report_algorithm(server, algorithm)
        topk = server.get("topk", 1)
        topk = 1 if topk is None else topk
        if not is_int(topk) or topk < 1:
            raise _fail_report("server.topk", "expected an int >= 1", topk)
        return cls(server, algo, topk, lines, draft_model_path, adaptive_config_path)

    def no_speculation(self, why: str) -> LaunchConfig:
        return _no_speculation(self.lines, why, self.adaptive_config_path)

    def shape_for(self, k: int) -> SpecShape:
        if self.topk == 1:
            return make_shape(self.algo, k, 1, k + 1, "replay report: server")
        draft = self.server.get("num_draft_tokens")
        if not is_int(draft):
            raise _fail_report(
                "server.num_draft_tokens", f"expected an int for topk={self.topk}", draft
            )
        return make_shape(self.algo, k, self.topk, draft, "replay report: server")

    def static_config(self, k: int, source: str) -> LaunchConfig:
        if k == 0:
            return self.no_speculation(
                f"{source} never drafts (0 steps still pays SGLang's draft-extend pass)"
            )
        self.lines.append(f"static speculation: --speculative-num-steps {k}, from {source}")
        return build_launch_config(
            self.shape_for(k),
            rationale="\n".join(self.lines),
            draft_model_path=self.draft_model_path,
            adaptive_config_path=self.adaptive_config_path,
        )


def _adaptive_config(
    launch: _Launcher,
    best_adaptive: _Run,
    best_static: tuple[int, _Run] | None,
    min_share: float,
) -> LaunchConfig:
    """Adaptive speculation with the best adaptive run's per-slot candidates (or the static
    shape, or none, where those candidates leave one step or never draft)."""
    lines = launch.lines
    hist = best_adaptive.steps_per_slot
    slots = _slots_from_histogram(hist, min_share)
    union = sorted({s for slot in slots for s in slot.candidate_steps})
    if best_static is not None and best_static[0] > 0:
        num_steps = best_static[0]
        steps_note = f"--speculative-num-steps {num_steps} = best static step"
        if num_steps not in union:
            busiest = max(hist, key=lambda b: (sum(hist[b].values()), -b))
            slots = [
                SlotCandidates.of(s.bound, (*s.candidate_steps, num_steps))
                if s.bound == busiest
                else s
                for s in slots
            ]
            steps_note += (
                f", added to the busiest slot {busiest} (SGLang requires it among the candidates)"
            )
            union = sorted({*union, num_steps})
    else:
        num_steps = _most_used_positive(hist, union)
        steps_note = f"--speculative-num-steps {num_steps} = most used positive step"
    share_note = f"steps used in >= {min_share:.0%} of a slot's decode batches"
    if len(union) == 1:
        lines.append(
            f"{best_adaptive.name} settles on step {union[0]} in every slot ({share_note}), "
            "so adaptive speculation would only add start-up cost"
        )
        return launch.static_config(union[0], f"{best_adaptive.name}'s only step")
    if num_steps == 0:
        return launch.no_speculation(f"{best_adaptive.name} never drafts")
    lines.append(
        f"adaptive speculation, per-slot candidates from {best_adaptive.name}'s {share_note}: "
        f"--slots '{format_slots(slots)}'; {steps_note}"
    )
    return build_launch_config(
        launch.shape_for(num_steps),
        slots,
        rationale="\n".join(lines),
        draft_model_path=launch.draft_model_path,
        adaptive_config_path=launch.adaptive_config_path,
    )


def _slots_from_histogram(
    hist: Mapping[int, Mapping[int, int]], min_share: float
) -> list[SlotCandidates]:
    slots = []
    for bound in sorted(hist):
        counts = hist[bound]
        total = sum(counts.values())
        if total == 0:
            continue
        top = max(counts, key=lambda s: (counts[s], -s))
        chosen = {s for s, n in counts.items() if n / total >= min_share} | {top}
        slots.append(SlotCandidates.of(bound, chosen))
    return slots


def _most_used_positive(hist: Mapping[int, Mapping[int, int]], union: Sequence[int]) -> int:
    totals: dict[int, int] = {}
    for counts in hist.values():
        for step, n in counts.items():
            if step > 0 and step in union:
                totals[step] = totals.get(step, 0) + n
    if not totals:
        return 0
    return max(totals, key=lambda s: (totals[s], -s))
