"""The daemon's composition root: build the store, registry, daemon, control API and
metrics listeners from a configuration, run until stopped, and tear them down.

`specgov run` (controller/cli/daemon_cmds.py) parses its flags into a configuration and
calls ``serve_daemon``; nothing here parses or prints.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from typing import Any


async def serve_daemon(
    config: Any, *, ready: Callable[[dict[str, Any]], None] | None = None
) -> int:
    """Run the daemon with its control API and metrics servers until stopped.

    A deployment the catalog lacks raises ValueError naming it ("deployment: ...")."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from specgov.adapters.http_listener import serve
    from specgov.controller.daemon.control_api import make_app
    from specgov.controller.daemon.own_metrics import metrics_app
    from specgov.controller.daemon.runtime import Daemon
    from specgov.controller.daemon.state_store import StateStore

    store = StateStore(config.state.db_path, open_now=False, file_group=config.state.group)
    registry = CollectorRegistry()
    config_file = config.source_path

    def reload_config() -> Any:
        from specgov.controller.daemon.config import reload_config

        # The flags `specgov run` was started with win over the file again (issue 23).
        return reload_config(config)

    daemon = Daemon(
        config,
        store=store,
        registry=registry,
        prior=deployment_prior_of(config),
        config_loader=reload_config if config_file is not None else None,
    )
    token = control_api_token(config)
    control = make_app(
        daemon, token=token, listen_host=config.control.listen.host, open_reads_on_loopback=True
    )
    runners: list[web.AppRunner] = []
    bound: dict[str, Any] = {}
    for name, app, addr in (
        ("control", control, config.control.listen),
        ("metrics", metrics_app(registry), config.metrics.listen),
    ):
        # Capped, with a header timeout and accept backoff (adapters/http_listener.py).
        runner, site = await serve(app, addr.host, addr.port, name=name)
        runners.append(runner)
        bound[name] = f"{addr.host}:{site.port}"
    logging.getLogger("specgov.daemon").info(
        "specgov %s mode, policy %s, server %s, control %s, metrics %s",
        config.loop.mode,
        daemon.policy.name,
        config.server.url,
        bound["control"],
        bound["metrics"],
    )
    if ready is not None:
        ready(bound)
    try:
        return await daemon.run()
    finally:
        for runner in runners:
            await runner.cleanup()
        store.close()


def control_api_token(config: Any) -> str | None:
    """The token the mutating control routes need (controller/daemon/control_token.py), logged
    by where it came from; None only when the operator opted out."""
    from specgov.controller.daemon.control_token import daemon_token

    token = daemon_token(config.control.token_env, config.control_token_path, os.environ)
    log = logging.getLogger("specgov.daemon")
    if token is None:
        log.warning(
            "control.token_file is null and %s is unset: ANY local user may steer this "
            "daemon through its control API (the single-user opt-out)",
            config.control.token_env or "control.token_env",
        )
    elif config.control.token_env and os.environ.get(config.control.token_env):
        log.info("control API: mutating routes need the token in $%s", config.control.token_env)
    else:
        log.info(
            "control API: mutating routes need the token in %s (the CLI of this user reads "
            "it by itself)",
            config.control_token_path,
        )
    return token


def freeze_startup_heap(bound: dict[str, Any] | None = None) -> None:
    """Move everything alive at start-up out of the cyclic GC's reach (``gc.freeze``).

    Why: the daemon's start-up heap (modules, numpy/scipy, the HTTP stacks, config,
    registry: ~100k objects) lives as long as the process, and every full collection
    walked it again: ~2 ms of CPU per decision at a 1 s interval, measured
    (benchmarks/bench_daemon_overhead.py). Frozen objects are still freed by reference
    counting; only cycles among them would be kept, and start-up builds none that die.
    Collected first, so no garbage is frozen. Called by ``specgov run`` once the daemon
    is built and its listeners are bound (``bound``: their addresses, unused).
    """
    gc.collect()
    gc.freeze()


def deployment_prior_of(config: Any) -> Any:
    """The step-cost prior from the catalog entry of the deployment; a ValueError
    starting "deployment: " when the catalog cannot give one."""
    from specgov.controller.daemon.recommend import deployment_prior

    try:
        return deployment_prior(
            config.deployment.gpu, config.deployment.model, config.deployment.drafter
        )
    except ValueError as exc:
        raise ValueError(f"deployment: {exc}") from exc
