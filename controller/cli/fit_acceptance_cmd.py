"""`specgov fit-acceptance`: fit the simulator's acceptance model to a per-token trace.

The trace is the ``acceptance`` JSONL format (``specgov.simulator.workload.trace_files``): one
request per line with ``acc_len``, the tokens a verify starting at each output position would
emit. The fit (``specgov.simulator.engine.acceptance_fit``) measures the all-position rates per
domain and fits the per-token correlation so that the model's accept length matches the trace's
replay at k = 1..7, the per-request heterogeneity to the spread over requests, and keeps exact-
match runs instead when they fit better. The result is a catalog file with one
``acceptance_profiles`` entry, which ``specgov replay --catalog FILE --acceptance-profile NAME``
loads."""

from __future__ import annotations

from pathlib import Path

import click

from specgov.controller.cli.format import BadInput

# Requests whose record names no domain are fitted (and replayed) as this domain.
NO_DOMAIN = "default"


@click.command(name="fit-acceptance")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Profile file to write (default: TRACE's name with .acceptance.yaml).",
)
@click.option(
    "--name",
    default=None,
    help="Profile name to give --acceptance-profile (default: TRACE's stem).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Model traces' seed.")
def fit_acceptance_cmd(trace: Path, output: Path | None, name: str | None, seed: int) -> None:
    """Fit an acceptance profile from TRACE, a per-token acceptance trace (JSONL)."""
    import yaml

    from specgov.simulator.engine.acceptance_fit import AcceptanceFitError, profile_document
    from specgov.simulator.engine.acceptance_fit import fit_trace_domains as fit
    from specgov.simulator.workload.trace_files import load_trace
    from specgov.simulator.workload.traces import TraceError

    try:
        loaded = load_trace(trace, "acceptance")
    except TraceError as exc:
        raise BadInput(str(exc)) from None
    by_domain: dict[str, list[list[int]]] = {}
    for r in loaded.requests:
        if r.acc_len is not None:
            key = (r.domain or NO_DOMAIN).strip().lower()
            by_domain.setdefault(key, []).append(list(r.acc_len))
    try:
        fits = fit(by_domain, seed=seed)
    except AcceptanceFitError as exc:
        raise BadInput(f"{trace}: {exc}") from None
    profile = (name or trace.stem).strip().lower().replace(" ", "-")
    out = output or trace.with_name(f"{trace.stem}.acceptance.yaml")
    biggest = max(fits, key=lambda f: f.tokens).domain
    doc = profile_document(
        profile,
        fits,
        source=f"specgov fit-acceptance {trace.name} (seed {seed})",
        default_domain=biggest,
    )
    header = (
        f"# Acceptance profile '{profile}' fitted by `specgov fit-acceptance` from "
        f"{trace.name}.\n"
        "# rates: measured (all-position conditional rates of the trace);\n"
        "# token_correlation: fitted (model replay vs trace replay, k = 1..7; null for runs);\n"
        "# request_correlation: fitted (spread over requests of their mean acc_len);\n"
        "# runs: true when exact-match runs (n-gram-like) reproduce the trace better;\n"
        "# fit: the trace's and the fitted model's accept lengths (per_verify: the\n"
        "# rates sampled per verify, the pre-issue-11 model). Load it with\n"
        f"#   specgov replay ... --catalog {out.name} --acceptance-profile {profile}\n"
    )
    try:
        out.write_text(
            header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None), encoding="utf-8"
        )
    except OSError as exc:
        raise click.ClickException(f"{out}: cannot write the profile: {exc.strerror}") from None
    for f in fits:
        shape = "runs" if f.runs else f"token_correlation {f.token_correlation:.2f}"
        other = "latent" if f.runs else "runs"
        click.echo(
            f"domain {f.domain}: {f.requests} requests, {f.tokens} tokens, {shape}, "
            f"request_correlation {f.request_correlation:.3f}, "
            f"max error {100 * f.max_rel_error:.1f} % ({other}: "
            f"{100 * f.other_max_rel_error:.1f} %)"
        )
        click.echo(f"  k      trace  model  {other:>6}  per-verify")
        for k in sorted(f.trace_accept_length):
            click.echo(
                f"  {k:<5d} {f.trace_accept_length[k]:6.3f} {f.model_accept_length[k]:6.3f} "
                f"{f.other_accept_length[k]:7.3f} {f.per_verify_accept_length[k]:6.3f}"
            )
    click.echo(f"wrote {out} (profile '{profile}')")
