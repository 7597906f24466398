"""Click options that replay, plan sweep and plan fleet share: one declaration each, so
the same option has the same type, range, default and help text in every command.

Options whose meaning differs between the commands stay with their command: replay's
positional TRACE (the plans take ``--trace``), ``--rate-scale`` (plan fleet's is
exclusive with ``--target-rps``), ``--spec-steps`` (plan fleet's replicas need >= 1) and
the plans' SLO percentiles. Only ``--slo-ttft-ms``'s default is the command's to choose:
replay judges TPOT alone unless asked, the plans size a fleet against both.

``server_spec`` turns the server options a command passes through into the simulated
server (ServerSpec), naming the fields the flags rename in one place.

Importing this module imports click only (the CLI's start-up stays light).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from specgov.simulator.replay.runner import ServerSpec

F = TypeVar("F", bound=Callable[..., Any])

TRACE_FORMATS = ("azure", "mooncake", "generic", "acceptance")
DEFAULT_SLO_TPOT_MS = 50.0
# A fleet is sized against TTFT as well as TPOT (plan sweep and plan fleet).
DEFAULT_PLAN_SLO_TTFT_MS = 2000.0


def compose(*options: Callable[[F], F]) -> Callable[[F], F]:
    """One decorator applying *options* in the order given (the first is listed first)."""

    def apply(fn: F) -> F:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


# ------------------------------------------------------------------- the trace

trace_source_option = click.option(
    "--trace",
    "trace_source",
    required=True,
    help="Trace file (azure, mooncake, generic CSV/JSONL), or synthetic[:key=value,...].",
)

trace_selection_options = compose(
    click.option(
        "--format",
        "fmt",
        type=click.Choice(TRACE_FORMATS),
        default=None,
        help="Trace format (default: detected from the file).",
    ),
    click.option(
        "--window-start-s",
        type=click.FloatRange(min=0.0),
        default=None,
        help="Replay only arrivals from this many seconds into the trace.",
    ),
    click.option(
        "--window-end-s",
        type=click.FloatRange(min=0.0),
        default=None,
        help="Replay only arrivals before this many seconds into the trace.",
    ),
    click.option(
        "--sample",
        type=click.FloatRange(min=0.0, max=1.0, min_open=True),
        default=None,
        help="Keep this fraction of the requests, drawn with --seed.",
    ),
    click.option(
        "--max-requests",
        type=click.IntRange(min=1),
        default=None,
        help="Replay at most the first N requests (after the window).",
    ),
)

# --------------------------------------------------------------------- the SLO


def slo_options(*, ttft_default_ms: float | None) -> Callable[[F], F]:
    """``--slo-tpot-ms`` and ``--slo-ttft-ms`` (None: no TTFT SLO unless given)."""
    ttft_help = "SLO on time to first token (ms), in addition to TPOT"
    return compose(
        click.option(
            "--slo-tpot-ms",
            type=click.FloatRange(min=0.0, min_open=True),
            default=DEFAULT_SLO_TPOT_MS,
            show_default=True,
            help="SLO on each request's time per output token (ms); goodput counts the "
            "requests within it.",
        ),
        click.option(
            "--slo-ttft-ms",
            type=click.FloatRange(min=0.0, min_open=True),
            default=ttft_default_ms,
            show_default=ttft_default_ms is not None,
            help=ttft_help + (" (default: none)." if ttft_default_ms is None else "."),
        ),
    )


# ---------------------------------------------------- the simulated deployment

gpu_option = click.option(
    "--gpu", default="h100", show_default=True, help="GPU name from the catalog."
)
model_option = click.option(
    "--model", default="llama-3.1-8b", show_default=True, help="Target model."
)
acceptance_profile_option = click.option(
    "--acceptance-profile",
    default=None,
    help="Acceptance profile (default: the drafter's), e.g. ngram.",
)
max_running_requests_option = click.option(
    "--max-running-requests",
    type=click.IntRange(min=1),
    default=None,
    help="SGLang's --max-running-requests (default: SGLang's, from the KV pool size).",
)
mem_fraction_static_option = click.option(
    "--mem-fraction-static",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True),
    default=None,
    help="SGLang's --mem-fraction-static: the share of GPU memory for weights and KV "
    "(default: SGLang's rule).",
)
catalog_option = click.option(
    "--catalog",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    multiple=True,
    help="Extra catalog YAML file (GPUs, models, drafters); repeatable.",
)
prices_option = click.option(
    "--prices",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="YAML prices ('gpu_hour: {h100: 2.49, ...}', optional 'currency: USD'): "
    "configurations are then ranked by cost instead of GPU count.",
)

# ------------------------------------------------------------- run and output

seed_option = click.option(
    "--seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of every random draw (acceptance, sampling, synthetic traces).",
)
output_option = click.option(
    "--output",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="A table for people, or one JSON object for scripts (see the README).",
)


# ----------------------------------------------------- options to a ServerSpec

# Server options that are ServerSpec fields under another name (SGLang's flag names).
_SPEC_FIELD = {
    "catalog": "catalog_files",
    "enable_hierarchical_cache": "hierarchical_cache",
    "hicache_size": "hicache_size_gb",
}


def server_spec(options: Mapping[str, Any]) -> ServerSpec:
    """The simulated server a command's server options describe (every other key is a
    ServerSpec field by its own name); a bad value is a usage error (exit 2)."""
    from specgov.simulator.engine.prefix_cache import HicacheError
    from specgov.simulator.priors import PriorOptionError
    from specgov.simulator.replay.runner import ServerSpec

    fields = {_SPEC_FIELD.get(k, k): v for k, v in options.items() if k != "no_prefix_cache"}
    if "catalog_files" in fields:
        fields["catalog_files"] = tuple(fields["catalog_files"])
    if "no_prefix_cache" in options:
        fields["prefix_cache"] = not options["no_prefix_cache"]
    try:
        return ServerSpec(**fields)
    except (PriorOptionError, HicacheError) as exc:
        raise click.UsageError(str(exc)) from None
