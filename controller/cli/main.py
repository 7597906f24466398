"""The `specgov` command line.

Simulator commands import `specgov.simulator` lazily (DESIGN.md layering), so the
daemon's commands never pay for numpy/matplotlib start-up they do not use.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specgov.controller.cli import options as opt
from specgov.controller.cli.policy_help import kinds_help
from specgov.simulator.server.cli import hicache_options  # click only at load

if TYPE_CHECKING:
    from specgov.simulator.replay.metrics import Slo
    from specgov.simulator.replay.runner import ReplayReport, ServerSpec
    from specgov.simulator.workload.traces import Trace

DEFAULT_REPLAY_POLICIES = ("none", "static:1", "static:3", "static:5", "static:7", "sglang-ema")
_REPLAY_KINDS = kinds_help(replay=True)


from specgov.controller.cli.format import user_errors  # noqa: E402


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "SPECGOV"}
)
@click.version_option(package_name="specgov")
def main() -> None:
    """specgov: a speculation governor for SGLang."""


def _register_subcommands() -> None:
    # Each command module imports only click at load time; its work is lazy.
    from specgov.controller.cli.catalog_cmd import catalog_group
    from specgov.controller.cli.config_cmd import config_group
    from specgov.controller.cli.daemon_cmds import COMMANDS
    from specgov.controller.cli.demo import demo_cmd
    from specgov.controller.cli.doctor_cmd import doctor_cmd
    from specgov.controller.cli.fit_acceptance_cmd import fit_acceptance_cmd
    from specgov.controller.cli.fleet_cmd import fleet_group
    from specgov.controller.cli.plan_cmd import plan_group
    from specgov.controller.cli.sglang_args_cmd import sglang_args
    from specgov.simulator.server.cli import sim_server_cmd  # imports only click at load

    main.add_command(sglang_args)
    main.add_command(config_group)
    main.add_command(catalog_group)
    for command in COMMANDS:
        main.add_command(command)
    main.add_command(demo_cmd)
    main.add_command(sim_server_cmd)
    main.add_command(plan_group)
    main.add_command(doctor_cmd)
    main.add_command(fit_acceptance_cmd)
    main.add_command(fleet_group)


_register_subcommands()


def _fmt(value: Any, digits: int = 1) -> str:
    from specgov.controller.cli.format import number

    return number(value, digits)


_REPLAY_COLUMNS = (
    "tok/s",
    "goodput tok/s",
    "vs ema",
    "SLO %",
    "TTFT p99 ms",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "ITL p99 ms",
    "acc len",
    "retract",
    "KV peak",
    "switches",
)


def render_table(report: ReplayReport) -> None:
    from rich.console import Console

    from specgov.controller.cli.format import goodput_legend, overload_note, summary_table

    data = report.to_json()
    trace = data["trace"]
    server = data["server"]
    title = (
        f"{trace.get('name', 'trace')}: {trace.get('requests')} requests, "
        f"{_fmt(trace.get('duration_s'))} s | {server['gpu']} {server['model']} "
        f"+ {server['drafter']} ({server['acceptance_profile']}) | "
        f"SLO TPOT {_fmt(data['slo']['tpot_ms'], 0)} ms | seed {data['seed']}"
    )
    base = next((p for p in data["policies"] if p["name"] == "sglang-ema"), None)
    overload = overload_note(data["policies"])
    caption = goodput_legend(data["slo"], baseline=None if base is None else "sglang-ema")
    caption += " Rates and latencies are in simulated time."
    table = summary_table(
        data["policies"],
        base,
        name_header="policy",
        columns=_REPLAY_COLUMNS,
        title=title,
        caption=caption,
    )
    # Never squeeze the columns into ellipses: a narrow terminal wraps instead,
    # and piped output (no width) gets a wide line.
    console = (
        Console(width=max(Console().width, 150)) if sys.stdout.isatty() else Console(width=200)
    )
    if overload is not None:
        # Before the table: the ratios below compare runs that mostly failed the SLO.
        console.print(overload, style="bold red", markup=False, highlight=False)
    console.print(table)


def _stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def _progress_factory() -> tuple[Callable[[str, int, int], None] | None, Callable[[], None]]:
    """A progress bar per policy on stderr when it is a terminal (whatever --output:
    JSON goes to stdout); nothing when stderr is piped or captured."""
    from specgov.controller.cli.format import stderr_progress

    return stderr_progress(
        "replaying {task.description}", "requests", enabled=_stderr_is_terminal()
    )


def _run_replay(
    trace: Trace,
    server: ServerSpec,
    policies: Sequence[str],
    *,
    slo: Slo,
    seed: int,
    concurrency: int | None,
) -> ReplayReport:
    """Every policy on *trace*, with a progress bar, and each daemon policy's restart
    recommendation from what its daemon saw (the restart loop's replay)."""
    from specgov.simulator.replay.runner import replay

    progress, stop = _progress_factory()
    try:
        report = replay(
            trace,
            server,
            list(policies),
            slo=slo,
            seed=seed,
            progress=progress,
            concurrency=concurrency,
        )
    finally:
        stop()
    if any(run.policy.daemon_spec is not None for run in report.runs):
        # Into the summaries and the JSON (controller.recommend).
        from specgov.controller.daemon.replay_check import replay_restart_check

        replay_restart_check(
            report.runs,
            trace.requests,
            gpu=server.gpu,
            model=server.model,
            drafter=server.drafter,
            slo_tpot_ms=report.slo.tpot_ms,
            seed=seed,
            topk=server.topk,
            num_draft_tokens=server.num_draft_tokens,
        )
    return report


def _write_plots(report: ReplayReport, plot: Path, slo_tpot_ms: float | None) -> None:
    from specgov.simulator.replay.plots import write_plots

    server_info = report.server
    context = (
        f"{server_info['gpu']} {server_info['model']} + {server_info['drafter']}, "
        f"{report.trace.get('requests')} requests of {report.trace.get('name', 'trace')}"
    )
    try:
        written = write_plots(
            [(r.policy.name, r.result.series) for r in report.runs],
            plot,
            slo_tpot_ms=slo_tpot_ms,
            context=context,
        )
    except OSError as exc:  # the replay ran; the folder is the problem
        raise click.ClickException(f"--plot {plot}: cannot write: {exc}") from None
    click.echo(f"plots: {', '.join(str(p) for p in written)}", err=True)


_with_server_options = opt.compose(
    opt.gpu_option(),
    opt.model_option(),
    opt.drafter_option(),
    opt.spec_steps_option(),
    opt.topk_option("--speculative-eagle-topk: 1 is a chain; more is a tree (no adaptive steps)."),
    opt.num_draft_tokens_option(min_tokens=1),
    opt.acceptance_profile_option,
    click.option(
        "--burstiness",
        type=click.FloatRange(min=0.0, max=1.0),
        default=None,
        help="Acceptance burstiness of per-verify rates (0 = i.i.d. draws); domains "
        "with all-position rates are sampled per token (see --catalog profiles).",
    ),
    click.option(
        "--skip-zero-step-draft-extend",
        is_flag=True,
        default=False,
        help="Simulate SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1: steps 0 skip the "
        "draft-extend pass, upshifts draft cold.",
    ),
    click.option(
        "--no-prefix-cache",
        is_flag=True,
        default=False,
        help="SGLang's --disable-radix-cache: no prefix reuse. By default requests whose "
        "trace gives hash_ids (prefix block ids) reuse cached prompt prefixes.",
    ),
    opt.max_running_requests_option,
    opt.mem_fraction_static_option,
    opt.catalog_option,
    opt.slo_options(ttft_default_ms=None),
    opt.seed_option,
    opt.output_option(),
    click.option(
        "--plot",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Write PNG figures into this folder: per policy (load, steps per slot, "
        "throughput, TPOT with the SLO) and a comparison.",
    ),
)


@main.command()
@click.argument("trace")
@opt.trace_selection_options
@click.option(
    "--policy",
    "policies",
    multiple=True,
    help=f"Policy to replay, repeatable: {_REPLAY_KINDS}. "
    f"Default: {' '.join(DEFAULT_REPLAY_POLICIES)}. See `specgov policy list`.",
)
@click.option(
    "--rate-scale",
    type=click.FloatRange(min=0.0, min_open=True),
    default=1.0,
    show_default=True,
    help="Multiply the arrival rate (2 = arrivals twice as dense).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Replay as N closed-loop users (each sends its next request when answered).",
)
@click.option(
    "--prior-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Daemon policies' step-cost prior believes every step costs this many times "
    "what the simulated GPU takes (a wrong prior on purpose; the truth is unchanged).",
)
@click.option(
    "--prior-gpu",
    default=None,
    help="Build the daemon policies' step-cost prior for this catalog GPU instead of "
    "--gpu (same model and drafter): a wrong knee, not only a wrong scale.",
)
@_with_server_options
@hicache_options
def replay(
    trace: str,
    trace_selection: dict[str, Any],
    policies: tuple[str, ...],
    rate_scale: float,
    concurrency: int | None,
    slo_tpot_ms: float,
    slo_ttft_ms: float | None,
    seed: int,
    output: str,
    plot: Path | None,
    **server_options: Any,
) -> None:
    """Replay TRACE (a file, or `synthetic[:key=value,...]`) once per --policy."""
    from specgov.simulator.replay.metrics import Slo

    with user_errors():
        from specgov.simulator.workload.synthetic_text import open_trace

        loaded = open_trace(
            trace,
            **trace_selection,
            rate_scale=rate_scale,
            seed=seed,
        )
        report = _run_replay(
            loaded,
            opt.server_spec(server_options),
            policies or DEFAULT_REPLAY_POLICIES,
            slo=Slo(tpot_ms=slo_tpot_ms, ttft_ms=slo_ttft_ms),
            seed=seed,
            concurrency=concurrency,
        )
        if plot is not None:
            _write_plots(report, plot, slo_tpot_ms)
        if output == "json":
            click.echo(json.dumps(report.to_json(), indent=2, allow_nan=False))
        else:
            render_table(report)


if __name__ == "__main__":  # pragma: no cover
    main()
