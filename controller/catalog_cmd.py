"""`specgov catalog list`: the GPUs, target models and drafters the simulator knows.

Offline (no daemon): the names are what `specgov replay --gpu/--model/--drafter` and
the deployment section of the config take. The simulator's catalog is imported inside
the command (DESIGN.md layering).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click


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
    from specgov.controller.cli_format import number

    if not d["params_b"] and not any(d["params_b_by_target"].values()):
        return "none (no network)"
    size = number(d["params_b"], 2, "B")
    per = ", ".join(f"{t}: {number(v, 2, 'B')}" for t, v in d["params_b_by_target"].items())
    return f"{size} ({per})" if per else size


@click.group("catalog")
def catalog_group() -> None:
    """The simulator's catalog of GPUs, models and drafters (offline)."""


@catalog_group.command("list")
@click.option(
    "--catalog",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    multiple=True,
    help="Extra catalog YAML file (GPUs, models, drafters); repeatable, later names win.",
)
@click.option(
    "--output",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="Tables for people, or JSON for scripts.",
)
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

    from specgov.controller.cli_format import number

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
    for col in ("name", "parameters", "weights", "KV per token", "SGLang auto shape", "aliases"):
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
