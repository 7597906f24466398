"""SGLang launch configurations: the flags and the ``--speculative-adaptive-config`` JSON.

The restart loop (DESIGN.md) decides what SGLang cannot change live: algorithm, tree
shape, candidate step sets, memory knobs. This module turns such a decision (a
:class:`~specgov.policies.common.types.SpecShape` plus a per-slot candidate table) into the
argv SGLang 0.5.23 is launched with and the adaptive-config JSON it reads, and refuses
every combination SGLang would reject, silently rewrite, or silently ignore. Each
refusal quotes SGLang's own reason where it has one (the wording is checked against the
wheel by ``tests/contract/test_launch_config_contract.py``).

SGLang 0.5.23 rules applied here (``arg_groups/speculative_hook.py`` and
``speculative/adaptive_spec_params.py``):

* ``--speculative-adaptive`` runs only for EAGLE/EAGLE3 (NEXTN is an alias SGLang
  resolves to EAGLE first) with ``--speculative-eagle-topk 1``; otherwise SGLang logs
  ``speculative_adaptive disabled: <reason>`` and falls back to static speculation. A
  launch config that asked for adaptive speculation but would not get it is refused.
* ``--speculative-num-steps`` must be one of the candidate steps (the union over all
  slots): SGLang raises otherwise. When unset SGLang picks ``union[len // 2]``; specgov
  always writes the value explicitly.
* With topk = 1 SGLang rewrites ``--speculative-num-draft-tokens`` to steps + 1 (with
  adaptive speculation, always); specgov refuses any other value instead of letting it
  be rewritten behind the operator's back (``SpecShape`` enforces it).
* Without ``--speculative-adaptive`` the three shape flags come all together or not at
  all (``_handle_eagle_family`` asserts topk and draft tokens are unset when steps is).
  specgov always writes all three.
* Adaptive-config JSON: digit-string keys are batch-size slots, each with a non-empty
  ``candidate_steps`` list of non-negative ints; non-digit keys are knob defaults merged
  into every slot. SGLang silently ignores a non-digit key it does not know (a typo), so
  specgov only writes the six knobs SGLang reads and refuses anything else.
* ``--cuda-graph-max-bs`` does not exist in 0.5.23; the decode CUDA-graph limit is
  ``--cuda-graph-max-bs-decode`` (argparse would reject the short form as an ambiguous
  prefix of ``--cuda-graph-max-bs-decode`` / ``--cuda-graph-max-bs-prefill``).
* NGRAM: SGLang overwrites ``--speculative-eagle-topk`` with
  ``--speculative-ngram-max-bfs-breadth`` (default 10), so the tree width is written as
  the latter.

Slot table syntax (``parse_slots``, the CLI's ``--slots``), entries separated by ``;``::

    1=1,3,5,7;8=0,1,3;32=0,1;64=0           bound=candidate steps
    1=1,3,5,7/ema_alpha=0.3/warmup_batches=5 per-slot knobs after '/'
    ema_alpha=0.3;1=1,3;16=0,1               a bare knob is a default for every slot
    default                                  SGLang's own default table

Step 0's draft-extend pass: SGLang 0.5.23 runs it even at steps 0 unless the
experimental environment variable ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND`` is true
(``srt/environ.py``, read in ``eagle_worker_v2.py``); skipping leaves the drafter's state
stale, so upshifts draft cold. ``LaunchConfig.skip_zero_step_draft_extend`` writes it
into :meth:`LaunchConfig.environment` (refused unless a slot can choose 0, where it
would have no effect); :func:`recommend_skip_zero_step` says when it pays: the slots
that can choose 0 stayed there under load.

No file IO here: callers write :meth:`LaunchConfig.adaptive_config_json` where
:attr:`LaunchConfig.adaptive_config_path` says.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.types import ALGORITHMS, PolicyTypeError, SpecShape
from specgov.policies.common.validation import check_bool, check_int, is_int, is_real, is_step_list
from specgov.policies.engine.adaptive_config import (
    DEFAULT_ADAPTIVE_CONFIG,
    AdaptiveConfigError,
    parse_adaptive_config,
)

SGLANG_VERSION: Final = "0.5.23"
SKIP_ZERO_STEP_ENV: Final = "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"
# recommend_skip_zero_step: the share of a slot's decode batches at steps 0 above which
# the saved draft-extend pass outweighs the rare cold upshifts, and the batches needed
# before a share means anything. Assumed (see the function's doc for the arithmetic).
SKIP_ZERO_MIN_SHARE: Final = 0.9
SKIP_ZERO_MIN_BATCHES: Final = 200
DEFAULT_ADAPTIVE_CONFIG_PATH: Final = "specgov-adaptive-config.json"

# The per-slot knobs AdaptiveStepSlot reads (cfg.get(name, default)); the ints must be
# ints (SGLang compares and takes modulo with them).
ADAPTIVE_KNOBS: Final = (
    "ema_alpha",
    "update_interval",
    "warmup_batches",
    "down_hysteresis",
    "up_hysteresis",
    "ceiling_coeff",
)
_INT_KNOBS: Final = frozenset({"update_interval", "warmup_batches"})

# adaptive_unsupported_reason accepts these after NEXTN -> EAGLE alias resolution.
ADAPTIVE_ALGORITHMS: Final = frozenset({"EAGLE", "EAGLE3", "NEXTN"})
_EAGLE_FAMILY: Final = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"})

DIGITS = re.compile(r"[0-9]+")
_INT = re.compile(r"[+-]?[0-9]+")


class LaunchConfigError(SpecgovError, ValueError):
    """A launch configuration SGLang would reject, rewrite or ignore; says why."""


# ------------------------------------------------------------- SGLang's reasons
# Same wording as sglang 0.5.23 (checked by the contract test), so an operator can
# grep SGLang's log or source for it.


def sglang_adaptive_unsupported_reason(algorithm: str, topk: int) -> str | None:
    """What ``adaptive_unsupported_reason`` says for this algorithm and topk (or None).

    Only the two conditions a launch config decides are covered; the others
    (attention DP, multi-layer EAGLE, two-batch overlap, PD-mux, platform workers)
    depend on flags specgov does not write.
    """
    resolved = "EAGLE" if algorithm == "NEXTN" else algorithm
    if resolved not in ("EAGLE", "EAGLE3"):
        return f"speculative_algorithm={resolved} (only EAGLE/EAGLE3 are supported)"
    if topk != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    return None


def sglang_num_steps_not_candidate(num_steps: int, candidates: Sequence[int]) -> str:
    """``_init_adaptive_speculative_params``'s ValueError text."""
    return (
        f"--speculative-num-steps={num_steps} "
        f"is not in the adaptive config candidate_steps {list(candidates)}. "
        "Pass one of those values."
    )


def sglang_bad_candidate_steps(key: str, steps: object) -> str:
    """``_load_adaptive_config``'s ValueError text for a bad ``candidate_steps``."""
    return f"BS {key}: candidate_steps must be a list of non-negative ints, got {steps!r}"


def sglang_no_slot_key(keys: Sequence[str]) -> str:
    """``_load_adaptive_config``'s ValueError text when no digit key exists."""
    return (
        "speculative_adaptive_config must contain at least one integer-string "
        'BS key, e.g. {"1": {"candidate_steps": [1,3,7]}}. '
        f"Got keys: {list(keys)}"
    )


SGLANG_TOPK1_DRAFT_TOKENS: Final = (
    "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 "
    "when speculative_eagle_topk == 1"
)


# ------------------------------------------------------------------------ helpers


def _check_knobs(where: str, knobs: object) -> None:
    """Knobs are a tuple of (name, number) pairs, names unique, known, sorted."""
    if not isinstance(knobs, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in knobs
    ):
        raise LaunchConfigError(f"{where}: expected a tuple of (knob, value) pairs, got {knobs!r}")
    names = [p[0] for p in knobs]
    for name, value in knobs:
        if name not in ADAPTIVE_KNOBS:
            raise LaunchConfigError(
                f"{where}: unknown knob {name!r}; SGLang reads only {list(ADAPTIVE_KNOBS)} "
                "(it would silently ignore any other key)"
            )
        if name in _INT_KNOBS and not is_int(value):
            raise LaunchConfigError(f"{where}: knob {name!r} must be an int, got {value!r}")
        if not is_real(value):
            raise LaunchConfigError(
                f"{where}: knob {name!r} must be a finite number, got {value!r}"
            )
    if len(set(names)) != len(names):
        raise LaunchConfigError(f"{where}: knob given twice in {names}")
    if names != sorted(names):
        raise LaunchConfigError(f"{where}: knobs must be sorted by name, got {names}")


def _knob_tuple(knobs: Mapping[str, int | float]) -> tuple[tuple[str, int | float], ...]:
    return tuple(sorted(knobs.items()))


# -------------------------------------------------------------------- value types


@dataclass(frozen=True, slots=True)
class SlotCandidates:
    """One slot of the adaptive config: batch sizes from ``bound`` up use these steps.

    ``knobs`` are this slot's own EMA knobs (``ema_alpha`` ...), sorted by name; unset
    knobs take the config-wide defaults, then SGLang's.
    """

    bound: int
    candidate_steps: tuple[int, ...]
    knobs: tuple[tuple[str, int | float], ...] = ()

    def __post_init__(self) -> None:
        check_int(
            "slot bound",
            self.bound,
            error=LaunchConfigError,
            minimum=0,
            form="a non-negative int (a batch size)",
        )
        steps = self.candidate_steps
        if not isinstance(steps, tuple) or not is_step_list(steps):
            raise LaunchConfigError(
                f"slot {self.bound}: SGLang: "
                + sglang_bad_candidate_steps(
                    str(self.bound), list(steps) if isinstance(steps, tuple) else steps
                )
            )
        if list(steps) != sorted(set(steps)):
            raise LaunchConfigError(
                f"slot {self.bound}: candidate_steps must be strictly increasing "
                f"(SGLang sorts and de-duplicates them anyway), got {list(steps)}"
            )
        _check_knobs(f"slot {self.bound}", self.knobs)

    @classmethod
    def of(cls, bound: int, steps: Iterable[int], **knobs: int | float) -> SlotCandidates:
        """Build a slot, sorting and de-duplicating the steps as SGLang does."""
        raw = list(steps)
        if not is_step_list(raw):
            raise LaunchConfigError(
                f"slot {bound}: SGLang: " + sglang_bad_candidate_steps(str(bound), raw)
            )
        return cls(bound, tuple(sorted(set(raw))), _knob_tuple(knobs))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"candidate_steps": list(self.candidate_steps)}
        out.update(self.knobs)
        return out


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """A complete SGLang launch configuration for speculation.

    ``slots`` empty means static speculation (no ``--speculative-adaptive``). With
    slots, ``shape.candidate_steps`` must be their union (what SGLang prebuilds);
    :func:`build_launch_config` fills it in. ``defaults`` are config-wide knobs
    (the JSON's non-digit keys). ``cuda_graph_max_bs_decode`` is written as
    ``--cuda-graph-max-bs-decode``.
    """

    shape: SpecShape
    slots: tuple[SlotCandidates, ...] = ()
    defaults: tuple[tuple[str, int | float], ...] = ()
    draft_model_path: str | None = None
    adaptive_config_path: str = DEFAULT_ADAPTIVE_CONFIG_PATH
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    cuda_graph_max_bs_decode: int | None = None
    rationale: str = ""
    skip_zero_step_draft_extend: bool = False

    def __post_init__(self) -> None:
        shape = self.shape
        if not isinstance(shape, SpecShape):
            raise LaunchConfigError(f"LaunchConfig.shape: expected a SpecShape, got {shape!r}")
        if not isinstance(self.slots, tuple) or not all(
            isinstance(s, SlotCandidates) for s in self.slots
        ):
            raise LaunchConfigError(
                f"LaunchConfig.slots: expected a tuple of SlotCandidates, got {self.slots!r}"
            )
        bounds = [s.bound for s in self.slots]
        if bounds != sorted(set(bounds)):
            raise LaunchConfigError(
                f"LaunchConfig.slots: slot bounds must be unique and increasing, got {bounds}"
            )
        _check_knobs("LaunchConfig.defaults", self.defaults)
        if self.slots:
            self._check_adaptive()
        else:
            self._check_static()
        self._check_draft_model_path()
        path = self.adaptive_config_path
        if not isinstance(path, str) or not path.strip():
            raise LaunchConfigError(
                f"LaunchConfig.adaptive_config_path: expected a non-empty path, got {path!r}"
            )
        mem = self.mem_fraction_static
        if mem is not None and not (is_real(mem) and 0.0 < mem < 1.0):
            raise LaunchConfigError(
                f"--mem-fraction-static: expected a fraction in (0, 1), got {mem!r}"
            )
        for flag, value in (
            ("--max-running-requests", self.max_running_requests),
            ("--cuda-graph-max-bs-decode", self.cuda_graph_max_bs_decode),
        ):
            if value is not None and (not is_int(value) or value < 1):
                raise LaunchConfigError(f"{flag}: expected an int >= 1, got {value!r}")
        check_bool(
            "LaunchConfig.skip_zero_step_draft_extend",
            self.skip_zero_step_draft_extend,
            error=LaunchConfigError,
        )
        if self.skip_zero_step_draft_extend and not any(
            0 in slot.candidate_steps for slot in self.slots
        ):
            raise LaunchConfigError(
                f"{SKIP_ZERO_STEP_ENV} only changes steps-0 verifies, and no slot can choose "
                "0: SGLang would ignore it (add 0 to a slot's candidate steps, or drop it)"
            )
        if not isinstance(self.rationale, str):
            raise LaunchConfigError(
                f"LaunchConfig.rationale: expected a str, got {self.rationale!r}"
            )

    # ------------------------------------------------------------ validation

    def _check_adaptive(self) -> None:
        shape = self.shape
        if shape.algorithm == "NONE":
            raise LaunchConfigError(
                "a slot table needs speculation: algorithm NONE launches without "
                "--speculative-adaptive (drop the slots, or pick EAGLE/EAGLE3)"
            )
        reason = sglang_adaptive_unsupported_reason(shape.algorithm, shape.topk)
        if reason is not None:
            raise LaunchConfigError(
                f"SGLang {SGLANG_VERSION} would not run adaptive speculation: "
                f"speculative_adaptive disabled: {reason}. "
                "(SGLang falls back to static speculation silently; specgov refuses instead.)"
            )
        union = tuple(sorted({s for slot in self.slots for s in slot.candidate_steps}))
        if shape.num_steps not in union:
            raise LaunchConfigError(
                "SGLang: " + sglang_num_steps_not_candidate(shape.num_steps, union)
            )
        if shape.candidate_steps != union:
            raise LaunchConfigError(
                f"SpecShape.candidate_steps {list(shape.candidate_steps)} must equal the union "
                f"of the slots' candidate steps {list(union)} (what SGLang prebuilds); "
                "build_launch_config fills it in"
            )
        try:
            parse_adaptive_config(self._config_object(), source="adaptive config")
        except AdaptiveConfigError as exc:
            raise LaunchConfigError(str(exc)) from None

    def _check_static(self) -> None:
        shape = self.shape
        if self.defaults:
            raise LaunchConfigError(
                "adaptive knobs were given without a slot table: they only apply with "
                "--speculative-adaptive"
            )
        allowed = ((), (shape.num_steps,)) if shape.algorithm != "NONE" else ((),)
        if shape.candidate_steps not in allowed:
            raise LaunchConfigError(
                f"SpecShape.candidate_steps {list(shape.candidate_steps)}: a static launch "
                f"builds only --speculative-num-steps={shape.num_steps}; give a slot table "
                "for several candidates"
            )

    def _check_draft_model_path(self) -> None:
        path = self.draft_model_path
        if path is None:
            return
        if not isinstance(path, str) or not path.strip():
            raise LaunchConfigError(
                f"--speculative-draft-model-path: expected a non-empty path, got {path!r}"
            )
        if self.shape.algorithm in ("NONE", "NGRAM"):
            raise LaunchConfigError(
                f"--speculative-draft-model-path makes no sense with algorithm "
                f"{self.shape.algorithm} (it has no draft model)"
            )

    # ---------------------------------------------------------------- output

    @property
    def adaptive(self) -> bool:
        return bool(self.slots)

    def adaptive_config_json(self) -> dict[str, Any] | None:
        """The ``--speculative-adaptive-config`` object, or None for a static launch.

        Config-wide knob defaults first, then slots by increasing bound.
        """
        return self._config_object() if self.slots else None

    def _config_object(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.defaults)
        for slot in self.slots:
            out[str(slot.bound)] = slot.to_json()
        return out

    def to_argv(self) -> list[str]:
        """SGLang launch flags, to append to ``python -m sglang.launch_server ...``."""
        shape = self.shape
        argv: list[str] = []
        if shape.algorithm != "NONE":
            argv += ["--speculative-algorithm", shape.algorithm]
            if self.draft_model_path is not None:
                argv += ["--speculative-draft-model-path", self.draft_model_path]
            argv += ["--speculative-num-steps", str(shape.num_steps)]
            if shape.algorithm == "NGRAM":
                # SGLang sets speculative_eagle_topk from this flag for NGRAM.
                argv += ["--speculative-ngram-max-bfs-breadth", str(shape.topk)]
            else:
                argv += ["--speculative-eagle-topk", str(shape.topk)]
            argv += ["--speculative-num-draft-tokens", str(shape.num_draft_tokens)]
            if self.slots:
                argv += [
                    "--speculative-adaptive",
                    "--speculative-adaptive-config",
                    self.adaptive_config_path,
                ]
        if self.mem_fraction_static is not None:
            argv += ["--mem-fraction-static", repr(float(self.mem_fraction_static))]
        if self.max_running_requests is not None:
            argv += ["--max-running-requests", str(self.max_running_requests)]
        if self.cuda_graph_max_bs_decode is not None:
            argv += ["--cuda-graph-max-bs-decode", str(self.cuda_graph_max_bs_decode)]
        return argv

    def to_shell(self) -> str:
        """The flags as one shell-quoted line."""
        return shlex.join(self.to_argv())

    def environment(self) -> dict[str, str]:
        """Environment variables the SGLang process must be started with."""
        return {SKIP_ZERO_STEP_ENV: "1"} if self.skip_zero_step_draft_extend else {}

    def to_json(self) -> dict[str, Any]:
        """Machine-readable form (``specgov sglang-args --output json``)."""
        return {
            "sglang_version": SGLANG_VERSION,
            "shape": self.shape.to_dict(),
            "adaptive": self.adaptive,
            "argv": self.to_argv(),
            "shell": self.to_shell(),
            "adaptive_config_path": self.adaptive_config_path if self.adaptive else None,
            "adaptive_config": self.adaptive_config_json(),
            "environment": self.environment(),
            "rationale": self.rationale,
        }


# ----------------------------------------------------------------------- builders


def build_launch_config(
    shape: SpecShape,
    slots: Sequence[SlotCandidates] = (),
    *,
    defaults: Mapping[str, int | float] | None = None,
    draft_model_path: str | None = None,
    adaptive_config_path: str = DEFAULT_ADAPTIVE_CONFIG_PATH,
    mem_fraction_static: float | None = None,
    max_running_requests: int | None = None,
    cuda_graph_max_bs_decode: int | None = None,
    rationale: str = "",
    skip_zero_step_draft_extend: bool = False,
) -> LaunchConfig:
    """A validated :class:`LaunchConfig`; fills ``shape.candidate_steps`` from the slots.

    Raises :class:`LaunchConfigError` with SGLang's reason for a bad combination.
    """
    if not isinstance(shape, SpecShape):
        raise LaunchConfigError(f"shape: expected a SpecShape, got {shape!r}")
    ordered = tuple(sorted(slots, key=lambda s: s.bound if isinstance(s, SlotCandidates) else 0))
    bounds = [s.bound for s in ordered if isinstance(s, SlotCandidates)]
    dupes = sorted({b for b in bounds if bounds.count(b) > 1})
    if dupes:
        raise LaunchConfigError(f"slot bound(s) {dupes} given more than once")
    if (
        ordered
        and shape.algorithm != "NONE"
        and all(isinstance(s, SlotCandidates) for s in ordered)
    ):
        union = tuple(sorted({s for slot in ordered for s in slot.candidate_steps}))
        if shape.candidate_steps not in ((), union):
            raise LaunchConfigError(
                f"SpecShape.candidate_steps {list(shape.candidate_steps)} differ from the union "
                f"of the slots' candidate steps {list(union)}"
            )
        shape = _with_candidates(shape, union)
    return LaunchConfig(
        shape=shape,
        slots=ordered,
        defaults=_knob_tuple(defaults or {}),
        draft_model_path=draft_model_path,
        adaptive_config_path=adaptive_config_path,
        mem_fraction_static=mem_fraction_static,
        max_running_requests=max_running_requests,
        cuda_graph_max_bs_decode=cuda_graph_max_bs_decode,
        rationale=rationale,
        skip_zero_step_draft_extend=skip_zero_step_draft_extend,
    )


def recommend_skip_zero_step(
    batches_by_slot_steps: Mapping[tuple[int, int], int],
    slots: Sequence[SlotCandidates],
    *,
    min_share: float = SKIP_ZERO_MIN_SHARE,
    min_batches: int = SKIP_ZERO_MIN_BATCHES,
) -> str | None:
    """Why to launch with ``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1``, or None.

    *batches_by_slot_steps* counts decode batches per (slot bound, steps), as the
    simulator's ``EngineResult.steps_hist`` or a tier-stats window holds them. It pays
    when every slot that can choose 0 and ran at least *min_batches* batches spent at
    least *min_share* of them at 0 (the high slots stayed off under load): each such
    batch saves the draft-extend pass (6-9 % of a step for Llama-3.1-8B + EAGLE-3 on
    H100), while an upshift costs one verify without accepted drafts and ~14.6 % less
    acceptance for a while, and at a share of 0.9 upshifts are at most one batch in ten.
    """
    if not 0.0 < min_share <= 1.0:
        raise LaunchConfigError(f"min_share: expected a fraction in (0, 1], got {min_share!r}")
    if not is_int(min_batches) or min_batches < 1:
        raise LaunchConfigError(f"min_batches: expected an int >= 1, got {min_batches!r}")
    zero_slots = [s.bound for s in slots if 0 in s.candidate_steps]
    shares: dict[int, tuple[float, int]] = {}
    for bound in zero_slots:
        total = sum(n for (slot, _), n in batches_by_slot_steps.items() if slot == bound)
        if total >= min_batches:
            shares[bound] = (batches_by_slot_steps.get((bound, 0), 0) / total, total)
    if not shares or any(share < min_share for share, _ in shares.values()):
        return None
    seen = ", ".join(
        f"slot {b}: {100 * share:.0f} % of {n} batches" for b, (share, n) in sorted(shares.items())
    )
    return (
        f"the slots that can choose 0 stayed at 0 under load ({seen}): launch with "
        f"{SKIP_ZERO_STEP_ENV}=1 to skip their draft-extend pass (experimental in SGLang "
        f"{SGLANG_VERSION}; an upshift then drafts from stale state)"
    )


def _with_candidates(shape: SpecShape, candidates: tuple[int, ...]) -> SpecShape:
    return SpecShape(
        algorithm=shape.algorithm,
        num_steps=shape.num_steps,
        topk=shape.topk,
        num_draft_tokens=shape.num_draft_tokens,
        candidate_steps=candidates,
    )


def normalise_algorithm(algorithm: object, where: str) -> str:
    if not isinstance(algorithm, str) or not algorithm.strip():
        raise LaunchConfigError(f"{where}: expected an algorithm name, got {algorithm!r}")
    algo = algorithm.strip().upper()
    if algo not in ALGORITHMS:
        raise LaunchConfigError(
            f"{where}: unknown algorithm {algorithm!r}; specgov configures "
            f"{sorted(ALGORITHMS)} (SGLang's --speculative-algorithm values it models, "
            "NONE = no speculation)"
        )
    return algo


def make_shape(
    algorithm: str, num_steps: int, topk: int, num_draft_tokens: int, where: str
) -> SpecShape:
    for flag, value, minimum in (
        ("num_steps", num_steps, 1),
        ("topk", topk, 1),
        ("num_draft_tokens", num_draft_tokens, 1),
    ):
        if not is_int(value) or value < minimum:
            raise LaunchConfigError(f"{where}: {flag} must be an int >= {minimum}, got {value!r}")
    if algorithm in _EAGLE_FAMILY and topk == 1 and num_draft_tokens != num_steps + 1:
        raise LaunchConfigError(
            f"{where}: with topk 1 num_draft_tokens must be num_steps + 1 = {num_steps + 1}, "
            f"got {num_draft_tokens}; SGLang would silently rewrite it "
            f'("{SGLANG_TOPK1_DRAFT_TOKENS}")'
        )
    try:
        return SpecShape(algorithm, num_steps, topk, num_draft_tokens, ())
    except PolicyTypeError as exc:
        raise LaunchConfigError(f"{where}: {exc}") from None


def shape_from_flags(
    algorithm: str | None,
    num_steps: int | None,
    topk: int | None,
    num_draft_tokens: int | None,
    *,
    adaptive_candidates: Sequence[int] | None = None,
) -> SpecShape:
    """A SpecShape from SGLang-style flags, resolving omissions as SGLang would.

    Without a slot table (``adaptive_candidates`` None) the three numbers come all
    together or not at all, and "not at all" is refused: SGLang would then choose by
    model architecture, which specgov cannot see. With one, omitted values resolve like
    ``_init_adaptive_speculative_params``: topk 1, steps the middle candidate, draft
    tokens steps + 1. ``candidate_steps`` is left empty (build_launch_config fills it).
    """
    algo = normalise_algorithm(algorithm, "--algorithm")
    given = {
        "--num-steps": num_steps,
        "--topk": topk,
        "--num-draft-tokens": num_draft_tokens,
    }
    named = [flag for flag, value in given.items() if value is not None]
    if algo == "NONE":
        if named:
            raise LaunchConfigError(f"algorithm NONE (no speculation) takes no {', '.join(named)}")
        return SpecShape("NONE", 0, 0, 0, ())
    if adaptive_candidates is None:
        if not named:
            raise LaunchConfigError(
                f"algorithm {algo}: give --num-steps, --topk and --num-draft-tokens (or "
                "--shape, or --slots for adaptive speculation); left unset, SGLang picks them "
                "from the model architecture, which specgov cannot see"
            )
        if len(named) < 3:
            missing = [flag for flag in given if flag not in named]
            raise LaunchConfigError(
                "--num-steps, --topk and --num-draft-tokens go all together or not at all: "
                f"got {', '.join(named)} without {', '.join(missing)} (SGLang {SGLANG_VERSION}, "
                "_handle_eagle_family: without --speculative-adaptive, an unset "
                "--speculative-num-steps requires --speculative-eagle-topk and "
                "--speculative-num-draft-tokens unset too, and a set one needs a topk)"
            )
        assert num_steps is not None and topk is not None and num_draft_tokens is not None
        return make_shape(algo, num_steps, topk, num_draft_tokens, "flags")
    union = sorted(set(adaptive_candidates))
    if not union:
        raise LaunchConfigError("SGLang: " + sglang_no_slot_key([]))
    resolved_topk = 1 if topk is None else topk
    steps = union[len(union) // 2] if num_steps is None else num_steps
    if steps == 0 and num_steps is None:
        raise LaunchConfigError(
            f"SGLang would start at --speculative-num-steps={steps} (the middle candidate of "
            f"{union}); give --num-steps with a positive candidate"
        )
    draft = steps + 1 if num_draft_tokens is None else num_draft_tokens
    return make_shape(algo, steps, resolved_topk, draft, "flags")


def parse_shape(text: str) -> SpecShape:
    """Parse the compact shape form.

    ``ALGO:STEPS,TOPK,DRAFT_TOKENS`` (``EAGLE3:3,1,4``; ``EAGLE:5,4,8`` for a tree),
    ``ALGO:STEPS`` (a chain: topk 1, draft tokens steps + 1), or ``NONE``.
    """
    if not isinstance(text, str):
        raise LaunchConfigError(f"--shape: expected text, got {text!r}")
    raw = text.strip()
    expected = "expected ALGO:STEPS,TOPK,DRAFT_TOKENS (e.g. EAGLE3:3,1,4), ALGO:STEPS or NONE"
    algo_part, sep, nums_part = raw.partition(":")
    algo = normalise_algorithm(algo_part, f"--shape {raw!r}")
    if algo == "NONE":
        if sep:
            raise LaunchConfigError(f"--shape {raw!r}: NONE takes no numbers")
        return SpecShape("NONE", 0, 0, 0, ())
    if not sep or not nums_part.strip():
        raise LaunchConfigError(f"--shape {raw!r}: {expected}")
    parts = [p.strip() for p in nums_part.split(",")]
    if len(parts) not in (1, 3):
        raise LaunchConfigError(f"--shape {raw!r}: {expected}; got {len(parts)} numbers")
    numbers: list[int] = []
    for name, part in zip(("STEPS", "TOPK", "DRAFT_TOKENS"), parts, strict=False):
        if not _INT.fullmatch(part):
            raise LaunchConfigError(f"--shape {raw!r}: {name} {part!r} is not an integer")
        numbers.append(int(part))
    if len(numbers) == 1:
        numbers += [1, numbers[0] + 1]
    return make_shape(algo, numbers[0], numbers[1], numbers[2], f"--shape {raw!r}")


def _parse_number(text: str) -> int | float | None:
    if _INT.fullmatch(text):
        return int(text)
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _parse_knob(item: str, where: str) -> tuple[str, int | float]:
    name, sep, value_text = item.partition("=")
    name = name.strip()
    if not sep:
        raise LaunchConfigError(f"{where}: knob {item!r}: expected NAME=VALUE")
    if name not in ADAPTIVE_KNOBS:
        raise LaunchConfigError(
            f"{where}: unknown knob {name!r}; expected one of {list(ADAPTIVE_KNOBS)}"
        )
    value = _parse_number(value_text.strip())
    if value is None:
        raise LaunchConfigError(f"{where}: knob {name}: {value_text.strip()!r} is not a number")
    return name, value


def default_slots() -> tuple[SlotCandidates, ...]:
    """SGLang 0.5.23's DEFAULT_ADAPTIVE_CONFIG as slots (its per-slot knobs included)."""
    out = []
    for key, entry in DEFAULT_ADAPTIVE_CONFIG.items():
        knobs = {k: v for k, v in entry.items() if k != "candidate_steps"}
        out.append(SlotCandidates.of(int(key), entry["candidate_steps"], **knobs))
    return tuple(sorted(out, key=lambda s: s.bound))


def parse_slots(text: str) -> tuple[tuple[SlotCandidates, ...], dict[str, int | float]]:
    """Parse the ``--slots`` syntax (module docstring) into (slots, default knobs)."""
    if not isinstance(text, str):
        raise LaunchConfigError(f"--slots: expected text, got {text!r}")
    raw = text.strip()
    if raw.lower() == "default":
        return default_slots(), {}
    entries = [e.strip() for e in raw.split(";")]
    if entries and entries[-1] == "":
        entries.pop()  # a trailing ';' is harmless
    if not entries:
        raise LaunchConfigError("--slots: empty; SGLang: " + sglang_no_slot_key([]))
    slots: dict[int, SlotCandidates] = {}
    defaults: dict[str, int | float] = {}
    for i, entry in enumerate(entries, start=1):
        where = f"--slots entry {i} ({entry!r})"
        if not entry:
            raise LaunchConfigError(f"{where}: empty entry (two ';' in a row?)")
        head, *knob_items = entry.split("/")
        key, sep, value = head.partition("=")
        key = key.strip()
        if not sep:
            raise LaunchConfigError(f"{where}: expected BOUND=STEPS (e.g. 1=1,3,5,7) or KNOB=VALUE")
        if not DIGITS.fullmatch(key):
            if key in ADAPTIVE_KNOBS and not knob_items:
                name, number = _parse_knob(head, where)
                if name in defaults:
                    raise LaunchConfigError(f"{where}: default knob {name!r} given twice")
                defaults[name] = number
                continue
            raise LaunchConfigError(
                f"{where}: slot key {key!r} is not a batch size (digits only); SGLang reads "
                "only digit-string keys as slots and would silently treat any other key as "
                f"a default knob (known knobs: {list(ADAPTIVE_KNOBS)})"
            )
        bound = int(key)
        if bound in slots:
            raise LaunchConfigError(f"{where}: slot {bound} given more than once")
        steps: list[int] = []
        step_texts = [s.strip() for s in value.split(",")] if value.strip() else []
        for step_text in step_texts:
            if not _INT.fullmatch(step_text):
                raise LaunchConfigError(
                    f"{where}: step {step_text!r} is not an integer; SGLang: "
                    + sglang_bad_candidate_steps(key, step_texts)
                )
            steps.append(int(step_text))
        if not is_step_list(steps):
            raise LaunchConfigError(f"{where}: SGLang: " + sglang_bad_candidate_steps(key, steps))
        knobs: dict[str, int | float] = {}
        for item in knob_items:
            name, number = _parse_knob(item, where)
            if name in knobs:
                raise LaunchConfigError(f"{where}: knob {name!r} given twice")
            knobs[name] = number
        slots[bound] = SlotCandidates.of(bound, steps, **knobs)
    if not slots:
        raise LaunchConfigError(
            "--slots: no batch-size slot; SGLang: " + sglang_no_slot_key(list(defaults))
        )
    return tuple(slots[b] for b in sorted(slots)), defaults


def format_slots(
    slots: Sequence[SlotCandidates], defaults: Mapping[str, int | float] | None = None
) -> str:
    """The ``--slots`` text for a table (inverse of :func:`parse_slots`)."""
    parts = [f"{k}={v}" for k, v in sorted((defaults or {}).items())]
    for slot in slots:
        text = f"{slot.bound}=" + ",".join(str(s) for s in slot.candidate_steps)
        text += "".join(f"/{k}={v}" for k, v in slot.knobs)
        parts.append(text)
    return ";".join(parts)
