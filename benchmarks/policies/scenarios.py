"""The policy benchmark's scenarios, as data: workloads x GPUs x acceptance profiles.

A *workload* says which requests arrive and how (an Azure LLM trace window at some rate,
the synthetic content-phase trace, or N closed-loop users); a *scenario* is a workload on
one GPU with one acceptance profile. Every scenario runs Llama-3.1-8B with the EAGLE-3
drafter's cost model, because SGLang's adaptive speculation (and so every adaptive or
daemon policy) supports only EAGLE/EAGLE3 drafters. The "ngram" profile keeps that cost
model and swaps in the n-gram drafter's measured acceptance rates: a cheap drafter that is
right less often, which is where choosing fewer steps (or none) matters most.

Tags drive the targets in ``report.py``:

* ``steady``: steady open-loop load (table changes per minute);
* ``high_load``: goodput must beat sglang-ema by +10 % here (with ``phase_shift``);
* ``saturation``: goodput must stay within 2 % of no speculation;
* ``phase_shift``: the content-phase trace (+10 % and the per-phase oracle);
* ``one_user``: a single closed-loop user (within 2 % of the best static).

Wrong priors. The daemon policies also run with a step-cost prior that is wrong while the
simulated truth stays the catalog's (``PRIORS``: every step believed 0.7x or 1.4x as
costly, or the prior of another GPU of the catalog, ``PRIOR_GPU``: a wrong knee, not only
a wrong scale), and goodput with an acceptance prior (``prior_mean``) far from the
simulated rates (``ACCEPT_PRIORS``). Each such run is labelled ``policy@variant``.
"""

from __future__ import annotations

import fnmatch
import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from specgov.simulator.replay.oracle import CLAIRVOYANT, INFORMED
from specgov.simulator.replay.runner import ServerSpec
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec
from specgov.simulator.workload.trace_files import load_trace
from specgov.simulator.workload.traces import Request, Trace, transform_trace

REPO_ROOT = Path(__file__).resolve().parents[2]
AZURE_SUBDIR = "traces/azure-llm-2023"
AZURE_FILES = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}

# The first 15 minutes of each Azure trace (on the trace's own timeline, before rate
# scaling): ~4,400 conversation and ~2,300 code requests. At 4x and 16x the same requests
# arrive 4 and 16 times faster, so those scenarios are shorter and heavier, not longer.
AZURE_WINDOW_S = (0.0, 900.0)
QUICK_AZURE_WINDOW_S = (0.0, 300.0)

GPUS: tuple[str, ...] = ("h100", "a100-80g")
# profile label -> ServerSpec.acceptance_profile (None: the eagle3 drafter's own profile).
PROFILES: dict[str, str | None] = {"eagle3": None, "ngram": "ngram"}
MODEL = "llama-3.1-8b"
DRAFTER = "eagle3"

# Policies run on every scenario. static:1..7 are all run because the oracle rows (best
# static in hindsight, overall and per phase) pick among them after the fact.
# The batch table follows TensorRT-LLM's draft-length schedule idea (and vLLM's dynamic
# speculative decoding): long drafts at small batches, where verification is nearly free,
# shrinking by one step per doubling of the batch, none from 64 requests on, where the
# decode step is compute-bound and drafts cost more than they return.
BATCH_TABLE = "batch-table:1=5,4=4,8=3,16=2,32=1,64=0"
STATIC_POLICIES: tuple[str, ...] = tuple(f"static:{k}" for k in range(1, 8))
EMA = "sglang-ema"
POLICIES: tuple[str, ...] = (
    "none",
    *STATIC_POLICIES,
    EMA,
    BATCH_TABLE,
    "goodput",
    "bandit",
)


def policy_label(spec: str) -> str:
    """The short name a policy goes by in tables ("batch-table" for the schedule above)."""
    return "batch-table" if spec.startswith("batch-table") else spec


POLICY_LABELS: tuple[str, ...] = tuple(policy_label(p) for p in POLICIES)
DAEMON_POLICIES: tuple[str, ...] = ("batch-table", "goodput", "bandit")
# The oracles (specgov.simulator.replay.oracle), per batch the step with the most tokens/s: the
# clairvoyant one given the true acceptance draws (an upper bound on per-batch choice), the
# informed one given the true acceptance distributions (what a realisable policy reaches).
ORACLES: tuple[str, ...] = (CLAIRVOYANT, INFORMED)

# Another GPU of the catalog whose step-cost prior a daemon policy gets in the "gpu"
# variant: a slower, smaller-knee GPU for the H100 (the L40S example), a faster
# one for the A100, so both directions of a wrong knee are covered.
PRIOR_GPU: dict[str, str] = {"h100": "l40s", "a100-80g": "h100"}


@dataclass(frozen=True)
class PriorVariant:
    """How the daemon policy's step-cost prior differs from the simulated truth."""

    name: str  # label suffix: policy@name ("exact" runs keep the plain label)
    description: str
    scale: float = 1.0  # ServerSpec.prior_scale
    other_gpu: bool = False  # ServerSpec.prior_gpu = PRIOR_GPU[scenario gpu]

    def apply(self, server: ServerSpec) -> ServerSpec:
        """*server* with this prior (the simulated GPU, model and drafter unchanged)."""
        if self.scale == 1.0 and not self.other_gpu:
            return server
        names = {f.name for f in fields(ServerSpec)}
        if not {"prior_scale", "prior_gpu"} <= names:
            raise ScenarioError(
                f"prior variant {self.name!r} needs ServerSpec.prior_scale / prior_gpu "
                "(simulator/replay/runner.py without --prior-scale / --prior-gpu support)"
            )
        if self.other_gpu and server.gpu not in PRIOR_GPU:
            raise ScenarioError(
                f"prior variant {self.name!r}: no other GPU listed for {server.gpu!r} in "
                f"PRIOR_GPU ({', '.join(sorted(PRIOR_GPU))})"
            )
        changes: dict[str, object] = {"prior_scale": self.scale}
        if self.other_gpu:
            changes["prior_gpu"] = PRIOR_GPU[server.gpu]
        return replace(server, **changes)  # type: ignore[arg-type]


EXACT_PRIOR = PriorVariant("exact", "the simulated GPU's own cost model (the truth)")
PRIORS: tuple[PriorVariant, ...] = (
    EXACT_PRIOR,
    PriorVariant("x0.7", "every step believed 0.7x as costly as simulated", scale=0.7),
    PriorVariant("x1.4", "every step believed 1.4x as costly as simulated", scale=1.4),
    PriorVariant("gpu", "the prior of another GPU of the catalog (PRIOR_GPU)", other_gpu=True),
)
PRIORS_BY_NAME: dict[str, PriorVariant] = {p.name: p for p in PRIORS}
# goodput with an acceptance prior (GoodputConfig.prior_mean, default 0.6) far below and
# far above the simulated rates (EAGLE-3 ~0.65-0.8, n-gram 0.16-0.96), exact cost prior.
ACCEPT_PRIORS: tuple[float, ...] = (0.3, 0.9)


@dataclass(frozen=True)
class PolicyRun:
    """One policy run of the suite: the spec, its step-cost prior, the label it goes by."""

    spec: str
    prior: PriorVariant = EXACT_PRIOR
    variant: str = "exact"  # label suffix; "exact" for the plain run

    @property
    def label(self) -> str:
        base = policy_label(self.spec.split(":prior_mean=")[0])
        return base if self.variant == "exact" else f"{base}@{self.variant}"

    @property
    def family(self) -> str:
        """The policy the variant belongs to ("goodput" for goodput@x0.7)."""
        return self.label.split("@", 1)[0]


def suite_runs(
    policies: Sequence[str] = POLICIES,
    *,
    priors: Sequence[str] = tuple(PRIORS_BY_NAME),
    accept_priors: Sequence[float] = ACCEPT_PRIORS,
    oracle: bool = True,
    prior_families: Sequence[str] = DAEMON_POLICIES,
) -> list[PolicyRun]:
    """Every run per scenario: each policy with the exact prior, each daemon policy in
    ``prior_families`` with every other prior variant, goodput with each acceptance prior,
    and the two oracles."""
    unknown = [p for p in priors if p not in PRIORS_BY_NAME]
    if unknown:
        raise ScenarioError(
            f"unknown prior variant(s) {', '.join(unknown)}; valid: {', '.join(PRIORS_BY_NAME)}"
        )
    bad = [f for f in prior_families if f not in DAEMON_POLICIES]
    if bad:
        raise ScenarioError(
            f"unknown prior family {', '.join(bad)}; valid: {', '.join(DAEMON_POLICIES)}"
        )
    runs = [PolicyRun(p) for p in policies]
    if oracle:
        runs += [PolicyRun(o) for o in ORACLES]
    for name in priors:
        if name == EXACT_PRIOR.name:
            continue
        variant = PRIORS_BY_NAME[name]
        runs += [PolicyRun(p, variant, name) for p in policies if policy_label(p) in prior_families]
    if any(policy_label(p) == "goodput" for p in policies):
        runs += [
            PolicyRun(f"goodput:prior_mean={m:g}", variant=f"accept{m:g}") for m in accept_priors
        ]
    return runs


class ScenarioError(ValueError):
    """A scenario cannot be built or selected; the message names it and what is missing."""


@dataclass(frozen=True)
class PhaseWindow:
    """A content phase on the trace's timeline: requests arriving in [start_s, end_s)."""

    name: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Workload:
    """Which requests arrive, and how.

    ``source`` is ``azure:conv``, ``azure:code`` or a synthetic spec string
    (``synthetic:demo``, see ``specgov.simulator.workload.synthetic``). ``concurrency`` replays the
    requests as that many closed-loop users (arrival times ignored). ``max_requests`` keeps
    the first that many requests; ``sample_fraction`` a seeded random subset.
    """

    name: str
    description: str
    source: str
    window_s: tuple[float, float] | None = None
    rate_scale: float = 1.0
    concurrency: int | None = None
    max_requests: int | None = None
    sample_fraction: float | None = None
    tags: frozenset[str] = field(default_factory=frozenset)

    @property
    def needs_azure(self) -> bool:
        return self.source.startswith("azure:")

    def phases(self) -> tuple[PhaseWindow, ...]:
        """Content phases of a synthetic phase trace (empty for every other workload)."""
        if not self.source.startswith("synthetic") or self.concurrency is not None:
            return ()
        spec = parse_synthetic_spec(self.source)
        if spec.phases is None:
            return ()
        out: list[PhaseWindow] = []
        start = 0.0
        # Phases shorter in total than the trace repeat cyclically (synthetic.py).
        while start < spec.duration_s:
            for phase in spec.phases:
                if start >= spec.duration_s:
                    break
                name = "|".join(phase.domains)
                seen = sum(1 for p in out if p.name.split("#")[0] == name)
                end = min(start + phase.duration_s, spec.duration_s)
                out.append(PhaseWindow(f"{name}#{seen + 1}" if seen else name, start, end))
                start = end
        return tuple(out)


@dataclass(frozen=True)
class Scenario:
    """One workload on one GPU with one acceptance profile."""

    workload: Workload
    gpu: str
    profile: str

    @property
    def id(self) -> str:
        return f"{self.workload.name}/{self.gpu}/{self.profile}"

    @property
    def tags(self) -> frozenset[str]:
        return self.workload.tags

    def server(self) -> ServerSpec:
        if self.profile not in PROFILES:
            raise ScenarioError(
                f"scenario {self.id}: unknown profile {self.profile!r}; "
                f"valid: {', '.join(PROFILES)}"
            )
        return ServerSpec(
            gpu=self.gpu,
            model=MODEL,
            drafter=DRAFTER,
            acceptance_profile=PROFILES[self.profile],
        )


def _azure(
    name: str,
    file: str,
    rate: float,
    window: tuple[float, float],
    tags: frozenset[str] = frozenset(),
) -> Workload:
    return Workload(
        name=name,
        description=(
            f"Azure LLM 2023 {file} trace, minutes {window[0] / 60:g}-{window[1] / 60:g}, "
            f"{rate:g}x request rate (open loop)"
        ),
        source=f"azure:{file}",
        window_s=window,
        rate_scale=rate,
        tags=tags,
    )


# Closed-loop users draw the Azure conversation requests in trace order. The caps keep
# each level to a few simulated minutes: about 10 requests per user at 256 users.
USER_LEVELS: dict[int, int] = {1: 150, 4: 300, 16: 600, 64: 1200, 256: 2560}
QUICK_USER_LEVELS: dict[int, int] = {1: 30, 256: 512}


def _users(n: int, cap: int) -> Workload:
    tags = {"one_user"} if n == 1 else set()
    if n == 256:
        tags |= {"high_load", "saturation"}
    return Workload(
        name=f"users-{n}",
        description=(
            f"{n} closed-loop user{'s' if n > 1 else ''} over the first {cap} Azure "
            "conversation requests (each completion sends the next request at once)"
        ),
        source="azure:conv",
        concurrency=n,
        max_requests=cap,
        tags=frozenset(tags),
    )


PHASE = Workload(
    name="phase",
    description=(
        "synthetic content phases code -> chat -> rag (200 s each) under a load ramp "
        "3 -> 18 -> 3 req/s (specgov.simulator.workload.synthetic.DEFAULT_DEMO_SPEC)"
    ),
    source="synthetic:demo",
    tags=frozenset({"phase_shift"}),
)

WORKLOADS: tuple[Workload, ...] = (
    _azure("conv-1x", "conv", 1.0, AZURE_WINDOW_S, tags=frozenset({"steady"})),
    _azure("conv-4x", "conv", 4.0, AZURE_WINDOW_S),
    _azure("conv-16x", "conv", 16.0, AZURE_WINDOW_S, tags=frozenset({"high_load", "saturation"})),
    _azure("code-1x", "code", 1.0, AZURE_WINDOW_S),
    PHASE,
    *(_users(n, cap) for n, cap in USER_LEVELS.items()),
)

# --quick: a smoke subset (H100, EAGLE-3 only) that still touches every kind of workload
# and every target: shorter Azure window, 30 % of the phase trace's requests (same
# timeline and phases, lighter load), fewer closed-loop requests.
QUICK_WORKLOADS: tuple[Workload, ...] = (
    _azure("conv-1x", "conv", 1.0, QUICK_AZURE_WINDOW_S, tags=frozenset({"steady"})),
    Workload(
        name=PHASE.name,
        description=PHASE.description + ", 30 % of its requests",
        source=PHASE.source,
        sample_fraction=0.3,
        tags=PHASE.tags,
    ),
    *(_users(n, cap) for n, cap in QUICK_USER_LEVELS.items()),
)
QUICK_GPUS: tuple[str, ...] = ("h100",)
QUICK_PROFILES: tuple[str, ...] = ("eagle3",)


def all_scenarios(*, quick: bool = False) -> list[Scenario]:
    workloads = QUICK_WORKLOADS if quick else WORKLOADS
    gpus = QUICK_GPUS if quick else GPUS
    profiles = QUICK_PROFILES if quick else tuple(PROFILES)
    return [Scenario(w, g, p) for w in workloads for g in gpus for p in profiles]


def select(patterns: Sequence[str] | None, *, quick: bool = False) -> list[Scenario]:
    """Scenarios whose id (``workload/gpu/profile``) or workload name matches a pattern
    (shell-style wildcards); all of them when ``patterns`` is empty."""
    scenarios = all_scenarios(quick=quick)
    if not patterns:
        return scenarios
    chosen = [
        s
        for s in scenarios
        if any(fnmatch.fnmatch(s.id, p) or fnmatch.fnmatch(s.workload.name, p) for p in patterns)
    ]
    if not chosen:
        names = sorted({s.workload.name for s in scenarios})
        raise ScenarioError(
            f"no scenario matches {' '.join(patterns)!r}; workloads: {', '.join(names)}; "
            f"gpus: {', '.join(sorted({s.gpu for s in scenarios}))}; ids look like "
            f"{scenarios[0].id}"
        )
    return chosen


def default_data_dir() -> Path:
    """$SPECGOV_SHARED_DATA, else ../shared/data next to the repository."""
    return Path(os.environ.get("SPECGOV_SHARED_DATA", str(REPO_ROOT.parent / "shared/data")))


def azure_path(data_dir: Path, kind: str) -> Path:
    if kind not in AZURE_FILES:
        raise ScenarioError(f"unknown Azure trace {kind!r}; valid: {', '.join(AZURE_FILES)}")
    return data_dir / AZURE_SUBDIR / AZURE_FILES[kind]


def missing_inputs(workloads: Iterable[Workload], data_dir: Path) -> dict[str, Path]:
    """Workload name -> the trace file it needs but cannot find."""
    out: dict[str, Path] = {}
    for w in workloads:
        if w.needs_azure:
            path = azure_path(data_dir, w.source.split(":", 1)[1])
            if not path.is_file():
                out[w.name] = path
    return out


@functools.lru_cache(maxsize=8)
def _load_azure(path: str) -> tuple[Request, ...]:
    return load_trace(path, "azure").requests


def build_requests(workload: Workload, data_dir: Path) -> tuple[Request, ...]:
    """The workload's requests, deterministic (cached per process)."""
    if workload.needs_azure:
        path = azure_path(data_dir, workload.source.split(":", 1)[1])
        if not path.is_file():
            raise ScenarioError(
                f"workload {workload.name}: trace file {path} not found "
                "(set SPECGOV_SHARED_DATA or --data-dir)"
            )
        trace = Trace(name=path.stem, requests=_load_azure(str(path)), source=f"azure:{path}")
    elif workload.source.startswith("synthetic"):
        trace = generate_trace(parse_synthetic_spec(workload.source))
    else:
        raise ScenarioError(
            f"workload {workload.name}: unknown source {workload.source!r}; expected "
            "azure:conv, azure:code or a synthetic:... spec"
        )
    window = workload.window_s
    trace = transform_trace(
        trace,
        window_start_s=window[0] if window else None,
        window_end_s=window[1] if window else None,
        rate_scale=workload.rate_scale,
        sample_fraction=workload.sample_fraction,
        max_requests=workload.max_requests,
        seed=0,
    )
    return trace.requests
