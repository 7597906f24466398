"""`specgov plan fleet`: N replicas behind a router on one trace, speculative and plain mixed.

The simulator is imported inside the command (DESIGN.md layering: the CLI loads
click only). The work is ``specgov.simulator.planning.fleet.plan_fleet``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specgov.controller.cli import options as opt
from specgov.controller.cli.format import cell, user_errors

if TYPE_CHECKING:
    from specgov.simulator.planning.fleet_spec import FleetPlanConfig
    from specgov.simulator.replay.metrics import Slo

DEFAULT_ROUTERS = "round-robin,least-loaded,spec-aware"


def _split(values: Sequence[str]) -> list[str]:
    """Repeatable options that also take comma-separated lists."""
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def _progress() -> tuple[Callable[[str, int, int], None] | None, Callable[[], None]]:
    """A rich progress bar on a terminal; nothing when stderr is piped."""
    from specgov.controller.cli.format import stderr_progress

    return stderr_progress("{task.description}", "requests routed", enabled=sys.stderr.isatty())


def render_table(doc: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    trace = doc["trace"]
    server = doc["server"]
    slo = doc["slo"]
    pct = f"p{slo['percentile']:g}"
    currency = (doc.get("prices") or {}).get("currency", "cost")
    title = (
        f"{trace.get('name')}: {trace.get('requests')} requests at "
        f"{cell(doc.get('offered_rps'), 2)} req/s | {server['gpu']} {server['model']} + "
        f"{server['drafter']} | SLO TPOT {cell(slo['tpot_ms'], 0)} ms, TTFT "
        f"{cell(slo['ttft_ms'], 0)} ms at {pct} | seed {doc['seed']}"
    )
    table = Table(title=title, title_justify="left")
    cols = [
        "fleet",
        "policy",
        "router",
        "goodput tok/s",
        "SLO %",
        f"TPOT {pct} ms",
        f"TTFT {pct} ms",
        "holds",
        "GPUs",
        f"{currency}/h",
        f"{currency}/Mtok",
    ]
    for col in cols:
        table.add_column(col, justify="left" if col in ("fleet", "policy", "router") else "right")
    best = doc.get("best") or {}
    for row in doc["fleets"]:
        if not row.get("fits") or row.get("reason"):
            table.add_row(
                row["fleet"], cell(row["policy"]), row["router"], f"- ({row.get('reason')})"
            )
            continue
        att = row.get("slo_attainment")
        mark = (
            " *"
            if (row["fleet"], row["policy"], row["router"])
            == (best.get("fleet"), best.get("policy"), best.get("router"))
            else ""
        )
        router = row["router"] + (
            f" (as {row['routes_as']})" if row["routes_as"] != row["router"] else ""
        )
        table.add_row(
            row["fleet"] + mark,
            cell(row["policy"] or "-"),
            router,
            cell(row.get("goodput_tok_s"), 0),
            cell(100.0 * att if att is not None else None),
            cell(row.get("slo_tpot_at_percentile_ms")),
            cell(row.get("slo_ttft_at_percentile_ms"), 0),
            cell(row.get("meets_slo")),
            str(row["gpus"]),
            cell(row.get("cost_per_hour"), 2),
            cell(row.get("cost_per_mtok"), 3),
        )
    console = Console()
    if not console.is_terminal:
        # Piped or captured: no width to fit, so do not squeeze the columns to 80.
        console = Console(width=170)
    console.print(table)
    if trace.get("load"):
        from specgov.simulator.planning.trace_load import trace_load_text

        console.print(trace_load_text(trace["load"]), soft_wrap=True)
    console.print(doc["recommendation"])


@click.command(name="fleet")
@opt.trace_source_option
@opt.trace_selection_options
@click.option(
    "--rate-scale",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="Multiply the trace's request rate (exclusive with --target-rps).",
)
@click.option(
    "--target-rps",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="Scale the trace so the fleet receives this many requests per second on average.",
)
@opt.gpu_option()
@opt.model_option()
@opt.drafter_option("Speculative replicas' drafter.")
@opt.spec_steps_option(
    min_steps=1,
    help="--speculative-num-steps of speculative replicas (adaptive policies start there).",
)
@opt.acceptance_profile_option
@opt.max_running_requests_option
@opt.mem_fraction_static_option
@opt.catalog_option
@click.option(
    "--replicas",
    "replicas_text",
    default=None,
    help="Fleet sizes: 4, 2,4,8 or 1-6. Each size gives its all-speculative and all-plain "
    "fleets (and every mix, unless --mix says otherwise).",
)
@click.option(
    "--mix",
    "mixes",
    multiple=True,
    help="Mixed fleets n+m (n speculative, m plain), repeatable or comma-separated; 'all' "
    "(the default with --replicas): every split of each --replicas size; 'none': no mixes.",
)
@click.option(
    "--policies",
    "policies",
    multiple=True,
    help="Speculative replicas' policies (replay's specs: static:K, sglang-ema, goodput, "
    "...), repeatable or comma-separated. Default: sglang-ema.",
)
@click.option(
    "--routers",
    "routers_text",
    default=DEFAULT_ROUTERS,
    show_default=True,
    help="Comma-separated: round-robin, least-loaded, spec-aware[:B] (B: speculative "
    "replicas' active-request bound; default computed from the cost model).",
)
@opt.slo_options(ttft_default_ms=opt.DEFAULT_PLAN_SLO_TTFT_MS)
@opt.percentile_option(
    "--slo-percentile",
    "A fleet holds the SLO when this percentile of TPOT and of TTFT are within it.",
)
@opt.prices_option
@opt.seed_option
@opt.report_option(
    "Write an offline HTML report (figures as PNG, data as CSV/JSON) into this folder."
)
@opt.output_option()
def fleet_cmd(
    trace_source: str,
    trace_selection: dict[str, Any],
    rate_scale: float | None,
    target_rps: float | None,
    replicas_text: str | None,
    mixes: tuple[str, ...],
    policies: tuple[str, ...],
    routers_text: str,
    slo_tpot_ms: float,
    slo_ttft_ms: float,
    slo_percentile: float,
    prices: Path | None,
    seed: int,
    report: Path | None,
    output: str,
    **server_options: Any,
) -> None:
    """Simulate fleets of speculative and plain replicas behind routers on one trace.

    Every fleet replays the same trace (scaled to --target-rps) through N simulated
    SGLang servers behind a router; the plan ranks them by cost (or GPUs) among
    those that hold the SLO and says which to run.

    \b
    Example:
      specgov plan fleet --trace AzureLLMInferenceTrace_conv.csv --target-rps 30 \\
        --replicas 2-4 --routers least-loaded,spec-aware --prices prices.yaml
    """
    if rate_scale is not None and target_rps is not None:
        raise click.UsageError("--rate-scale and --target-rps both set the rate: give one")
    if replicas_text is None and not _split(mixes):
        raise click.UsageError("give --replicas (e.g. 4 or 1-6) and/or --mix n+m")
    from specgov.simulator.planning.fleet import plan_fleet
    from specgov.simulator.replay.metrics import Slo
    from specgov.simulator.workload.synthetic_text import open_trace

    with user_errors():
        cfg = _plan_config(
            replicas_text,
            mixes,
            policies,
            routers_text,
            prices,
            server_options,
            slo=Slo(tpot_ms=slo_tpot_ms, ttft_ms=slo_ttft_ms),
            slo_percentile=slo_percentile,
            seed=seed,
        )
        server = opt.server_spec(server_options)
        trace = open_trace(
            trace_source,
            **trace_selection,
            rate_scale=rate_scale if rate_scale is not None else 1.0,
            seed=seed,
        )
        progress, stop = _progress() if output == "table" else (None, lambda: None)
        try:
            doc = plan_fleet(trace, server, cfg, target_rps=target_rps, progress=progress)
        finally:
            stop()
        if report is not None:
            from specgov.simulator.planning.report import write_report

            index = write_report(report, vram=None, sweep=None, fleet=doc)
            doc["report"] = str(index)
            if output == "table":
                click.echo(f"report: {index}", err=True)
    if output == "json":
        click.echo(json.dumps(doc, indent=2, allow_nan=False))
    else:
        render_table(doc)


def _plan_config(
    replicas_text: str | None,
    mixes: Sequence[str],
    policies: Sequence[str],
    routers_text: str,
    prices: Path | None,
    server_options: Mapping[str, Any],
    *,
    slo: Slo,
    slo_percentile: float,
    seed: int,
) -> FleetPlanConfig:
    """The fleets, routers, policies and prices to plan with (prices checked against
    --gpu before any simulation)."""
    from specgov.simulator.catalog import Catalog
    from specgov.simulator.planning.fleet_spec import (
        FleetPlanConfig,
        enumerate_fleets,
        parse_replicas,
    )
    from specgov.simulator.planning.prices import load_prices
    from specgov.simulator.planning.router import parse_routers

    sizes = parse_replicas(replicas_text) if replicas_text is not None else ()
    mix_list = _split(mixes)
    if not mix_list and sizes:
        mix_list = ["all"]
    mix_list = [m for m in mix_list if m.lower() != "none"]
    price_table = None
    fleets = enumerate_fleets(sizes, mix_list)
    routers = parse_routers(routers_text)
    if prices is not None:
        cat = Catalog.load(server_options["catalog"])
        price_table = load_prices(prices, cat)
        price_table.require([cat.gpu(server_options["gpu"]).name])
    return FleetPlanConfig(
        fleets=fleets,
        routers=routers,
        policies=tuple(_split(policies)) or ("sglang-ema",),
        slo=slo,
        slo_percentile=slo_percentile,
        seed=seed,
        prices=price_table,
    )
