"""Click options that more than one command takes: one declaration each, so the same
option has the same type, range, default and help text in every command.

Where a command's option means more (or less) than the shared one, the declaration takes
the difference as an argument instead of being written again: its help (``--output``
says what the command's JSON is, ``--gpu`` what the GPU is for), its range
(``--spec-steps``: plan fleet's speculative replicas need >= 1; ``--num-draft-tokens``)
or, for the SLO, ``--slo-ttft-ms``'s default (replay judges TPOT alone unless asked, the
plans size a fleet against both), or, for an SLO percentile, its flag (plan sweep has one
for TPOT and one for TTFT, plan fleet one for both). Options whose meaning differs between
the commands stay with their command: replay's positional TRACE (the plans take
``--trace``) and ``--rate-scale`` (plan fleet's is exclusive with ``--target-rps``).

``server_spec`` turns the server options a command passes through into the simulated
server (ServerSpec), naming the fields the flags rename in one place; ``load_config_file``
loads the daemon configuration ``--config`` names, a bad file one line and exit 2.

``--gpu``, ``--model``, ``--drafter`` and ``--spec-steps`` are declared beside
``sim-server``, which takes them too (:mod:`specgov.simulator.server.cli`: the simulator may
not import the controller), and handed on from here.

Importing this module imports click only, with the sim-server's command module (which
imports click only): the CLI's start-up stays light.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

# The simulated deployment's options that sim-server takes too (the module docstring).
from specgov.simulator.server.cli import drafter_option as drafter_option
from specgov.simulator.server.cli import gpu_option as gpu_option
from specgov.simulator.server.cli import model_option as model_option
from specgov.simulator.server.cli import spec_steps_option as spec_steps_option

if TYPE_CHECKING:
    from specgov.controller.daemon.config import SpecgovConfig
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

_trace_selection_stack = compose(
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

# The trace-selection options' parameters: open_trace's keyword arguments by name.
_TRACE_SELECTION = ("fmt", "window_start_s", "window_end_s", "sample", "max_requests")


def trace_selection_options(fn: F) -> F:
    """``--format``, the window, ``--sample`` and ``--max-requests``, given to the command
    as one keyword, ``trace_selection``: open_trace's keyword arguments (``**`` them)."""

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        kwargs["trace_selection"] = {name: kwargs.pop(name) for name in _TRACE_SELECTION}
        return fn(**kwargs)

    return _trace_selection_stack(cast(F, command))


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


def percentile_option(name: str, help: str) -> Callable[[F], F]:
    """A plan's SLO percentile (in (0, 100], default 99): *name* is the flag."""
    return click.option(
        name,
        type=click.FloatRange(min=0.0, max=100.0, min_open=True),
        default=99.0,
        show_default=True,
        help=help,
    )


# ---------------------------------------------------- the simulated deployment


def topk_option(
    help: str = "--speculative-eagle-topk: 1 is a chain; more is a tree.",
) -> Callable[[F], F]:
    """``--topk`` (default 1, a chain)."""
    return click.option(
        "--topk", type=click.IntRange(min=1), default=1, show_default=True, help=help
    )


def num_draft_tokens_option(*, min_tokens: int) -> Callable[[F], F]:
    """``--num-draft-tokens`` (no default: a chain's is steps + 1), at least *min_tokens*."""
    return click.option(
        "--num-draft-tokens",
        type=click.IntRange(min=min_tokens),
        default=None,
        help="Tree verify width (topk > 1); chains use steps + 1.",
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
    help="Extra catalog YAML file (GPUs, models, drafters); repeatable, later names win.",
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


def output_option(
    help: str = "A table for people, or one JSON object for scripts (see the README).",
) -> Callable[[F], F]:
    """``--output table|json`` (default table); *help* says what the command's JSON is."""
    return click.option(
        "--output",
        type=click.Choice(["table", "json"]),
        default="table",
        show_default=True,
        help=help,
    )


def report_option(help: str) -> Callable[[F], F]:
    """``--report DIR``: the plans' offline HTML report (none by default)."""
    return click.option(
        "--report", type=click.Path(file_okay=False, path_type=Path), default=None, help=help
    )


# ----------------------------------------------------- the daemon's configuration


def config_option(
    help: str = "Config file (default: the packaged defaults, as in config.yaml).",
) -> Callable[[F], F]:
    """``--config FILE`` (as ``config_file``; none: the packaged defaults)."""
    return click.option(
        "--config", "config_file", type=click.Path(path_type=Path), default=None, help=help
    )


def load_config_file(
    config_file: Path | None, overrides: Mapping[str, Any] | None = None
) -> SpecgovConfig:
    """The daemon configuration from *config_file* (None: the packaged defaults), the
    environment and *overrides* (config keys); an invalid or unreadable file is one line
    on stderr naming it and exit 2 (BadInput)."""
    from specgov.controller.cli.format import BadInput
    from specgov.controller.daemon.config import load_config
    from specgov.controller.daemon.config_values import ConfigError

    try:
        return load_config(config_file, overrides=overrides or {})
    except ConfigError as exc:
        raise BadInput(str(exc)) from None
    except OSError as exc:
        raise BadInput(f"cannot read config {config_file}: {exc}") from None


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
