"""`specgov sglang-args`: print SGLang launch flags and the adaptive-config JSON.

Registered on the `specgov` group by ``controller/cli/main.py``. Exit codes: 0 printed; 1
the adaptive config could not be written; 2 bad usage (a combination SGLang would
refuse or rewrite, an unreadable --from-replay report). ``specgov.adapters`` is
imported inside the command, so other commands never pay for it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specgov.controller.cli.format import BadInput

if TYPE_CHECKING:
    from specgov.adapters.launch_config import LaunchConfig, SlotCandidates
    from specgov.policies.common.types import SpecShape

_EPILOG = """\b
Shapes (--shape): ALGO:STEPS,TOPK,DRAFT_TOKENS (EAGLE3:3,1,4; EAGLE:5,4,8 for a
tree), ALGO:STEPS for a chain (topk 1, draft tokens STEPS+1), or NONE.
\b
Slots (--slots), ';'-separated, turning on --speculative-adaptive:
  1=1,3,5,7;8=0,1,3;32=0,1;64=0        batch-size bound = candidate steps
  1=1,3,5,7/ema_alpha=0.3              per-slot knobs after '/'
  ema_alpha=0.3;1=1,3;16=0,1           a bare knob applies to every slot
  default                              SGLang's own default table
Knobs: ema_alpha, update_interval, warmup_batches, down_hysteresis,
up_hysteresis, ceiling_coeff.
\b
Examples:
  specgov sglang-args --shape EAGLE3:3
  specgov sglang-args --algorithm EAGLE3 --slots '1=1,3,5;8=0,1,3' --config-out a.json
  specgov sglang-args --from-replay report.json --config-out a.json
"""


def _read_report(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"--from-replay {path}: cannot read: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"--from-replay {path}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            "expected the output of `specgov replay --output json`"
        ) from None


def _build(
    *,
    algorithm: str | None,
    draft_model_path: str | None,
    num_steps: int | None,
    topk: int | None,
    num_draft_tokens: int | None,
    slots_text: str | None,
    shape_text: str | None,
    from_replay: Path | None,
    config_path: str,
    mem_fraction_static: float | None,
    max_running_requests: int | None,
    cuda_graph_max_bs_decode: int | None,
) -> LaunchConfig:
    from specgov.adapters.launch_config import build_launch_config, parse_slots

    extras: dict[str, Any] = {
        "mem_fraction_static": mem_fraction_static,
        "max_running_requests": max_running_requests,
        "cuda_graph_max_bs_decode": cuda_graph_max_bs_decode,
    }
    numbers = {
        "--num-steps": num_steps,
        "--topk": topk,
        "--num-draft-tokens": num_draft_tokens,
    }
    if from_replay is not None:
        clash = [
            flag
            for flag, value in {**numbers, "--shape": shape_text, "--slots": slots_text}.items()
            if value is not None
        ]
        if clash:
            raise BadInput(
                f"--from-replay chooses the shape and slots itself; drop {', '.join(clash)}"
            )
        return _from_replay(
            from_replay,
            algorithm=algorithm,
            draft_model_path=draft_model_path,
            config_path=config_path,
            extras=extras,
        )
    slots, defaults = parse_slots(slots_text) if slots_text is not None else ((), {})
    shape = _flag_shape(shape_text, algorithm, numbers, slots)
    return build_launch_config(
        shape,
        slots,
        defaults=defaults,
        draft_model_path=draft_model_path,
        adaptive_config_path=config_path,
        **extras,
    )


def _from_replay(
    report: Path,
    *,
    algorithm: str | None,
    draft_model_path: str | None,
    config_path: str,
    extras: dict[str, Any],
) -> LaunchConfig:
    """``--from-replay``: the shape, slots and defaults the replay report recommends."""
    from specgov.adapters.launch_config import build_launch_config
    from specgov.controller.daemon.recommend_replay import recommend_from_replay

    rec = recommend_from_replay(
        _read_report(report),
        algorithm=algorithm,
        draft_model_path=draft_model_path,
        adaptive_config_path=config_path,
    )
    return build_launch_config(
        rec.shape,
        rec.slots,
        defaults=dict(rec.defaults),
        draft_model_path=rec.draft_model_path,
        adaptive_config_path=config_path,
        rationale=rec.rationale,
        **extras,
    )


def _flag_shape(
    shape_text: str | None,
    algorithm: str | None,
    numbers: dict[str, int | None],
    slots: Sequence[SlotCandidates],
) -> SpecShape:
    """The speculative shape from ``--shape``, or from ``--algorithm`` and the numbers
    (the slots' candidate steps as the adaptive candidates); exactly one of the two."""
    from specgov.adapters.launch_config import parse_shape, shape_from_flags

    if shape_text is not None:
        clash = [flag for flag, value in numbers.items() if value is not None]
        if algorithm is not None:
            clash.insert(0, "--algorithm")
        if clash:
            raise BadInput(
                f"--shape already gives algorithm, steps, topk and draft tokens; "
                f"drop {', '.join(clash)}"
            )
        return parse_shape(shape_text)
    if algorithm is None:
        raise BadInput(
            "nothing to configure: give --shape, --algorithm with --num-steps/--topk/"
            "--num-draft-tokens or with --slots, or --from-replay REPORT.json"
        )
    union = sorted({s for slot in slots for s in slot.candidate_steps}) if slots else None
    return shape_from_flags(
        algorithm,
        numbers["--num-steps"],
        numbers["--topk"],
        numbers["--num-draft-tokens"],
        adaptive_candidates=union,
    )


@click.command(name="sglang-args", epilog=_EPILOG)
@click.option("--algorithm", help="--speculative-algorithm: EAGLE, EAGLE3, NEXTN, NGRAM, ...")
@click.option("--draft-model-path", help="--speculative-draft-model-path (EAGLE heads, drafts).")
@click.option("--num-steps", type=int, help="--speculative-num-steps.")
@click.option("--topk", type=int, help="--speculative-eagle-topk (1 for adaptive).")
@click.option("--num-draft-tokens", type=int, help="--speculative-num-draft-tokens.")
@click.option("--shape", "shape_text", help="Compact shape, e.g. EAGLE3:3,1,4 (see below).")
@click.option("--slots", "slots_text", help="Adaptive slot table, e.g. '1=1,3,5,7;8=0,1,3'.")
@click.option(
    "--from-replay",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Recommend from a `specgov replay --output json` report.",
)
@click.option(
    "--config-out",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the adaptive-config JSON here (default: print it).",
)
@click.option("--mem-fraction-static", type=float, help="--mem-fraction-static, in (0, 1).")
@click.option("--max-running-requests", type=int, help="--max-running-requests.")
@click.option(
    "--cuda-graph-max-bs-decode",
    type=int,
    help="--cuda-graph-max-bs-decode (0.5.23 has no --cuda-graph-max-bs).",
)
@click.option(
    "--output",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Text: the flags on one shell line, then the JSON. JSON: one object.",
)
def sglang_args(config_out: Path | None, output: str, **flags: Any) -> None:
    """Print SGLang 0.5.23 launch flags (and the --speculative-adaptive-config JSON).

    Every combination SGLang would reject, silently rewrite or silently ignore is
    refused with SGLang's reason.
    """
    from specgov.adapters.launch_config import DEFAULT_ADAPTIVE_CONFIG_PATH

    # The flag names the file SGLang will open; an absolute path survives a launch
    # from another directory.
    config_path = str(config_out.resolve()) if config_out else DEFAULT_ADAPTIVE_CONFIG_PATH
    try:
        cfg = _build(config_path=config_path, **flags)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    config_json = cfg.adaptive_config_json()
    written = False
    if config_out is not None and config_json is not None:
        try:
            config_out.write_text(json.dumps(config_json, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise click.ClickException(
                f"--config-out {config_out}: cannot write: {exc.strerror}"
            ) from None
        written = True
    if output == "json":
        data = cfg.to_json()
        data["adaptive_config_written"] = written
        click.echo(json.dumps(data, indent=2))
    else:
        _echo_text(cfg, config_json, written=written, config_out=config_out)


def _echo_text(
    cfg: LaunchConfig,
    config_json: dict[str, Any] | None,
    *,
    written: bool,
    config_out: Path | None,
) -> None:
    """The flags on stdout as one shell line, then the JSON (unless written); the notes
    and the rationale on stderr as shell comments."""
    if cfg.to_argv():
        click.echo(cfg.to_shell())
    else:
        click.echo("# no speculation: launch SGLang without speculative flags", err=True)
    if config_json is not None:
        if written:
            click.echo(f"# adaptive config written to {cfg.adaptive_config_path}", err=True)
        else:
            click.echo(
                f"# save the JSON below as {cfg.adaptive_config_path} (or use --config-out PATH)",
                err=True,
            )
            click.echo(json.dumps(config_json, indent=2))
    elif config_out is not None:
        click.echo("# static launch: no adaptive config, nothing written", err=True)
    if cfg.rationale:
        for line in cfg.rationale.splitlines():
            click.echo(f"# {line}", err=True)
