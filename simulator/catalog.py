"""Hardware, target-model and drafter catalog of the simulator.

Built-in entries live in ``simulator/data/{gpus,models,drafters}.yaml`` (package
data, read with importlib.resources); their sources are commented there. Users
add or override entries with YAML files of the same schema::

    gpus:
      my-gpu: {memory_gib: 96, hbm_bandwidth_tb_s: 4.0, bf16_tflops: 900}
    models:
      my-model: {params_b: 14.8, bytes_per_param: 2, kv_bytes_per_token: 196608,
                 num_layers: 48, hidden_size: 5120, default_spec_steps: 3,
                 default_spec_topk: 1, default_spec_draft_tokens: 4}
    drafters:
      my-drafter: {algorithm: EAGLE3, params_b: 0.5, kv_bytes_per_token: 4096,
                   static_reserve_gib: 2.0, acceptance_profile: eagle3-llama3.1-8b}
    acceptance_profiles:          # what `specgov fit-acceptance` writes
      my-fit:
        source: "fit-acceptance of my-trace.jsonl"
        default_domain: chat
        domains:
          chat: {rates: [0.69, 0.66, 0.69], token_correlation: 0.45, fit: {...}}

An acceptance profile of a catalog file is used by name (``replay --acceptance-profile``
or a drafter's ``acceptance_profile``) and wins over a built-in profile of that name.
``request_correlation`` (h, default 0) is the per-request share of acceptance
variance; ``runs: true`` samples exact-match runs (``acceptance_runs``) instead.
``token_correlation`` null (or absent) samples the rates per verify; ``fit`` is the
fit's report, kept as written and not read by the simulator.

A user entry replaces the built-in entry of the same name. Names and aliases are
looked up case-insensitively. Every schema problem raises ``CatalogError`` naming
the file, the key path and the expected form.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int, is_real
from specgov.simulator.engine.acceptance import DomainAcceptance

__all__ = [
    "PROVENANCE_KINDS",
    "AcceptanceProfileSpec",
    "Catalog",
    "CatalogError",
    "DrafterSpec",
    "GpuSpec",
    "ModelSpec",
]

GIB = float(1 << 30)

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._/+-]*$")
_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
_SECTIONS = ("gpus", "models", "drafters", "acceptance_profiles")
_BUILTIN_FILES = ("gpus.yaml", "models.yaml", "drafters.yaml")


class CatalogError(SpecgovError, ValueError):
    """An unknown catalog name or a malformed catalog file; the message says which."""


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: datasheet figures plus the fractions real kernels achieve."""

    name: str
    memory_gib: float
    hbm_bandwidth_tb_s: float
    bf16_tflops: float
    bandwidth_efficiency: float = 0.8
    compute_efficiency: float = 0.72
    aliases: tuple[str, ...] = ()
    # field -> (measured | fitted | assumed, where the figure comes from)
    provenance: tuple[tuple[str, str, str], ...] = ()
    # Achieved host-to-device copy bandwidth, GB/s (HiCache load-back); None: unknown.
    pcie_gb_s: float | None = None

    @property
    def achieved_bandwidth_bytes_s(self) -> float:
        return self.hbm_bandwidth_tb_s * 1e12 * self.bandwidth_efficiency

    @property
    def achieved_flops_s(self) -> float:
        return self.bf16_tflops * 1e12 * self.compute_efficiency


@dataclass(frozen=True)
class ModelSpec:
    """A target model: size, KV footprint, shape and SGLang's auto speculative shape."""

    name: str
    params_b: float
    bytes_per_param: float
    kv_bytes_per_token: int
    num_layers: int
    hidden_size: int
    default_spec_steps: int
    default_spec_topk: int
    default_spec_draft_tokens: int
    aliases: tuple[str, ...] = ()
    # field -> (measured | fitted | assumed, where the figure comes from)
    provenance: tuple[tuple[str, str, str], ...] = ()
    # Seconds from launch until an SGLang server of this model answers /health (weights,
    # CUDA graph capture, warm-up): what a restart costs. None: the entry gives none.
    startup_s: float | None = None

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter (EAGLE-3 head, n-gram lookup, standalone draft model).

    ``params_b`` is the default size; ``params_b_by_target`` holds per-target sizes
    (an EAGLE head is as wide as its target). ``targets`` lists the target models it
    can draft for (empty: any). Cost figures are explained in drafters.yaml and
    simulator/engine/cost.py.
    """

    name: str
    algorithm: str
    params_b: float
    kv_bytes_per_token: int
    static_reserve_gib: float
    acceptance_profile: str
    step_overhead_ms: float = 0.0
    extend_overhead_ms: float = 0.0
    verify_overhead_ms: float = 0.0
    verify_token_overhead_us: float = 0.0
    per_request_us: float = 0.0
    # GPU time a change of the step count (SGLang's runtime-state switch) stalls the next
    # decode forward; 0 (the default, assumed): a switch is free.
    tier_switch_ms: float = 0.0
    # Step 0 (issue 22 §2): the share of each term a speculative step at 0 drafts pays
    # (1: as SGLang 0.5.23 runs it; 0: free), and of the KV pool the drafter takes.
    zero_step_extend_scale: float = 1.0
    zero_step_verify_scale: float = 1.0
    kv_pool_reduction_scale: float = 1.0
    bytes_per_param: float = 2.0
    params_b_by_target: tuple[tuple[str, float], ...] = ()
    targets: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    # field -> (measured | fitted | assumed, where the figure comes from)
    provenance: tuple[tuple[str, str, str], ...] = ()

    def supports(self, target: str) -> bool:
        return not self.targets or target.lower() in self.targets

    def params_b_for(self, target: str) -> float:
        key = target.lower()
        for name, value in self.params_b_by_target:
            if name == key:
                return value
        return self.params_b

    def weight_bytes_for(self, target: str) -> float:
        return self.params_b_for(target) * 1e9 * self.bytes_per_param

    @property
    def has_model(self) -> bool:
        """True when drafting runs a neural network (weights on the GPU)."""
        return self.params_b > 0 or any(v > 0 for _, v in self.params_b_by_target)


@dataclass(frozen=True)
class AcceptanceProfileSpec:
    """An acceptance profile from a catalog file: per domain, rates and token correlation."""

    name: str
    domains: tuple[tuple[str, DomainAcceptance], ...]
    default_domain: str | None = None
    source: str = ""
    aliases: tuple[str, ...] = ()
    # field -> (measured | fitted | assumed, where the figure comes from)
    provenance: tuple[tuple[str, str, str], ...] = ()

    def as_profiles(self) -> dict[str, dict[str, DomainAcceptance]]:
        """The ``profiles=`` argument of ``AcceptanceModel`` for this profile."""
        return {self.name: dict(self.domains)}


# --------------------------------------------------------------------------- parsing


class _Ctx:
    """Where a value came from, for error messages."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, path: str, form: str, value: object) -> CatalogError:
        return CatalogError(f"{self.file}: {path}: expected {form}, got {value!r}")


def _number(ctx: _Ctx, path: str, value: object, *, minimum: float, strict: bool) -> float:
    form = f"a number {'>' if strict else '>='} {minimum:g}"
    # is_real: finite, so NaN (which no comparison below would reject) and ints beyond
    # float range (float() would raise OverflowError) are refused here.
    if not is_real(value) or value < minimum or (strict and value == minimum):
        raise ctx.fail(path, form, value)
    return float(value)


def _pos(ctx: _Ctx, path: str, value: object) -> float:
    return _number(ctx, path, value, minimum=0.0, strict=True)


def _nonneg(ctx: _Ctx, path: str, value: object) -> float:
    return _number(ctx, path, value, minimum=0.0, strict=False)


def _fraction(ctx: _Ctx, path: str, value: object) -> float:
    out = _pos(ctx, path, value)
    if out > 1.0:
        raise ctx.fail(path, "a fraction in (0, 1]", value)
    return out


def _int(ctx: _Ctx, path: str, value: object, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ctx.fail(path, f"an integer >= {minimum}", value)
    return value


def _pos_int(ctx: _Ctx, path: str, value: object) -> int:
    return _int(ctx, path, value, 1)


def _nonneg_int(ctx: _Ctx, path: str, value: object) -> int:
    return _int(ctx, path, value, 0)


def _name(ctx: _Ctx, path: str, value: object) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value.strip().lower()):
        raise ctx.fail(path, "a name of letters, digits and . _ / + -", value)
    return value.strip().lower()


def _names(ctx: _Ctx, path: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ctx.fail(path, "a list of names", value)
    return tuple(_name(ctx, f"{path}[{i}]", v) for i, v in enumerate(value))


def _algorithm(ctx: _Ctx, path: str, value: object) -> str:
    if not isinstance(value, str) or value.strip().upper() not in _ALGORITHMS:
        raise ctx.fail(path, f"one of {', '.join(_ALGORITHMS)}", value)
    return value.strip().upper()


def _text(ctx: _Ctx, path: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ctx.fail(path, "a non-empty string", value)
    return value.strip()


_Field = tuple[Callable[[_Ctx, str, object], Any], bool]  # (parser, required)

PROVENANCE_KINDS = ("measured", "fitted", "assumed")
_PROVENANCE_FORM = "a mapping of field -> 'measured|fitted|assumed: where the figure comes from'"


def _provenance(ctx: _Ctx, path: str, value: object) -> tuple[tuple[str, str, str], ...]:
    """``provenance: {field: "kind: source"}`` of one entry (issue 11 §5)."""
    if not isinstance(value, dict):
        raise ctx.fail(path, _PROVENANCE_FORM, value)
    out = []
    for key, text in value.items():
        kind, _, source = str(text).partition(":") if isinstance(text, str) else ("", "", "")
        kind = kind.strip().lower()
        if kind not in PROVENANCE_KINDS or not source.strip():
            raise ctx.fail(f"{path}.{key}", "'measured|fitted|assumed: <source>'", text)
        out.append((str(key), kind, source.strip()))
    return tuple(out)


_GPU_FIELDS: dict[str, _Field] = {
    "memory_gib": (_pos, True),
    "hbm_bandwidth_tb_s": (_pos, True),
    "bf16_tflops": (_pos, True),
    "bandwidth_efficiency": (_fraction, False),
    "compute_efficiency": (_fraction, False),
    "pcie_gb_s": (_pos, False),
    "aliases": (_names, False),
}
_MODEL_FIELDS: dict[str, _Field] = {
    "params_b": (_pos, True),
    "bytes_per_param": (_pos, True),
    "kv_bytes_per_token": (_pos_int, True),
    "num_layers": (_pos_int, True),
    "hidden_size": (_pos_int, True),
    "default_spec_steps": (_pos_int, True),
    "default_spec_topk": (_pos_int, True),
    "default_spec_draft_tokens": (_pos_int, True),
    "startup_s": (_nonneg, False),
    "aliases": (_names, False),
}
_DRAFTER_FIELDS: dict[str, _Field] = {
    "algorithm": (_algorithm, True),
    "params_b": (lambda c, p, v: v, True),  # number or map: parsed in _drafter
    "kv_bytes_per_token": (_nonneg_int, True),
    "static_reserve_gib": (_nonneg, True),
    "acceptance_profile": (_text, True),
    "bytes_per_param": (_pos, False),
    "targets": (_names, False),
    "step_overhead_ms": (_nonneg, False),
    "extend_overhead_ms": (_nonneg, False),
    "verify_overhead_ms": (_nonneg, False),
    "verify_token_overhead_us": (_nonneg, False),
    "per_request_us": (_nonneg, False),
    "tier_switch_ms": (_nonneg, False),
    "zero_step_extend_scale": (_nonneg, False),
    "zero_step_verify_scale": (_nonneg, False),
    "kv_pool_reduction_scale": (_nonneg, False),
    "aliases": (_names, False),
}


def _fields(ctx: _Ctx, path: str, entry: object, spec: Mapping[str, _Field]) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise ctx.fail(path, f"a mapping with keys {', '.join(spec)}", entry)
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if key == "provenance":
            prov = _provenance(ctx, f"{path}.provenance", value)
            unknown = [f for f, _, _ in prov if f not in entry or f in ("provenance", "aliases")]
            if unknown:
                raise CatalogError(
                    f"{ctx.file}: {path}.provenance.{unknown[0]}: names no figure of this "
                    "entry; provenance keys are the entry's own figure keys"
                )
            out[key] = prov
            continue
        if key not in spec:
            raise CatalogError(
                f"{ctx.file}: {path}.{key}: unknown key; valid keys: {', '.join(spec)}, provenance"
            )
        out[key] = spec[key][0](ctx, f"{path}.{key}", value)
    missing = [k for k, (_, required) in spec.items() if required and k not in out]
    if missing:
        raise CatalogError(f"{ctx.file}: {path}: missing required key(s) {', '.join(missing)}")
    return out


def _gpu(ctx: _Ctx, path: str, name: str, entry: object) -> GpuSpec:
    return GpuSpec(name=name, **_fields(ctx, path, entry, _GPU_FIELDS))


def _model(ctx: _Ctx, path: str, name: str, entry: object) -> ModelSpec:
    f = _fields(ctx, path, entry, _MODEL_FIELDS)
    return ModelSpec(name=name, **f)


def _drafter(ctx: _Ctx, path: str, name: str, entry: object) -> DrafterSpec:
    f = _fields(ctx, path, entry, _DRAFTER_FIELDS)
    raw = f.pop("params_b")
    by_target: list[tuple[str, float]] = []
    form = "a number >= 0 or a map {default: N, <target model>: N}"
    if isinstance(raw, dict):
        if "default" not in raw:
            raise ctx.fail(f"{path}.params_b", form, raw)
        default = _nonneg(ctx, f"{path}.params_b.default", raw["default"])
        for key, value in raw.items():
            if key == "default":
                continue
            target = _name(ctx, f"{path}.params_b (key)", key)
            by_target.append((target, _nonneg(ctx, f"{path}.params_b.{key}", value)))
    else:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ctx.fail(f"{path}.params_b", form, raw)
        default = _nonneg(ctx, f"{path}.params_b", raw)
    return DrafterSpec(name=name, params_b=default, params_b_by_target=tuple(by_target), **f)


def _rates(ctx: _Ctx, path: str, value: object) -> tuple[float, ...]:
    form = "a non-empty list of acceptance rates in [0, 1]"
    if not isinstance(value, list) or not value:
        raise ctx.fail(path, form, value)
    out = []
    for i, v in enumerate(value):
        if not is_real(v) or not 0.0 <= v <= 1.0:
            raise ctx.fail(f"{path}[{i}]", "an acceptance rate in [0, 1]", v)
        out.append(float(v))
    return tuple(out)


def _correlation(ctx: _Ctx, path: str, value: object) -> float | None:
    if value is None:
        return None
    out = _nonneg(ctx, path, value)
    if out >= 1.0:
        raise ctx.fail(path, "a number in [0, 1) or null", value)
    return out


def _mapping(ctx: _Ctx, path: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ctx.fail(path, "a mapping", value)
    return value


def _fraction_below_one(ctx: _Ctx, path: str, value: object) -> float:
    out = _nonneg(ctx, path, value)
    if out >= 1.0:
        raise ctx.fail(path, "a number in [0, 1)", value)
    return out


def _runs_flag(ctx: _Ctx, path: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ctx.fail(path, "true or false", value)
    return value


_DOMAIN_FIELDS: dict[str, _Field] = {
    "rates": (_rates, True),
    "token_correlation": (_correlation, False),
    "request_correlation": (_fraction_below_one, False),
    "runs": (_runs_flag, False),
    "fit": (_mapping, False),
}
_PROFILE_FIELDS: dict[str, _Field] = {
    "domains": (lambda c, p, v: v, True),  # parsed in _acceptance_profile
    "default_domain": (_name, False),
    "source": (_text, False),
    "aliases": (_names, False),
}


def _acceptance_profile(ctx: _Ctx, path: str, name: str, entry: object) -> AcceptanceProfileSpec:
    f = _fields(ctx, path, entry, _PROFILE_FIELDS)
    raw = f.pop("domains")
    if not isinstance(raw, dict) or not raw:
        raise ctx.fail(f"{path}.domains", "a non-empty mapping of domain -> {rates: [...]}", raw)
    domains: list[tuple[str, DomainAcceptance]] = []
    for key, value in raw.items():
        domain = _name(ctx, f"{path}.domains (domain name)", key)
        d = _fields(ctx, f"{path}.domains.{key}", value, _DOMAIN_FIELDS)
        entry = DomainAcceptance(
            d["rates"],
            d.get("token_correlation"),
            d.get("request_correlation", 0.0),
            d.get("runs", False),
        )
        domains.append((domain, entry))
    default = f.pop("default_domain", None)
    if default is not None and default not in dict(domains):
        raise CatalogError(
            f"{ctx.file}: {path}.default_domain: '{default}' is not one of its domains "
            f"({', '.join(d for d, _ in domains)})"
        )
    return AcceptanceProfileSpec(name=name, domains=tuple(domains), default_domain=default, **f)


_PARSERS: dict[str, Callable[[_Ctx, str, str, object], Any]] = {
    "gpus": _gpu,
    "models": _model,
    "drafters": _drafter,
    "acceptance_profiles": _acceptance_profile,
}


def _parse_document(file: str, text: str) -> dict[str, dict[str, Any]]:
    ctx = _Ctx(file)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CatalogError(f"{file}: not valid YAML: {exc}") from exc
    if doc is None:
        return {}
    form = f"a mapping with any of the sections {', '.join(_SECTIONS)}"
    if not isinstance(doc, dict):
        raise ctx.fail("(top level)", form, doc)
    out: dict[str, dict[str, Any]] = {}
    for section, entries in doc.items():
        if section not in _SECTIONS:
            raise CatalogError(
                f"{file}: {section}: unknown section; valid sections: {', '.join(_SECTIONS)}"
            )
        if entries is None:
            continue
        if not isinstance(entries, dict):
            raise ctx.fail(section, "a mapping of name -> entry", entries)
        parsed: dict[str, Any] = {}
        for raw_name, entry in entries.items():
            name = _name(ctx, f"{section} (entry name)", raw_name)
            if name in parsed:
                raise CatalogError(f"{file}: {section}.{raw_name}: duplicate entry name")
            parsed[name] = _PARSERS[section](ctx, f"{section}.{raw_name}", name, entry)
        out[section] = parsed
    return out


# --------------------------------------------------------------------------- catalog


class _Index:
    """Name and alias lookup for one kind of entry."""

    def __init__(self, kind: str, entries: Mapping[str, Any]) -> None:
        self.kind = kind
        self.entries: dict[str, Any] = dict(entries)
        self.lookup: dict[str, str] = {name: name for name in entries}
        for name, spec in entries.items():
            for alias in spec.aliases:
                if alias in entries:
                    continue  # a real name always wins over another entry's alias
                owner = self.lookup.get(alias)
                if owner is not None and owner != name:
                    raise CatalogError(
                        f"{kind} alias '{alias}' is claimed by both '{owner}' and '{name}'"
                    )
                self.lookup[alias] = name

    def get(self, name: str) -> Any:
        if not isinstance(name, str):
            raise CatalogError(f"{self.kind} name must be a string, got {name!r}")
        key = self.lookup.get(name.strip().lower())
        if key is None:
            raise CatalogError(
                f"unknown {self.kind} '{name}'; valid: {', '.join(sorted(self.entries))}"
            )
        return self.entries[key]


class Catalog:
    """GPUs, target models and drafters by name (case-insensitive, aliases allowed)."""

    def __init__(
        self,
        gpus: Mapping[str, GpuSpec],
        models: Mapping[str, ModelSpec],
        drafters: Mapping[str, DrafterSpec],
        acceptance_profiles: Mapping[str, AcceptanceProfileSpec] | None = None,
    ) -> None:
        self._gpus = _Index("GPU", gpus)
        self._models = _Index("model", models)
        self._drafters = _Index("drafter", drafters)
        self._acceptance = _Index("acceptance profile", acceptance_profiles or {})
        # Cross references: a drafter may only name targets the catalog knows.
        for drafter in drafters.values():
            refs = [*drafter.targets, *(t for t, _ in drafter.params_b_by_target)]
            for target in refs:
                if target not in self._models.lookup:
                    raise CatalogError(
                        f"drafter '{drafter.name}' refers to unknown target model '{target}'; "
                        f"valid: {', '.join(sorted(models))}"
                    )

    @classmethod
    def load(cls, extra_files: Sequence[Path] = ()) -> Catalog:
        """Built-in entries, then each of *extra_files* in order (later names override)."""
        merged: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
        data = resources.files("specgov.simulator").joinpath("data")
        sources: list[tuple[str, str]] = []
        for fname in _BUILTIN_FILES:
            sources.append((f"<builtin>/{fname}", data.joinpath(fname).read_text("utf-8")))
        for path in extra_files:
            p = Path(path)
            try:
                sources.append((str(p), p.read_text(encoding="utf-8")))
            except OSError as exc:
                raise CatalogError(f"{p}: cannot read catalog file: {exc.strerror}") from exc
        for file, text in sources:
            for section, entries in _parse_document(file, text).items():
                merged[section].update(entries)
        return cls(
            merged["gpus"], merged["models"], merged["drafters"], merged["acceptance_profiles"]
        )

    def gpu(self, name: str) -> GpuSpec:
        spec: GpuSpec = self._gpus.get(name)
        return spec

    def model(self, name: str) -> ModelSpec:
        spec: ModelSpec = self._models.get(name)
        return spec

    def drafter(self, name: str) -> DrafterSpec:
        spec: DrafterSpec = self._drafters.get(name)
        return spec

    def acceptance_profile(self, name: str) -> AcceptanceProfileSpec | None:
        """The catalog file's acceptance profile *name*, or None (a built-in one, if any)."""
        if not isinstance(name, str):
            raise CatalogError(f"acceptance profile name must be a string, got {name!r}")
        key = self._acceptance.lookup.get(name.strip().lower())
        spec: AcceptanceProfileSpec | None = (
            self._acceptance.entries[key] if key is not None else None
        )
        return spec

    def acceptance_profile_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._acceptance.entries))

    def gpu_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._gpus.entries))

    def model_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._models.entries))

    def drafter_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._drafters.entries))

    def gpus(self) -> Iterable[GpuSpec]:
        return tuple(self._gpus.entries[n] for n in self.gpu_names())

    def models(self) -> Iterable[ModelSpec]:
        return tuple(self._models.entries[n] for n in self.model_names())

    def drafters(self) -> Iterable[DrafterSpec]:
        return tuple(self._drafters.entries[n] for n in self.drafter_names())
