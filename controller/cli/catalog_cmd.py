"""`specgov catalog list` / `show`: the GPUs, target models and drafters the simulator
knows; `show NAME` gives one entry's figures with their provenance and, for a drafter,
what a step at 0 drafts costs beyond a plain step, term by term (issue 22 §2).

Offline (no daemon): the names are what `specgov replay --gpu/--model/--drafter` and
the deployment section of the config take. The simulator's catalog is imported inside
the command (DESIGN.md layering).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from specgov.controller.cli import options as opt


def catalog_rows(extra_files: tuple[Path, ...] = ()) -> dict[str, list[dict[str, Any]]]:
    """The catalog as JSON-ready rows per section (gpus, models, drafters)."""
    from specgov.simulator.catalog import Catalog

    cat = Catalog.load(extra_files)
    return {
        "gpus": [
            {
                "name": g.name,
                "memory_gib": g.memory_gib,
                "hbm_bandwidth_tb_s": g.hbm_bandwidth_tb_s,
                "bf16_tflops": g.bf16_tflops,
                "aliases": list(g.aliases),
            }
            for g in cat.gpus()
        ],
        "models": [
            {
                "name": m.name,
                "params_b": m.params_b,
                "weights_gib": m.weight_bytes / 2**30,
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "default_spec": [
                    m.default_spec_steps,
                    m.default_spec_topk,
                    m.default_spec_draft_tokens,
                ],
                "startup_s": m.startup_s,
                "aliases": list(m.aliases),
            }
            for m in cat.models()
        ],
        "drafters": [
            {
                "name": d.name,
                "algorithm": d.algorithm,
                "params_b": d.params_b,
                "params_b_by_target": dict(d.params_b_by_target),
                "acceptance_profile": d.acceptance_profile,
                "targets": list(d.targets),
                "aliases": list(d.aliases),
            }
            for d in cat.drafters()
        ],
    }


def _drafter_size(d: dict[str, Any]) -> str:
    from specgov.controller.cli.format import number

    if not d["params_b"] and not any(d["params_b_by_target"].values()):
        return "none (no network)"
    size = number(d["params_b"], 2, "B")
    per = ", ".join(f"{t}: {number(v, 2, 'B')}" for t, v in d["params_b_by_target"].items())
    return f"{size} ({per})" if per else size


@click.group("catalog")
def catalog_group() -> None:
    """The simulator's catalog of GPUs, models and drafters (offline)."""


# Both commands print more than one table.
_output_option = opt.output_option("Tables for people, or JSON for scripts.")


@catalog_group.command("list")
@opt.catalog_option
@_output_option
def catalog_list(catalog: tuple[Path, ...], output: str) -> None:
    """GPUs, target models and drafters, by the names replay and the config take."""
    from specgov.simulator.catalog import CatalogError

    try:
        data = catalog_rows(catalog)
    except CatalogError as exc:
        raise click.UsageError(str(exc)) from None
    if output == "json":
        click.echo(json.dumps(data, indent=2))
        return

    from rich.console import Console
    from rich.table import Table

    from specgov.controller.cli.format import number

    def aliases(row: dict[str, Any]) -> str:
        return ", ".join(row["aliases"]) or "-"

    gpus = Table(title="GPUs (--gpu)", title_justify="left")
    for col in ("name", "memory", "HBM bandwidth", "BF16 dense", "aliases"):
        gpus.add_column(col, justify="left" if col in ("name", "aliases") else "right")
    for g in data["gpus"]:
        gpus.add_row(
            g["name"],
            number(g["memory_gib"], 0, "GiB"),
            number(g["hbm_bandwidth_tb_s"], 2, "TB/s"),
            number(g["bf16_tflops"], 0, "TFLOP/s"),
            aliases(g),
        )
    models = Table(title="target models (--model)", title_justify="left")
    for col in (
        "name",
        "parameters",
        "weights",
        "KV per token",
        "SGLang auto shape",
        "start-up",
        "aliases",
    ):
        models.add_column(
            col, justify="left" if col in ("name", "aliases") else "right", no_wrap=col == "name"
        )
    for m in data["models"]:
        steps, topk, tokens = m["default_spec"]
        models.add_row(
            m["name"],
            number(m["params_b"], 1, "B"),
            number(m["weights_gib"], 1, "GiB"),
            number(m["kv_bytes_per_token"] / 1024, 0, "KiB"),
            f"{steps}/{topk}/{tokens}",
            "-" if m["startup_s"] is None else number(m["startup_s"], 0, "s"),
            aliases(m),
        )
    drafters = Table(title="drafters (--drafter)", title_justify="left")
    for col in ("name", "algorithm", "parameters", "acceptance profile", "targets", "aliases"):
        drafters.add_column(col, no_wrap=col == "name")
    for d in data["drafters"]:
        drafters.add_row(
            d["name"],
            d["algorithm"],
            _drafter_size(d),
            d["acceptance_profile"],
            ", ".join(d["targets"]) or "any",
            aliases(d),
        )
    models.caption = "SGLang auto shape: steps/topk/draft tokens when no flag sets them"
    models.caption_justify = "left"
    console = Console(width=max(Console().width, 110))
    for table in (gpus, models, drafters):
        console.print(table)


# ------------------------------------------------------------- catalog show (issue 22 §2)

# The step-0 terms of a drafter, each with the catalog figure that scales it.
STEP_ZERO_TERMS = (
    ("draft_extend", "zero_step_extend_scale"),
    ("verify_bookkeeping", "zero_step_verify_scale"),
    ("kv_pool_reduction", "kv_pool_reduction_scale"),
)


def step_zero_report(
    gpu_name: str,
    model_name: str,
    drafter: Any,
    *,
    batches: tuple[int, ...],
    context_tokens: int,
    extra_files: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """What a speculative server at step 0 pays beyond a plain one, by term, for one
    GPU and model: per batch size (step times and the terms, ms) and at saturation
    (the KV-bound batch at *context_tokens* per request, and the throughput ratio)."""
    from specgov.simulator.catalog import Catalog
    from specgov.simulator.engine.cost import CostModel
    from specgov.simulator.engine.memory import budget_memory
    from specgov.simulator.replay.runner import sglang_gpu_defaults

    cat = Catalog.load(extra_files)
    gpu, model = cat.gpu(gpu_name), cat.model(model_name)
    plain = CostModel.from_catalog(gpu, model, None)
    spec = CostModel.from_catalog(gpu, model, drafter)
    chunk, graph_bs = sglang_gpu_defaults(gpu.memory_gib)

    def pool(d: Any, steps: tuple[int, ...]) -> int:
        plan = budget_memory(
            gpu,
            model,
            d,
            candidate_steps=steps,
            cuda_graph_max_bs=graph_bs,
            chunked_prefill_size=chunk,
        ).require_fit()
        return plan.kv_token_capacity

    def row(b: int) -> dict[str, Any]:
        kv = float(b * context_tokens)
        t_plain = plain.decode_step_s(b, 0, kv)
        t_zero = spec.decode_step_s(b, 0, kv)
        terms = spec.zero_step_terms_s(b, kv)
        return {
            "batch": b,
            "plain_step_ms": 1e3 * t_plain,
            "step0_ms": 1e3 * t_zero,
            "step0_over_plain": t_zero / t_plain,
            **{f"{k}_ms": 1e3 * v for k, v in terms.items()},
        }

    pool_plain = pool(None, ())
    pool_spec = pool(drafter, (0, model.default_spec_steps))
    b_plain = max(1, pool_plain // context_tokens)
    b_spec = max(1, pool_spec // context_tokens)
    sat_plain, sat_spec = row(b_plain), row(b_spec)
    tput = (b_spec / sat_spec["step0_ms"]) / (b_plain / sat_plain["plain_step_ms"])
    return {
        "gpu": gpu.name,
        "model": model.name,
        "drafter": drafter.name,
        "context_tokens": context_tokens,
        "by_batch": [row(b) for b in batches],
        "kv_pool_tokens": {"plain": pool_plain, "speculative": pool_spec},
        "saturation": {
            "plain_batch": b_plain,
            "speculative_batch": b_spec,
            "plain_step_ms": sat_plain["plain_step_ms"],
            "step0_ms": sat_spec["step0_ms"],
            "step0_throughput_over_plain": tput,
        },
    }


def _entry_fields(entry: Any) -> list[tuple[str, str, str, str]]:
    """(field, value, kind, source) of a catalog entry, its provenance attached."""
    import dataclasses

    prov = {f: (k, s) for f, k, s in getattr(entry, "provenance", ())}
    rows = []
    for f in dataclasses.fields(entry):
        if f.name in ("provenance", "name"):
            continue
        value = getattr(entry, f.name)
        kind, source = prov.get(f.name, ("", ""))
        rows.append((f.name, str(value), kind, source))
    return rows


def _find(cat: Any, name: str) -> tuple[str, Any]:
    from specgov.simulator.catalog import CatalogError

    for section, lookup in (("drafter", cat.drafter), ("gpu", cat.gpu), ("model", cat.model)):
        try:
            return section, lookup(name)
        except CatalogError:
            continue
    names = [e.name for e in (*cat.drafters(), *cat.gpus(), *cat.models())]
    raise click.UsageError(f"no catalog entry {name!r}; valid: {', '.join(sorted(names))}")


@catalog_group.command("show")
@click.argument("name")
@opt.catalog_option
@opt.gpu_option("GPU for a drafter's step-0 terms.")
@opt.model_option("Target for the step-0 terms.")
@click.option(
    "--context-tokens",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="KV tokens per request for the step-0 terms and the saturation batch.",
)
@_output_option
def catalog_show(
    name: str, catalog: tuple[Path, ...], gpu: str, model: str, context_tokens: int, output: str
) -> None:
    """One catalog entry (drafter, GPU or model): every figure with its provenance
    (measured, fitted or assumed, and from what); for a drafter also what a step at 0
    drafts costs beyond a plain step, term by term."""
    from specgov.simulator.catalog import Catalog, CatalogError
    from specgov.simulator.engine.cost import CostModelError
    from specgov.simulator.engine.memory import MemoryPlanError

    try:
        cat = Catalog.load(catalog)
        section, entry = _find(cat, name)
        report = None
        if section == "drafter":
            report = step_zero_report(
                gpu,
                model,
                entry,
                batches=(1, 8, 64, 256),
                context_tokens=context_tokens,
                extra_files=catalog,
            )
    except (CatalogError, CostModelError, MemoryPlanError) as exc:
        raise click.UsageError(str(exc)) from None
    fields = _entry_fields(entry)
    if output == "json":
        doc = {
            "section": section,
            "name": entry.name,
            "fields": {f: {"value": v, "kind": k, "source": s} for f, v, k, s in fields},
            "step_zero": report,
        }
        click.echo(json.dumps(doc, indent=2))
        return
    _print_show(section, entry.name, fields, report)


def _print_show(
    section: str, name: str, fields: list[tuple[str, str, str, str]], report: dict[str, Any] | None
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    table = Table(title=f"{section} {name}", title_justify="left")
    for col in ("figure", "value", "kind", "source"):
        table.add_column(col, overflow="fold")
    for row in fields:
        table.add_row(*row)
    console.print(table)
    if report is None:
        return
    steps = Table(
        title=f"step 0 vs a plain step ({report['gpu']}, {report['model']}, "
        f"{report['context_tokens']} KV tokens per request)",
        title_justify="left",
    )
    cols = ("batch", "plain ms", "step 0 ms", "ratio", "draft-extend ms", "verify ms", "other ms")
    for col in cols:
        steps.add_column(col, justify="right")
    for r in report["by_batch"]:
        steps.add_row(
            str(r["batch"]),
            f"{r['plain_step_ms']:.2f}",
            f"{r['step0_ms']:.2f}",
            f"{r['step0_over_plain']:.3f}x",
            f"{r['draft_extend_ms']:.2f}",
            f"{r['verify_bookkeeping_ms']:.2f}",
            f"{r['other_ms']:.2f}",
        )
    console.print(steps)
    pool, sat = report["kv_pool_tokens"], report["saturation"]
    console.print(
        f"KV pool: {pool['plain']} tokens plain, {pool['speculative']} speculative "
        f"({100 * (pool['speculative'] / pool['plain'] - 1):+.1f} %). At saturation "
        f"(KV-bound): batch {sat['plain_batch']} plain at {sat['plain_step_ms']:.1f} ms, "
        f"{sat['speculative_batch']} speculative at step 0 at {sat['step0_ms']:.1f} ms: "
        f"step 0 serves {sat['step0_throughput_over_plain']:.3f}x a plain server's tokens/s.\n"
        "Terms: draft-extend (zero_step_extend_scale), verify bookkeeping "
        "(zero_step_verify_scale), KV pool (kv_pool_reduction_scale); their provenance above."
    )
