"""Measure the decode-step cost on a real accelerator and fit a catalog entry (issue 11 §6).

Builds Llama-3.1-8B's architecture with random weights (``transformers``, from a config:
nothing is downloaded) in bf16 on the device, and times:

* target forwards over a grid of batch sizes x tokens per request (1 = plain decode,
  k+1 = a chain verify) x KV lengths, eager (no CUDA graphs) and, where it works,
  ``torch.compile`` on a subset;
* a one-layer EAGLE-style draft head (fc over 3 x hidden -> hidden, one decoder layer,
  a 32k-vocabulary head): one draft step over B tokens, and the draft-extend pass over
  B x (k+1) tokens;
* step 0 against a plain step (issue 22 §2), same model, same shapes: a plain decode
  step (target forward over B tokens, greedy pick) and a speculative step at 0 drafts
  (the same forward keeping the hidden states the drafter reads, the verify path's fp32
  softmax over the full vocabulary and its pick, then the draft-extend pass over the B
  tokens from three captured hidden states). Their difference less the timed
  draft-extend pass is the verify bookkeeping; both terms are fitted as the catalog's
  ``zero_step_extend_scale`` and ``zero_step_verify_scale`` (measured / modelled).
  An emulation with HF transformers, not SGLang's kernels: the entry says so.

Writes ``step_cost.csv`` (one row per timed shape: median, p10, p90) and
``catalog_entry.yaml``: a GPU entry whose achieved-bandwidth and achieved-compute
fractions are fitted to the eager target forwards with the simulator's own forward
model (``fixed + smoothmax(weights_read, n x compute_per_token) + kv x kv_read``, see
simulator/engine/cost.py), and an EAGLE-3 drafter entry whose per-step overhead is the measured
draft step less that roofline. ``specgov replay --catalog catalog_entry.yaml --gpu NAME
--drafter eagle3-NAME`` loads it. Every figure carries its provenance (measured/fitted).

The full grid is sized to finish within 8 minutes on one H100/H200
(``--time-budget-s`` stops timing early and says so); ``--config tiny --device cpu``
runs the same code end to end in seconds (tests/test_measure_step_cost.py).

    python benchmarks/gpu/measure_step_cost.py --out out/step-cost          # on a GPU
    python benchmarks/gpu/measure_step_cost.py --config tiny --device cpu --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy.optimize import least_squares

# Llama-3.1-8B (config.json of meta-llama/Llama-3.1-8B-Instruct) and a tiny stand-in.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "draft_vocab_size": 32000,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "draft_vocab_size": 128,
    },
}
GRID_FULL = {
    "batch_sizes": (1, 2, 4, 8, 16, 32, 64, 128, 256),
    "tokens_per_request": (1, 2, 4, 8),
    "kv_lengths": (512, 2048, 8192),
}
GRID_QUICK = {"batch_sizes": (1, 4, 16), "tokens_per_request": (1, 4), "kv_lengths": (64, 256)}
# torch.compile recompiles per shape, so only a few shapes get it.
COMPILE_SHAPES_FULL = ((1, 1, 2048), (16, 4, 2048), (64, 1, 2048), (64, 4, 2048))
COMPILE_SHAPES_QUICK = ((1, 1, 64),)
DATASHEETS = Path(__file__).resolve().parents[2] / "simulator" / "data" / "gpus.yaml"


@dataclass(frozen=True)
class Row:
    mode: str  # eager | compile
    component: str  # target | draft_step | draft_extend | plain_step | step0_step
    batch_size: int
    tokens_per_request: int
    kv_len: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    repeats: int

    @property
    def batched_tokens(self) -> int:
        return self.batch_size * self.tokens_per_request

    @property
    def kv_tokens(self) -> int:
        return self.batch_size * self.kv_len


def _parse_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="llama-3.1-8b")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--quick", action="store_true", help="a small grid (smoke run)")
    p.add_argument("--batch-sizes", type=_parse_ints, default=None)
    p.add_argument("--tokens-per-request", type=_parse_ints, default=None)
    p.add_argument("--kv-lengths", type=_parse_ints, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument(
        "--kv-budget-gib",
        type=float,
        default=48.0,
        help="skip grid points whose KV cache would exceed this",
    )
    p.add_argument("--time-budget-s", type=float, default=420.0)
    p.add_argument(
        "--base-gpu",
        default=None,
        help="catalog GPU whose datasheet figures the entry keeps (default: from the "
        "device name: h100/h200/a100-80g/...; required on other devices)",
    )
    p.add_argument("--name", default=None, help="catalog name of the fitted GPU entry")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


# ------------------------------------------------------------------ models


def build_models(cfg: dict[str, Any], device: Any, dtype: Any, seed: int) -> tuple[Any, Any, Any]:
    """The target (random weights) and a one-layer EAGLE-style draft head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    common = {k: v for k, v in cfg.items() if k != "draft_vocab_size"}
    target_cfg = LlamaConfig(**common, attn_implementation="sdpa", tie_word_embeddings=False)
    draft_cfg = LlamaConfig(
        **{**common, "num_hidden_layers": 1, "vocab_size": cfg["draft_vocab_size"]},
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the serving dtype: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            target = LlamaForCausalLM(target_cfg).eval()
            draft = LlamaForCausalLM(draft_cfg).eval()
            # EAGLE-3 fuses three target hidden states into one input.
            fc = torch.nn.Linear(3 * cfg["hidden_size"], cfg["hidden_size"], bias=False)
    finally:
        torch.set_default_dtype(previous)
    return target, draft, fc


def _cache(model: Any, batch: int, kv_len: int, device: Any, dtype: Any) -> Any:
    """A DynamicCache holding *kv_len* random tokens per request for every layer."""
    import torch
    from transformers import DynamicCache

    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    cache = DynamicCache()
    for layer in range(c.num_hidden_layers):
        k = torch.randn(batch, c.num_key_value_heads, kv_len, head_dim, device=device, dtype=dtype)
        cache.update(k, torch.randn_like(k), layer)
    return cache


def _kv_gib(cfg: dict[str, Any], batch: int, kv_len: int, bytes_per: int) -> float:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * bytes_per
    return batch * kv_len * per_token / 2**30


def _timer(device: Any) -> Callable[[], float]:
    import torch

    if str(device).startswith("cuda"):

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    return time.perf_counter


def _time(
    fn: Callable[[], Any], now: Callable[[], float], warmup: int, repeats: int
) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = now()
        fn()
        out.append((now() - t0) * 1e3)
    return out


def _row(mode: str, comp: str, b: int, t: int, kv: int, ms: list[float]) -> Row:
    qs = np.percentile(ms, [10, 90]) if len(ms) > 1 else (ms[0], ms[0])
    return Row(mode, comp, b, t, kv, statistics.median(ms), float(qs[0]), float(qs[1]), len(ms))


# ------------------------------------------------------------------ timing


def step_calls(
    cfg: dict[str, Any],
    models: tuple[Any, Any, Any],
    gen: Any,
    shape: tuple[int, int],
    caches: tuple[Any, Any],
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """A plain decode step and a speculative step at 0 drafts for *shape* (batch, KV
    length), random token ids from *gen* (module doc)."""
    import torch

    target, draft, fc = models
    cache, dcache = caches
    b, kv = shape
    ids = torch.randint(0, cfg["vocab_size"], (b, 1), generator=gen).to(target.device)
    n_layers = cfg["num_hidden_layers"]
    # EAGLE-3 reads a low, a middle and a high layer's hidden states.
    taps = (min(2, n_layers), n_layers // 2, max(n_layers - 2, 1))
    pos = torch.arange(kv, kv + 1, device=target.device)

    def plain() -> Any:
        with torch.inference_mode():
            out = target(input_ids=ids, past_key_values=cache, cache_position=pos)
            nxt = out.logits[:, -1].argmax(-1)
        cache.crop(-1)
        return nxt

    def step0() -> Any:
        with torch.inference_mode():
            out = target(
                input_ids=ids, past_key_values=cache, cache_position=pos, output_hidden_states=True
            )
            probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
            nxt = probs.argmax(-1)
            feats = torch.cat([out.hidden_states[i] for i in taps], dim=-1)
            draft(inputs_embeds=fc(feats), past_key_values=dcache, cache_position=pos)
        cache.crop(-1)
        dcache.crop(-1)
        return nxt

    return plain, step0


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[list[Row], list[str]]:
    import torch

    cfg = CONFIGS[args.config]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    bytes_per = torch.finfo(dtype).bits // 8
    grid = GRID_QUICK if args.quick else GRID_FULL
    batches = args.batch_sizes or grid["batch_sizes"]
    tokens = args.tokens_per_request or grid["tokens_per_request"]
    kv_lengths = args.kv_lengths or grid["kv_lengths"]
    notes: list[str] = []
    start = time.perf_counter()
    target, draft, fc = build_models(cfg, device, dtype, args.seed)
    log(f"built {args.config} ({sum(p.numel() for p in target.parameters()) / 1e9:.3f} B params)")
    now = _timer(device)
    rows: list[Row] = []
    vocab = cfg["vocab_size"]
    hidden = cfg["hidden_size"]
    gen = torch.Generator(device="cpu").manual_seed(args.seed)

    def target_call(model: Any, b: int, t: int, kv: int, cache: Any) -> Callable[[], Any]:
        ids = torch.randint(0, vocab, (b, t), generator=gen).to(device)
        pos = torch.arange(kv, kv + t, device=device)

        def run() -> Any:
            with torch.inference_mode():
                out = model(
                    input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True
                )
            cache.crop(-t)  # back to kv tokens for the next repeat (negative: remove t)
            return out

        return run

    def draft_call(b: int, t: int, kv: int, cache: Any) -> Callable[[], Any]:
        feats = torch.randn(b, t, 3 * hidden, generator=gen).to(device=device, dtype=dtype)
        pos = torch.arange(kv, kv + t, device=device)

        def run() -> Any:
            with torch.inference_mode():
                emb = fc(feats)
                out = draft(inputs_embeds=emb, past_key_values=cache, cache_position=pos)
            cache.crop(-t)
            return out

        return run

    over_budget = False
    for kv in kv_lengths:
        for b in batches:
            if _kv_gib(cfg, b, kv, bytes_per) > args.kv_budget_gib:
                notes.append(f"skipped batch {b} x kv {kv}: KV over --kv-budget-gib")
                continue
            if time.perf_counter() - start > args.time_budget_s:
                over_budget = True
                break
            cache = _cache(target, b, kv, device, dtype)
            dcache = _cache(draft, b, kv, device, dtype)
            for t in tokens:
                ms = _time(target_call(target, b, t, kv, cache), now, args.warmup, args.repeats)
                rows.append(_row("eager", "target", b, t, kv, ms))
                ms = _time(draft_call(b, t, kv, dcache), now, args.warmup, args.repeats)
                rows.append(_row("eager", "draft_extend", b, t, kv, ms))
            ms = _time(draft_call(b, 1, kv, dcache), now, args.warmup, args.repeats)
            rows.append(_row("eager", "draft_step", b, 1, kv, ms))
            calls = step_calls(cfg, (target, draft, fc), gen, (b, kv), (cache, dcache))
            for comp, fn in zip(("plain_step", "step0_step"), calls, strict=True):
                rows.append(
                    _row("eager", comp, b, 1, kv, _time(fn, now, args.warmup, args.repeats))
                )
            del cache, dcache
            log(f"eager kv={kv} batch={b}: done ({time.perf_counter() - start:.0f} s)")
        if over_budget:
            break
    if over_budget:
        notes.append(f"time budget {args.time_budget_s:g} s reached: the eager grid is partial")
    if not args.no_compile and not over_budget:
        rows += _measure_compiled(args, cfg, target, now, target_call, log, notes, start)
    return rows, notes


def _measure_compiled(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    target: Any,
    now: Callable[[], float],
    target_call: Callable[..., Callable[[], Any]],
    log: Callable[[str], None],
    notes: list[str],
    start: float,
) -> list[Row]:
    import torch

    try:
        compiled = torch.compile(target, dynamic=False)
    except Exception as exc:  # torch.compile is optional: say why, keep the eager grid
        notes.append(f"torch.compile unavailable: {type(exc).__name__}: {exc}")
        return []
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for b, t, kv in COMPILE_SHAPES_QUICK if args.quick else COMPILE_SHAPES_FULL:
        if time.perf_counter() - start > args.time_budget_s:
            notes.append("time budget reached during torch.compile shapes")
            break
        try:
            cache = _cache(target, b, kv, device, dtype)
            ms = _time(target_call(compiled, b, t, kv, cache), now, args.warmup + 1, args.repeats)
        except Exception as exc:  # a backend that cannot compile: recorded, not fatal
            notes.append(f"torch.compile failed at batch {b} x {t} x kv {kv}: {exc!s:.200}")
            break
        rows.append(_row("compile", "target", b, t, kv, ms))
        log(f"compile batch={b} tokens={t} kv={kv}: {rows[-1].median_ms:.3f} ms")
    return rows


# ------------------------------------------------------------------ fit


def _params(cfg: dict[str, Any], *, draft: bool) -> float:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kvh, heads = cfg["num_key_value_heads"], cfg["num_attention_heads"]
    head_dim = h // heads
    attn = h * h * 2 + 2 * h * kvh * head_dim
    mlp = 3 * h * inter
    if draft:
        return float(attn + mlp + 3 * h * h + cfg["draft_vocab_size"] * h)
    return float(layers * (attn + mlp) + 2 * cfg["vocab_size"] * h)


def _kv_bytes(cfg: dict[str, Any], bytes_per: int, *, draft: bool) -> float:
    layers = 1 if draft else cfg["num_hidden_layers"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return float(2 * layers * cfg["num_key_value_heads"] * head_dim * bytes_per)


def fit_forward(rows: Sequence[Row]) -> dict[str, float]:
    """fixed, weights_read, compute_per_token, kv_read_per_token (seconds), p = 2."""
    target = [r for r in rows if r.mode == "eager" and r.component == "target"]
    if len(target) < 4:
        raise SystemExit(f"too few target timings to fit ({len(target)}); widen the grid")
    n = np.array([r.batched_tokens for r in target], dtype=float)
    kv = np.array([r.kv_tokens for r in target], dtype=float)
    y = np.array([r.median_ms * 1e-3 for r in target])

    def model(x: np.ndarray) -> np.ndarray:
        fixed, w, c, r = x
        return fixed + np.sqrt(w * w + (n * c) ** 2) + kv * r

    x0 = np.array(
        [0.2 * y.min(), 0.8 * y.min(), (y.max() - y.min()) / max(n.max(), 1) + 1e-9, 1e-9]
    )
    # Relative residuals: the small, flat shapes matter as much as the big ones.
    res = least_squares(lambda x: (model(x) - y) / y, x0, bounds=(0.0, np.inf))
    fixed, w, c, r = (float(v) for v in res.x)
    rel = np.abs(model(res.x) / y - 1.0)
    return {
        "fixed_s": fixed,
        "weight_read_s": w,
        "compute_per_token_s": c,
        "kv_read_per_token_s": r,
        "median_rel_error": float(np.median(rel)),
        "max_rel_error": float(rel.max()),
        "points": float(len(target)),
    }


# The built-in eagle3 entry's per-verify figures (simulator/data/drafters.yaml), which the
# model's step-0 terms are made of: draft-extend launch, verify overhead, per token.
EXTEND_OVERHEAD_S = 0.35e-3
VERIFY_OVERHEAD_S = 0.50e-3
VERIFY_PER_TOKEN_S = 14e-6


def step_zero_fit(rows: Sequence[Row], d_w: float, d_c: float, d_kv: float) -> dict[str, float]:
    """Measured step-0 terms against the model's (simulator/engine/cost.py, zero_step_terms_s):
    the draft-extend pass (timed at B tokens) and the verify bookkeeping (step 0 less a
    plain step less that pass); their medians over shapes are the catalog's scales."""
    by = {(r.component, r.batch_size, r.kv_len, r.tokens_per_request): r for r in rows}
    extend, verify, ratio = [], [], []
    for (comp, b, kv, _t), r in by.items():
        plain = by.get(("plain_step", b, kv, 1))
        ext = by.get(("draft_extend", b, kv, 1))
        if comp != "step0_step" or plain is None or ext is None:
            continue
        ext_model = math.sqrt(d_w**2 + (b * d_c) ** 2) + b * kv * d_kv + EXTEND_OVERHEAD_S
        ver_model = VERIFY_OVERHEAD_S + b * VERIFY_PER_TOKEN_S
        bookkeeping = max(0.0, (r.median_ms - plain.median_ms - ext.median_ms) * 1e-3)
        extend.append(ext.median_ms * 1e-3 / ext_model)
        verify.append(bookkeeping / ver_model)
        ratio.append(r.median_ms / plain.median_ms)
    if not ratio:
        return {}
    return {
        "extend_scale": statistics.median(extend),
        "verify_scale": statistics.median(verify),
        "over_plain_median": statistics.median(ratio),
        "over_plain_max": max(ratio),
        "points": float(len(ratio)),
    }


def _add_zero_step(
    drafter: dict[str, Any], zero: dict[str, float], source: str
) -> dict[str, float]:
    """The fitted step-0 scales, with their provenance, into the drafter entry (none
    when no step 0 was timed); returns *zero*."""
    if not zero:
        return zero
    drafter["zero_step_extend_scale"] = _sig(zero["extend_scale"])
    drafter["zero_step_verify_scale"] = _sig(zero["verify_scale"])
    how = f"{source}, median over {int(zero['points'])} shapes (an HF emulation)"
    drafter["provenance"]["zero_step_extend_scale"] = (
        f"fitted: timed step-0 draft-extend pass / the model's, {how}"
    )
    drafter["provenance"]["zero_step_verify_scale"] = (
        f"fitted: step 0 less a plain step less draft-extend / the model's bookkeeping, {how}"
    )
    return zero


def _base_gpu(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    sheets = yaml.safe_load(DATASHEETS.read_text(encoding="utf-8"))["gpus"]
    name = args.base_gpu
    if name is None:
        import torch

        if not str(args.device).startswith("cuda"):
            raise SystemExit("--base-gpu is required off CUDA (whose datasheet to keep)")
        label = torch.cuda.get_device_name(torch.device(args.device)).lower()
        name = next(
            (g for g in ("h200", "h100", "a100-80g", "b200", "l40s") if g[:4] in label), None
        )
        if name is None:
            raise SystemExit(f"cannot tell the catalog GPU from {label!r}: pass --base-gpu")
    if name not in sheets:
        raise SystemExit(f"--base-gpu {name!r} is not a built-in GPU: {', '.join(sorted(sheets))}")
    return name, sheets[name]


def _sig(value: float) -> float:
    """Four significant digits (a tiny CPU fraction must not round to 0)."""
    return float(f"{value:.4g}")


def _gpu_entry(
    base_name: str, base: dict[str, Any], bw_eff: float, compute_eff: float, source: str
) -> dict[str, Any]:
    """The measured GPU's catalog entry: *base_name*'s datasheet figures and the fitted
    bandwidth and compute fractions."""
    return {
        "memory_gib": base["memory_gib"],
        "hbm_bandwidth_tb_s": base["hbm_bandwidth_tb_s"],
        "bf16_tflops": base["bf16_tflops"],
        "bandwidth_efficiency": _sig(bw_eff),
        "compute_efficiency": _sig(compute_eff),
        "provenance": {
            "memory_gib": f"measured: vendor datasheet ({base_name})",
            "hbm_bandwidth_tb_s": f"measured: vendor datasheet ({base_name})",
            "bf16_tflops": f"measured: vendor datasheet ({base_name})",
            "bandwidth_efficiency": f"fitted: weight read of eager target forwards, {source}",
            "compute_efficiency": f"fitted: past-the-knee slope of eager target forwards, {source}",
        },
    }


def catalog_entry(
    args: argparse.Namespace, rows: Sequence[Row], fit: dict[str, float]
) -> dict[str, Any]:
    cfg = CONFIGS[args.config]
    bytes_per = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    base_name, base = _base_gpu(args)
    name = args.name or f"measured-{base_name}"
    bw = base["hbm_bandwidth_tb_s"] * 1e12
    flops = base["bf16_tflops"] * 1e12
    params = _params(cfg, draft=False)
    bw_eff = params * bytes_per / (fit["weight_read_s"] * bw) if fit["weight_read_s"] else 1.0
    compute_eff = (
        2 * params / (fit["compute_per_token_s"] * flops) if fit["compute_per_token_s"] else 1.0
    )
    kv_eff = (
        _kv_bytes(cfg, bytes_per, draft=False) / (fit["kv_read_per_token_s"] * bw)
        if fit["kv_read_per_token_s"]
        else math.inf
    )
    clip = lambda v: float(min(1.0, max(1e-6, v)))  # noqa: E731 - catalog fractions
    source = f"measure_step_cost.py --config {args.config} on {args.device}"
    gpu_entry = _gpu_entry(base_name, base, clip(bw_eff), clip(compute_eff), source)
    # Draft step: what the roofline (with the fitted fractions) leaves is the overhead.
    d_params = _params(cfg, draft=True)
    d_w = d_params * bytes_per / (bw * clip(bw_eff))
    d_c = 2 * d_params / (flops * clip(compute_eff))
    d_kv = _kv_bytes(cfg, bytes_per, draft=True) / (bw * clip(bw_eff))
    overheads = []
    for r in rows:
        if r.mode == "eager" and r.component == "draft_step":
            roof = math.sqrt(d_w**2 + (r.batch_size * d_c) ** 2) + r.kv_tokens * d_kv
            overheads.append(max(0.0, r.median_ms * 1e-3 - roof))
    step_overhead_ms = 1e3 * statistics.median(overheads) if overheads else 0.0
    drafter = {
        "aliases": [],
        "algorithm": "EAGLE3",
        "params_b": _sig(d_params / 1e9),
        "bytes_per_param": bytes_per,
        "kv_bytes_per_token": int(_kv_bytes(cfg, bytes_per, draft=True)),
        "static_reserve_gib": 2.0,
        "acceptance_profile": "eagle3-llama3.1-8b",
        "step_overhead_ms": _sig(step_overhead_ms),
        "extend_overhead_ms": 0.35,
        "verify_overhead_ms": 0.5,
        "verify_token_overhead_us": 14.0,
        "per_request_us": 0.0,
        "provenance": {
            "params_b": f"measured: the timed draft head's parameters ({args.config})",
            "bytes_per_param": f"measured: --dtype {args.dtype}",
            "kv_bytes_per_token": "measured: the timed draft head's shape",
            "static_reserve_gib": "assumed: the built-in eagle3 entry's (REFERENCE §1)",
            "step_overhead_ms": f"fitted: median draft step less its roofline, {source}",
            "extend_overhead_ms": "assumed: the built-in eagle3 entry's",
            "verify_overhead_ms": "assumed: the built-in eagle3 entry's",
            "verify_token_overhead_us": "assumed: the built-in eagle3 entry's",
            "per_request_us": "assumed: the built-in eagle3 entry's",
        },
    }
    zero = _add_zero_step(drafter, step_zero_fit(rows, d_w, d_c, d_kv), source)
    del drafter["aliases"]
    if args.config == "llama-3.1-8b":
        drafter["targets"] = ["llama-3.1-8b"]
    return {
        "gpus": {name: gpu_entry},
        "drafters": {f"eagle3-{name}": drafter},
        "_fit": {
            "kv_bandwidth_efficiency": None if math.isinf(kv_eff) else _sig(kv_eff),
            **fit,
            **{f"step0_{k}": v for k, v in zero.items()},
        },
    }


def write_outputs(out: Path, rows: Sequence[Row], entry: dict[str, Any], notes: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "step_cost.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(
            ["mode", "component", "batch_size", "tokens_per_request", "kv_len",
             "batched_tokens", "kv_tokens", "median_ms", "p10_ms", "p90_ms", "repeats"]
        )  # fmt: skip
        for r in rows:
            w.writerow(
                [r.mode, r.component, r.batch_size, r.tokens_per_request, r.kv_len,
                 r.batched_tokens, r.kv_tokens, f"{r.median_ms:.4f}", f"{r.p10_ms:.4f}",
                 f"{r.p90_ms:.4f}", r.repeats]
            )  # fmt: skip
    fit = entry.pop("_fit")
    header = (
        "# Fitted by benchmarks/gpu/measure_step_cost.py (issue 11 §6): load with\n"
        "#   specgov replay ... --catalog catalog_entry.yaml --gpu "
        f"{next(iter(entry['gpus']))} --drafter {next(iter(entry['drafters']))}\n"
        f"# fit: {json.dumps(fit)}\n" + "".join(f"# note: {n}\n" for n in notes)
    )
    (out / "catalog_entry.yaml").write_text(
        header + yaml.safe_dump(entry, sort_keys=False), encoding="utf-8"
    )
    (out / "fit.json").write_text(json.dumps({"fit": fit, "notes": notes}, indent=2), "utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    def log(msg: str) -> None:
        print(f"[measure_step_cost] {msg}", file=sys.stderr, flush=True)

    rows, notes = measure(args, log)
    fit = fit_forward(rows)
    entry = catalog_entry(args, rows, fit)
    zero = {k[6:]: v for k, v in entry["_fit"].items() if k.startswith("step0_")}
    write_outputs(args.out, rows, entry, notes)
    gpu = next(iter(entry["gpus"].values()))
    print(
        f"fit over {int(fit['points'])} eager target forwards: "
        f"fixed {fit['fixed_s'] * 1e3:.3f} ms, "
        f"weights {fit['weight_read_s'] * 1e3:.3f} ms, {fit['compute_per_token_s'] * 1e6:.3f} "
        f"us/token, {fit['kv_read_per_token_s'] * 1e9:.3f} ns/KV token (median error "
        f"{100 * fit['median_rel_error']:.1f} %); bandwidth_efficiency "
        f"{gpu['bandwidth_efficiency']}, compute_efficiency {gpu['compute_efficiency']}"
    )
    if zero:
        print(
            f"step 0 vs a plain step over {int(zero['points'])} shapes: median "
            f"{zero['over_plain_median']:.3f}x (max {zero['over_plain_max']:.3f}x); fitted "
            f"zero_step_extend_scale {zero['extend_scale']:.3g}, zero_step_verify_scale "
            f"{zero['verify_scale']:.3g} (catalog: 1.0 assumed)"
        )
    print(f"wrote {args.out / 'step_cost.csv'} and {args.out / 'catalog_entry.yaml'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
