"""``specgov sim-server``: the simulated SGLang server from the command line.

The one command-line definition of the simulated server: ``specgov sim-server``
registers :func:`sim_server_cmd`, and ``python -m specgov.simulator.server.cli`` runs the
same command. :func:`serve` (start, block until SIGINT/SIGTERM, stop) and
:func:`load_trace_arg` (the ``--trace`` forms) are its pieces, for callers that hold a
:class:`~specgov.simulator.server.core.SimServer` themselves.

Only click is imported at load time (``specgov``'s other commands load this module to
register it); the simulator is imported when the command runs. The option defaults
repeat :class:`~specgov.simulator.replay.runner.ServerSpec`'s for that reason, and
``tests/test_sim_server.py`` checks that they agree.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, TypeVar

import click

if TYPE_CHECKING:
    from specgov.simulator.server.core import SimServer
    from specgov.simulator.workload.traces import Request, Trace

DEFAULT_PORT: Final = 30000  # SGLang's default --port
DEFAULT_TRACE: Final = "synthetic:demo"
F = TypeVar("F", bound=Callable[..., Any])


# SGLang's hierarchical cache (HiCache) flags, as SGLang 0.5.23 names them; `replay` and
# `sim-server` share them (ServerSpec.hierarchical_cache / hicache_ratio / hicache_size_gb);
# declared here because the simulator may not import the controller's options.
def hicache_options(fn: F) -> F:
    """Add --enable-hierarchical-cache, --hicache-ratio and --hicache-size to *fn*."""
    for option in reversed(_HICACHE_OPTIONS):
        fn = option(fn)
    return fn


_HICACHE_OPTIONS = [
    click.option(
        "--enable-hierarchical-cache",
        is_flag=True,
        default=False,
        help="SGLang's --enable-hierarchical-cache: prefix blocks evicted from the KV pool "
        "stay in host memory and are loaded back over PCIe (the catalog's pcie_gb_s) "
        "instead of recomputed.",
    ),
    click.option(
        "--hicache-ratio",
        type=click.FloatRange(min=0.0, min_open=True),
        default=None,
        help="Host tier size as a multiple of the KV pool's tokens (SGLang's default 2.0 "
        "when neither this nor --hicache-size is given).",
    ),
    click.option(
        "--hicache-size",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Host tier size in GB (1e9 bytes) per GPU; > 0 wins over --hicache-ratio, "
        "as in SGLang.",
    ),
]

NO_TRACE: Final = "none"  # --trace none: the engine serves only clients' requests
# --speculative-algorithm NONE: SGLang's own name (SpeculativeAlgorithm.from_string) for
# the plain server it runs when the flag is left out.
PLAIN_ALGORITHM: Final = "NONE"


# The simulated deployment's options (ServerSpec's gpu, model, drafter and spec_steps),
# which `sim-server` shares with `replay`, the plans, `catalog show` and `fleet` (the
# controller's options module hands them on); declared here, as the HiCache flags are,
# because the simulator may not import the controller. Each command's *help* says what
# the option is for there.
def gpu_option(help: str = "GPU name from the catalog.") -> Callable[[F], F]:
    """``--gpu`` (default h100); *help* where the command says what the GPU is for."""
    return click.option("--gpu", default="h100", show_default=True, help=help)


def model_option(help: str = "Target model.") -> Callable[[F], F]:
    """``--model`` (default llama-3.1-8b)."""
    return click.option("--model", default="llama-3.1-8b", show_default=True, help=help)


def drafter_option(help: str = "Drafter.") -> Callable[[F], F]:
    """``--drafter`` (default eagle3)."""
    return click.option("--drafter", default="eagle3", show_default=True, help=help)


def spec_steps_option(
    *,
    min_steps: int = 0,
    help: str = "--speculative-num-steps (the initial step of adaptive policies).",
) -> Callable[[F], F]:
    """``--spec-steps`` (default 3, at least *min_steps*)."""
    return click.option(
        "--spec-steps",
        type=click.IntRange(min=min_steps),
        default=3,
        show_default=True,
        help=help,
    )


def serve(
    sim: SimServer,
    *,
    on_ready: Callable[[SimServer], None] | None = None,
    stop_event: threading.Event | None = None,
    ready_timeout_s: float = 60.0,
    startup_wall_s: float = 0.0,
) -> int:
    """Start ``sim`` and block until SIGINT / SIGTERM (or ``stop_event``), then stop it
    cleanly. Signal handlers are installed only on the main thread and restored after.
    ``startup_wall_s``: wall seconds to wait before the port opens, as SGLang's HTTP
    server listens only once the model is loaded and its CUDA graphs captured (a signal
    during the wait ends it). Returns the exit status (0)."""
    stop = stop_event if stop_event is not None else threading.Event()
    previous: dict[signal.Signals, Any] = {}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        if startup_wall_s > 0 and stop.wait(startup_wall_s):
            return 0
        sim.start()
        sim.wait_ready(ready_timeout_s)
        if on_ready is not None:
            on_ready(sim)
        while not stop.wait(0.25):
            pass
    finally:
        sim.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


STARTUP_FROM_CATALOG: Final = "catalog"


def process_age_s() -> float | None:
    """Seconds since this process was started (Linux: ``/proc``); None where it cannot be
    read (the start-up then counts from the call)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        # Fields after "pid (comm) ": state is the first; starttime (field 22) the 20th.
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        ticks_per_s = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime_s - start_ticks / ticks_per_s)


def startup_seconds(text: str, model: str, catalog_files: tuple[Path, ...] = ()) -> float:
    """``--startup-s``: simulated seconds of a server start-up (model load and CUDA graph
    capture), a number >= 0 or ``catalog`` (the model entry's ``startup_s``, with its
    source in the catalog)."""
    if text.strip().lower() == STARTUP_FROM_CATALOG:
        # Imported only here: a heavy import (measured 4.3 s on a loaded 2-core machine)
        # that a restart command given seconds should not wait for.
        from specgov.simulator.catalog import Catalog

        found = Catalog.load(catalog_files).model(model).startup_s
        if found is None:
            raise click.BadParameter(
                f"the catalog entry of model {model!r} gives no startup_s; give seconds",
                param_hint="--startup-s",
            )
        return found
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise click.BadParameter(
            f"expected seconds >= 0 or {STARTUP_FROM_CATALOG!r}, got {text!r}",
            param_hint="--startup-s",
        )
    return value


def load_trace_arg(text: str, *, seed: int = 0) -> Trace:
    """``synthetic[:...]`` (see specgov.simulator.workload.synthetic_text) or a trace file path."""
    from specgov.simulator.workload.synthetic import generate_trace
    from specgov.simulator.workload.synthetic_text import parse_synthetic_spec
    from specgov.simulator.workload.trace_files import load_trace

    if text == "synthetic" or text.startswith("synthetic:"):
        return generate_trace(parse_synthetic_spec(text))
    return load_trace(Path(text), seed=seed)


def _startup_wall_left_s(startup_s: float, speed: float) -> float:
    """Wall seconds of simulated start-up still to wait, said on stdout."""
    wall_s = startup_s / speed
    # The start-up a real server reports (model load, CUDA graphs) counts from its launch,
    # this process's own start (imports, the trace) included: a busy machine must not add
    # to it (measured: restarts of 90-150 s for a 60 s start-up at --speed 8).
    age_s = process_age_s()
    left_s = wall_s if age_s is None else max(0.0, wall_s - age_s)
    if startup_s > 0:
        spent = "" if age_s is None else f", {min(age_s, wall_s):.1f} s of it starting this process"
        click.echo(f"starting: {startup_s:g} s of simulated start-up ({wall_s:.1f} s wall{spent})")
        if age_s is not None and age_s > wall_s:
            click.echo(
                f"warning: this process took {age_s:.1f} s to start, longer than the "
                f"simulated start-up's {wall_s:.1f} s of wall time; it lasts that long"
            )
    return left_s


@click.command("sim-server")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="Port to listen on (0: a free one, printed when ready).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--spool-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Run specgov's in-engine plugin on this spool (default: SGLang's own EMA).",
)
@click.option(
    "--trace",
    default=DEFAULT_TRACE,
    show_default=True,
    help="A trace file, synthetic[:key=value,...], or none: only the requests clients "
    "send (/generate, /v1/completions, /v1/chat/completions).",
)
@click.option(
    "--speed",
    type=click.FloatRange(min=0.0, min_open=True),
    default=1.0,
    show_default=True,
    help="Simulated seconds per wall second.",
)
@click.option("--loop", "loop_trace", is_flag=True, help="Replay the trace forever.")
@gpu_option("GPU of the simulator's catalog.")
@model_option("Target model of the catalog.")
@drafter_option("Draft model or method of the catalog.")
@click.option(
    "--speculative-algorithm",
    default=None,
    metavar="NAME",
    help="SGLang's --speculative-algorithm: NONE runs a plain server (no drafter, no "
    "draft-extend or verify, a larger KV pool), as SGLang launched without the flag; "
    "otherwise it must be the drafter's (default: the drafter's, speculative).",
)
@spec_steps_option(
    min_steps=1, help="SGLang's --speculative-num-steps (the initial step of adaptive speculation)."
)
@click.option(
    "--acceptance-profile", default=None, help="Acceptance profile (default: the drafter's)."
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the simulated engine's random draws.",
)
@click.option(
    "--disable-radix-cache",
    is_flag=True,
    help="SGLang's --disable-radix-cache: no prefix reuse (by default requests whose "
    "trace gives hash_ids reuse cached prompt prefixes).",
)
@click.option(
    "--startup-s",
    default="0",
    show_default=True,
    metavar="SECONDS|catalog",
    help="Simulated seconds before the server listens, as SGLang loads the model and "
    "captures CUDA graphs first (wall time: this / --speed); 'catalog': the model's "
    "startup_s from the catalog (what a real restart costs).",
)
@hicache_options
def sim_server_cmd(
    port: int,
    host: str,
    spool_dir: Path | None,
    trace: str,
    speed: float,
    loop_trace: bool,
    gpu: str,
    model: str,
    drafter: str,
    speculative_algorithm: str | None,
    spec_steps: int,
    acceptance_profile: str | None,
    seed: int,
    disable_radix_cache: bool,
    startup_s: str,
    enable_hierarchical_cache: bool,
    hicache_ratio: float | None,
    hicache_size: int,
) -> None:
    """A simulated SGLang 0.5.23 server (the daemon cannot tell it from SGLang
    except by /model_info). Ctrl-C stops it."""
    from specgov.simulator.replay.runner import ServerSpec
    from specgov.simulator.server.core import SimServer

    asked = None if speculative_algorithm is None else speculative_algorithm.strip().upper()
    try:
        startup = startup_seconds(startup_s, model)
    except (ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--startup-s") from None
    try:
        loaded: Trace | list[Request] = (
            [] if trace == NO_TRACE else load_trace_arg(trace, seed=seed)
        )
        sim = SimServer(
            loaded,
            ServerSpec(
                gpu=gpu,
                model=model,
                drafter=drafter,
                spec_steps=spec_steps,
                acceptance_profile=acceptance_profile,
                prefix_cache=not disable_radix_cache,
                hierarchical_cache=enable_hierarchical_cache,
                hicache_ratio=hicache_ratio,
                hicache_size_gb=hicache_size,
            ),
            speed=speed,
            spool_dir=spool_dir,
            host=host,
            port=port,
            seed=seed,
            loop_trace=loop_trace,
            speculative=asked != PLAIN_ALGORITHM,
        )
    except (ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    # The drafter's algorithm is asked of the server only when a flag names one to check.
    if asked not in (None, PLAIN_ALGORITHM) and asked != sim.speculative_algorithm:
        raise click.ClickException(
            f"--speculative-algorithm {speculative_algorithm}: the drafter {drafter!r} runs "
            f"{sim.speculative_algorithm}; give {PLAIN_ALGORITHM} for a plain server or "
            "leave the flag out"
        )

    def ready(s: SimServer) -> None:
        click.echo(f"simulated SGLang server on {s.url} ({s.policy_name}); Ctrl-C to stop")

    left_s = _startup_wall_left_s(startup, speed)
    try:
        code = serve(sim, on_ready=ready, startup_wall_s=left_s)
    except (ValueError, OSError) as exc:  # e.g. the port is taken
        raise click.ClickException(f"cannot serve on {host}:{port}: {exc}") from None
    raise SystemExit(code)


if __name__ == "__main__":  # pragma: no cover - `python -m specgov.simulator.server.cli`
    sim_server_cmd(prog_name="specgov sim-server", auto_envvar_prefix="SPECGOV_SIM_SERVER")
