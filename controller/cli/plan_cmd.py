"""`specgov plan`: capacity planning (VRAM budget, sustainable load, fleets).

Registered on the `specgov` group by ``controller/cli/main.py``; the simulator is
imported inside each command (DESIGN.md layering).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specgov.controller.cli import options as opt
from specgov.controller.cli.format import BadInput, cell

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from specgov.simulator.planning.prices import Prices
    from specgov.simulator.planning.sweep import JobSpec, SweepSettings
    from specgov.simulator.workload.traces import Trace

EXIT_DOES_NOT_FIT = 3


@click.group(name="plan")
def plan_group() -> None:
    """Plan capacity offline: VRAM budgets, sustainable load under an SLO, fleets."""


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _sizes_gb(text: str) -> list[int]:
    """``--hicache-sizes``: whole GB >= 0, comma-separated."""
    parts = _csv(text)
    if not parts or not all(p.isdigit() for p in parts):
        raise BadInput(f"--hicache-sizes {text!r}: expected whole GB >= 0, e.g. 0,64,256")
    return [int(p) for p in parts]


def _write_report(out_dir: Path, **documents: Any) -> Path:
    """Hand the documents to the HTML report (simulator/planning/report.py).

    Imported by name: the report module is built separately and may be absent.
    """
    import importlib

    try:
        module = importlib.import_module("specgov.simulator.planning.report")
    except ImportError as exc:
        raise click.ClickException(f"--report: the HTML report is not available ({exc})") from None
    try:
        path = module.write_report(out_dir, **documents)
    except (ValueError, OSError) as exc:  # ReportError is a ValueError
        raise click.ClickException(f"--report: {exc}") from None
    return Path(path)


@plan_group.command(name="vram")
@click.option("--gpu", "gpus", default="h100", show_default=True, help="GPU(s), comma-separated.")
@opt.model_option()
@click.option("--tp-size", type=click.IntRange(min=1), default=1, show_default=True)
@opt.drafter_option("Drafter, or 'none'.")
@click.option("--steps", type=click.IntRange(min=0), default=3, show_default=True)
@opt.topk_option()
@opt.num_draft_tokens_option(min_tokens=2)
@click.option(
    "--candidates",
    default=None,
    help="Adaptive candidate steps (one runtime state each): 'static' (only --steps, the "
    "default), 'sglang-default' (0,1,3,5,7), 'specgov' (0..7) or a list like 0,1,3.",
)
@click.option(
    "--mem-fraction-static",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True, max_open=True),
    default=None,
    help="Default: SGLang's heuristic.",
)
@opt.max_running_requests_option
@click.option("--cuda-graph-max-bs", type=click.IntRange(min=1), default=None)
@opt.catalog_option
@opt.output_option()
@opt.report_option("Write the HTML report (with the breakdowns) into this folder.")
def vram_cmd(
    gpus: str,
    model: str,
    tp_size: int,
    drafter: str,
    steps: int,
    topk: int,
    num_draft_tokens: int | None,
    candidates: str | None,
    mem_fraction_static: float | None,
    max_running_requests: int | None,
    cuda_graph_max_bs: int | None,
    catalog: tuple[Path, ...],
    output: str,
    report: Path | None,
) -> None:
    """VRAM budget of one configuration per GPU: weights, KV pool, graphs, what is left.

    Exits 3 when a configuration does not fit (the breakdown still printed).
    """
    from specgov.simulator.planning.vram import (
        parse_candidates,
        render_vram,
        vram_document,
        vram_plan,
    )

    if topk > 1 and num_draft_tokens is None:
        raise click.UsageError("--topk > 1 (a tree) needs --num-draft-tokens")
    documents: list[dict[str, Any]] = []
    try:
        candidate_steps = parse_candidates(candidates, steps)
        for gpu in _csv(gpus) or ["h100"]:
            plan, used = vram_plan(
                gpu=gpu,
                model=model,
                drafter=drafter,
                steps=steps,
                topk=topk,
                num_draft_tokens=num_draft_tokens,
                candidate_steps=candidate_steps,
                mem_fraction_static=mem_fraction_static,
                max_running_requests=max_running_requests,
                cuda_graph_max_bs=cuda_graph_max_bs,
                tp_size=tp_size,
                catalog_files=catalog,
            )
            documents.append(
                vram_document(plan, shape=used["shape"], max_running_requests=max_running_requests)
            )
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if output == "json":
        click.echo(json.dumps(documents, indent=2, allow_nan=False))
    else:
        click.echo("\n\n".join(render_vram(doc) for doc in documents))
    if report is not None:
        path = _write_report(report, vram=documents, sweep=None, fleet=None)
        click.echo(f"report: {path}", err=True)
    if not all(doc["fits"] for doc in documents):
        sys.exit(EXIT_DOES_NOT_FIT)


def _progress() -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    """A rich progress bar on a terminal (stderr); nothing when it is piped."""
    from specgov.controller.cli.format import stderr_progress

    update, stop = stderr_progress("sweep", "configurations", enabled=sys.stderr.isatty())
    if update is None:
        return None, stop
    per_task = update
    return (lambda done, total: per_task("sweep", done, total)), stop


def _render_sweep(doc: dict[str, Any]) -> None:
    from rich.console import Console

    # highlight=False: no colouring of the numbers and brackets in the plain lines
    console = (
        Console(width=max(Console().width, 160), highlight=False)
        if sys.stdout.isatty()
        else Console(width=220, highlight=False)
    )
    console.print(_sweep_table(doc))
    trace = doc["trace"]
    if trace.get("load"):
        from specgov.simulator.planning.trace_load import trace_load_text

        console.print(trace_load_text(trace["load"], doc["target_rps"]), soft_wrap=True)
    for gpu, best in doc["best_per_gpu"].items():
        _print_best_on(console, gpu, best, doc)
    if doc["best"] is not None:
        b = doc["best"]
        console.print(
            f"best overall (by {doc['best_by']}): {b['gpu']} {b['drafter']} "
            f"{b['shape']['name']} {b['policy']}"
            f"{' +host ' + str(b['hicache_size_gb']) + ' GB' if b.get('hicache_size_gb') else ''}"
            f", {b['replicas']} replica(s)"
        )
        if doc.get("recommendation"):
            console.print(f"  why: {doc['recommendation']}")


_SWEEP_LEFT_COLUMNS = ("gpu", "drafter", "policy", "reason", "status", "shape")


def _sweep_table(doc: dict[str, Any]) -> Table:
    """One row per swept configuration (with a host-cache column when sizes were swept)."""
    from rich.table import Table

    slo = doc["slo"]
    trace = doc["trace"]
    title = (
        f"{trace['name']}: {trace['requests']} requests, base {trace['base_rps']:.2f} req/s | "
        f"{doc['model']} | SLO TPOT p{slo['tpot_percentile']:g} <= {cell(slo['tpot_ms'], 0)} ms, "
        f"TTFT p{slo['ttft_percentile']:g} <= {cell(slo['ttft_ms'], 0)} ms | "
        f"target {doc['target_rps']:g} req/s | seed {doc['seed']}"
    )
    table = Table(title=title, title_justify="left")
    host_cache = doc.get("host_cache_or_gpus") is not None
    for col in (
        "gpu",
        "drafter",
        "shape",
        "policy",
        *(["host GB"] if host_cache else []),
        "status",
        "max req/s",
        "TPOT ms",
        "TTFT ms",
        "replicas",
        "$/h",
        "$/Mtok",
        "vs none",
        "reason",
    ):
        table.add_column(col, justify="left" if col in _SWEEP_LEFT_COLUMNS else "right")
    for row in doc["configurations"]:
        at = row["at_max"] or {}
        table.add_row(
            row["gpu"],
            row["drafter"],
            row["shape"]["name"],
            row["policy"],
            *([str(row.get("hicache_size_gb") or 0)] if host_cache else []),
            row["status"],
            cell(row["max_rps"], 2),
            cell(at.get("tpot_ms")),
            cell(at.get("ttft_ms"), 0),
            cell(row["replicas"]),
            cell(row["cost_per_hour"], 2),
            cell(row["cost_per_mtok"], 3),
            _vs_none(row),
            (row["reason"] or "")[:80],
        )
    return table


def _vs_none(row: dict[str, Any]) -> str:
    """The "vs none" cell: capacity against the plain server, the cost change, and
    whether speculation pays."""
    saving = row["saving_vs_none"]
    vs = "-"
    if saving is not None:
        vs = f"{saving['capacity_ratio']:.2f}x"
        if saving["cost_fraction"] is not None:
            vs += f" ({100 * saving['cost_fraction']:+.0f}% $)"
    verdict = row.get("speculation")
    if verdict is not None:
        vs += f", pays ({verdict['because']})" if verdict["pays"] else ", saves nothing"
    return vs


def _print_best_on(console: Console, gpu: str, best: dict[str, Any], doc: dict[str, Any]) -> None:
    """The best configuration on one GPU and how to launch it."""
    host = f" +host {best['hicache_size_gb']} GB" if best.get("hicache_size_gb") else ""
    console.print(
        f"best on {gpu}: {best['drafter']} {best['shape']['name']} {best['policy']}{host}, "
        f"{best['replicas']} replica(s) at {best['max_rps']:.2f} req/s each"
    )
    answer = (doc.get("host_cache_or_gpus") or {}).get(gpu)
    if answer is not None:
        console.print(f"  host cache or GPUs: {answer['answer']}")
    if best["launch_shell"] is not None:
        flags = best["launch_shell"] or "(none: no speculation)"
        console.print(f"  sglang flags: {flags}", soft_wrap=True)
    if best["adaptive_config"] is not None:
        console.print(f"  adaptive config: {json.dumps(best['adaptive_config'])}", soft_wrap=True)
    if best["daemon_policy"]:
        console.print(f"  daemon policy: {best['daemon_policy']}")


@plan_group.command(name="sweep")
@opt.trace_source_option
@opt.trace_selection_options
@click.option("--gpus", default="h100", show_default=True, help="Comma-separated GPUs.")
@opt.model_option()
@click.option(
    "--drafters",
    default="eagle3,ngram,none",
    show_default=True,
    help="Comma-separated drafters; the plain server (none) is always swept as the baseline.",
)
@click.option(
    "--policies",
    default="none,static:3,sglang-ema,goodput",
    show_default=True,
    help="Comma-separated policies (none, static:K, sglang-ema, goodput, ...).",
)
@click.option(
    "--shapes",
    default="chain",
    show_default=True,
    help="Comma-separated tree shapes: chain, treeTxD (topk T, D draft tokens).",
)
@opt.spec_steps_option()
@opt.slo_options(ttft_default_ms=opt.DEFAULT_PLAN_SLO_TTFT_MS)
@opt.percentile_option(
    "--tpot-percentile", "The TPOT percentile that must be within --slo-tpot-ms."
)
@opt.percentile_option(
    "--ttft-percentile", "The TTFT percentile that must be within --slo-ttft-ms."
)
@click.option(
    "--target-rps",
    type=click.FloatRange(min=0.0, min_open=True),
    default=40.0,
    show_default=True,
    help="The request rate the fleet must serve.",
)
@click.option(
    "--rel-tol",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True, max_open=True),
    default=0.05,
    show_default=True,
    help="Search stops when the bracket [pass, fail] is this tight (relative).",
)
@click.option(
    "--hicache-sizes",
    default="0",
    show_default=True,
    help="Comma-separated host cache tiers, GB per GPU (SGLang's --enable-hierarchical-cache "
    "--hicache-size N; 0: none). With sizes > 0 every configuration is swept once per size "
    "and the plan says, per GPU, whether to add host cache or GPUs.",
)
@opt.prices_option
@opt.mem_fraction_static_option
@opt.max_running_requests_option
@opt.catalog_option
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Local processes (default: every core).",
)
@click.option(
    "--ray-address",
    default=None,
    help="Ray cluster: 'auto', or ray://HEAD:10001 (default: a local Ray).",
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write each finished job here; jobs already there are not run again.",
)
@opt.report_option("Write the HTML report into this folder.")
@opt.seed_option
@opt.output_option()
def sweep_cmd(
    trace_source: str,
    trace_selection: dict[str, Any],
    gpus: str,
    drafters: str,
    policies: str,
    shapes: str,
    target_rps: float,
    rel_tol: float,
    hicache_sizes: str,
    prices: Path | None,
    catalog: tuple[Path, ...],
    executor: str,
    workers: int | None,
    ray_address: str | None,
    resume_dir: Path | None,
    report: Path | None,
    seed: int,
    output: str,
    **settings_options: Any,
) -> None:
    """Per configuration: the highest rate one replica sustains under the SLO, replicas
    for --target-rps, cost, and the saving of speculation against the plain server."""
    from specgov.simulator.planning.search import SearchSettings
    from specgov.simulator.planning.sweep import SweepSettings
    from specgov.simulator.planning.sweep_document import build_document
    from specgov.simulator.workload.synthetic_text import open_trace

    if ray_address is not None and executor != "ray":
        raise click.UsageError("--ray-address needs --executor ray")
    try:
        trace = open_trace(
            trace_source,
            **trace_selection,
            seed=seed,
        )
        # settings_options: the options named as SweepSettings' fields (--model, the SLO, ...).
        settings = SweepSettings(
            **settings_options,
            seed=seed,
            catalog_files=tuple(str(p) for p in catalog),
            search=SearchSettings(rel_tol=rel_tol),
        )
        jobs, price_table = _sweep_jobs(
            trace,
            settings,
            {"gpus": gpus, "drafters": drafters, "policies": policies, "shapes": shapes},
            hicache_sizes=hicache_sizes,
            prices=prices,
            catalog=catalog,
        )
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    rows, reused = _run_sweep_jobs(
        jobs,
        trace,
        executor=executor,
        workers=workers,
        ray_address=ray_address,
        resume_dir=resume_dir,
    )
    doc = build_document(
        rows,
        trace=trace,
        settings=settings,
        target_rps=target_rps,
        prices=price_table,
        executor={"kind": executor, "workers": workers, "jobs": len(jobs), "reused": reused},
    )
    _emit_sweep(doc, output, report)


def _emit_sweep(doc: dict[str, Any], output: str, report: Path | None) -> None:
    if output == "json":
        click.echo(json.dumps(doc, indent=2, allow_nan=False))
    else:
        _render_sweep(doc)
    if report is not None:
        # The report reads each row's VRAM document from the sweep document itself.
        path = _write_report(report, vram=None, sweep=doc, fleet=None)
        click.echo(f"report: {path}", err=True)


def _sweep_jobs(
    trace: Trace,
    settings: SweepSettings,
    axes: dict[str, str],
    *,
    hicache_sizes: str,
    prices: Path | None,
    catalog: tuple[Path, ...],
) -> tuple[list[JobSpec], Prices | None]:
    """Every configuration to sweep (*axes*: the comma-separated --gpus, --drafters,
    --policies and --shapes) and the prices, checked to cover every swept GPU."""
    from specgov.simulator.catalog import Catalog
    from specgov.simulator.planning.prices import load_prices
    from specgov.simulator.planning.sweep import enumerate_jobs

    cat = Catalog.load(list(catalog))
    cat.model(settings.model)
    jobs = enumerate_jobs(
        gpus=_csv(axes["gpus"]),
        drafters=_csv(axes["drafters"]),
        policies=_csv(axes["policies"]),
        shapes=_csv(axes["shapes"]),
        settings=settings,
        trace=trace,
        hicache_sizes_gb=_sizes_gb(hicache_sizes),
    )
    price_table = load_prices(prices, cat) if prices is not None else None
    if price_table is not None:
        price_table.require(sorted({job.gpu for job in jobs}))
    return jobs, price_table


def _run_sweep_jobs(
    jobs: Sequence[JobSpec],
    trace: Trace,
    *,
    executor: str,
    workers: int | None,
    ray_address: str | None,
    resume_dir: Path | None,
) -> tuple[list[dict[str, Any]], int]:
    """The jobs' rows (and how many were reused from --resume), with a progress bar."""
    from specgov.simulator.planning.executor import ExecutorError, run_jobs

    progress, stop = _progress()
    try:
        return run_jobs(
            jobs,
            trace,
            executor=executor,
            workers=workers,
            ray_address=ray_address,
            results_dir=resume_dir,
            progress=progress,
        )
    except ExecutorError as exc:  # a run failure, not bad input
        raise click.ClickException(str(exc)) from None
    finally:
        stop()


def _register() -> None:
    from specgov.controller.cli.plan_fleet_cmd import fleet_cmd

    plan_group.add_command(fleet_cmd)


_register()
