"""The daemon's configuration: typed, grouped, validated, with env and CLI overrides.

Sources, lowest to highest precedence:

1. the defaults: the field defaults of the typed groups (:class:`ServerConfig` ...
   :class:`LogConfig` in ``config_schema``,
   :class:`~specgov.policies.guardrails.GuardrailConfig`'s for ``guardrails``) and no
   budget limits (:data:`NO_BUDGET_LIMITS`), collected by :func:`default_groups`. They
   are the one source: the repository's ``config.yaml`` is their commented,
   human-readable copy, and ``tests/test_config.py`` fails unless it has exactly the same
   keys and values. (Why not read ``config.yaml``: the wheel ships Python packages only,
   so the root file is not there at run time, and a typed default is checked by mypy and
   by the group's own validation, a YAML copy by nothing.);
2. the file given to :func:`load_config` (only the keys it changes are needed);
3. environment variables ``SPECGOV_<GROUP>__<KEY>`` (e.g. ``SPECGOV_LOOP__MODE=plugin``),
   values read as YAML (``null``, ``true``, ``5s``, ``[0, 1, 3]``);
4. ``overrides``: a mapping of dotted keys (``"loop.mode"``) to values, from command-line
   flags. Omit the keys the user did not give: a ``None`` value means null.

The environment rule: a variable is a config override exactly when its name starts with
``SPECGOV_`` and the rest contains ``__``. Such a variable must name a known group and
key, or loading fails (a typo must not be silently ignored). Variables without ``__``
(``SPECGOV_SPOOL_DIR``, ``SPECGOV_SHARED_DATA``, ``SPECGOV_SGLANG_SRC``,
``SPECGOV_REQUIRE_*``, click's ``SPECGOV_<COMMAND>_<OPTION>``) belong to other parts of
specgov and are ignored here.

Errors are :class:`ConfigError` (a ValueError) naming where the bad value came from
(``FILE:LINE``, ``env NAME`` or ``command line``), the key path, the value and the
expected form. Secrets never live in the config: it holds the *names* of the environment
variables that carry them (``server.api_key_env``, ``control.token_env``), resolved by
:meth:`ServerConfig.api_key` and :meth:`ControlConfig.token`; error messages about those
keys do not echo the value, in case the secret itself was pasted there. A control token
is required whenever ``control.listen`` is not loopback: :func:`load_config` checks that
``control.token_env`` names a variable, :func:`check_secrets` (called by ``specgov run``,
not by ``config validate``/``show``) that the variable is set.

Four modules: this one loads (the layers merged, every value checked, the rules across
keys) and shows a config; :mod:`~specgov.controller.daemon.config_values` holds the
error type and the value forms (durations, listen addresses);
:mod:`~specgov.controller.daemon.config_schema` the typed groups with their defaults and
each key's check; :mod:`~specgov.controller.daemon.config_layers` the sources (file,
environment, command line, defaults) as layers of raw values with their origin.

Relative paths are kept relative (to the daemon's working directory); ``~`` is expanded.

Bounded input: a config file is at most :data:`CONFIG_MAX_BYTES` (1 MiB), a
``SPECGOV_<GROUP>__<KEY>`` value at most :data:`ENV_VALUE_MAX_CHARS` (16 KiB); YAML
anchors and aliases (``&name``, ``*name``: the alias-expansion "billion laughs" bomb) and
nesting deeper than :data:`YAML_MAX_DEPTH` are refused with the file and line; error
messages quote values elided (:mod:`reprlib`), escape control characters and are cut at
:data:`MESSAGE_MAX_CHARS`.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgov.controller.daemon.config_layers import (
    CLI_LABEL,
    DEFAULTS_LABEL,
    ConfigLayer,
    RawValue,
    defaults_layer,
    env_layer,
    override_layer,
    read_config_text,
    yaml_layer,
)
from specgov.controller.daemon.config_schema import (
    SCHEMA,
    SIMPLE_GROUPS,
    ControlConfig,
    DeploymentConfig,
    LogConfig,
    LoopConfig,
    MetricsConfig,
    PolicyConfig,
    RecommendConfig,
    ServerConfig,
    SpoolConfig,
    StateConfig,
)
from specgov.controller.daemon.config_values import (
    ConfigError,
    ConfigProblems,
    plain_value,
    show_value,
)
from specgov.controller.daemon.control_token import TOKEN_FILENAME
from specgov.policies.common.codec import to_data
from specgov.policies.common.types import Budget, PolicyTypeError
from specgov.policies.guardrails import GuardrailConfig, GuardrailError


@dataclass(frozen=True)
class SpecgovConfig:
    """The whole configuration.

    ``budget`` is the policy layer's :class:`Budget`. ``guardrails`` is the validated,
    complete, read-only mapping of :class:`GuardrailConfig` keys (what
    ``GuardrailConfig.from_dict`` takes; :meth:`guardrail_config` builds it).
    ``source_path`` (the file loaded, None for the defaults) and ``sources`` (dotted key
    -> where its value came from) are not part of equality.
    """

    server: ServerConfig
    spool: SpoolConfig
    loop: LoopConfig
    policy: PolicyConfig
    budget: Budget
    guardrails: Mapping[str, Any]
    state: StateConfig
    metrics: MetricsConfig
    control: ControlConfig
    recommend: RecommendConfig
    deployment: DeploymentConfig
    log: LogConfig
    source_path: Path | None = field(default=None, compare=False)
    sources: Mapping[str, str] = field(
        default_factory=lambda: types.MappingProxyType({}), compare=False, repr=False
    )

    def guardrail_config(self) -> GuardrailConfig:
        """The guard's configuration (what the daemon's control core wraps its policy in)."""
        return GuardrailConfig.from_dict(self.guardrails, where="guardrails")

    @property
    def control_token_path(self) -> Path | None:
        """The control token file (``control.token_file``, ``auto`` resolved); None: no
        token file (the operator opted out)."""
        path = self.control.token_file
        if path == "auto":
            return self.state.db_path.parent / TOKEN_FILENAME
        return path


# ---------------------------------------------------------------------------- loading


def load_config(
    path: Path | None,
    *,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Any] = types.MappingProxyType({}),
) -> SpecgovConfig:
    """Defaults < ``path`` < ``env`` < ``overrides`` (module docstring), validated.

    ``path`` None loads only the defaults. Raises :class:`ConfigError`.
    """
    merged = defaults_layer()
    problems = ConfigProblems()  # every error of the file, the environment and the values
    layers: list[ConfigLayer] = []
    if path is not None:
        label = str(path)
        text = read_config_text(Path(path), label)
        layers.append(yaml_layer(text, label, problems))
    layers.append(env_layer(env, problems))
    layers.append(override_layer(overrides))
    for layer in layers:
        for group, keys in layer.items():
            merged.setdefault(group, {}).update(keys)
    config = _build(merged, path, problems)
    problems.raise_any()
    assert config is not None  # built whenever no problem was found
    _check_relations(config)
    return config


def reload_config(running: SpecgovConfig, *, env: Mapping[str, str] = os.environ) -> SpecgovConfig:
    """The configuration a reload (SIGHUP) switches to: ``running``'s file read again, the
    environment, and the command-line values ``running`` was started with, which win over
    the file as they did at start (``sources`` says which keys they are). Raises
    :class:`ConfigError` when the result does not validate."""
    flags = effective_config_dict(running)
    overrides = {
        dotted: flags[dotted.partition(".")[0]][dotted.partition(".")[2]]
        for dotted, origin in running.sources.items()
        if origin == CLI_LABEL
    }
    return load_config(running.source_path, env=env, overrides=overrides)


def config_changes(old: SpecgovConfig, new: SpecgovConfig) -> list[str]:
    """One line per setting that differs, ``key: old -> new (source)``, in file order."""
    before, after = effective_config_dict(old), effective_config_dict(new)
    return [
        f"{group}.{key}: {show_value(value)} -> {show_value(after[group][key])} "
        f"({new.sources.get(f'{group}.{key}', DEFAULTS_LABEL)})"
        for group, keys in before.items()
        for key, value in keys.items()
        if after[group][key] != value
    ]


def _build(
    merged: ConfigLayer, path: Path | None, problems: ConfigProblems
) -> SpecgovConfig | None:
    """The typed config; every bad value is added to ``problems`` (None when any was)."""
    groups: dict[str, Any] = {}
    sources: dict[str, str] = {}
    before = len(problems.found)
    for group, schema in SCHEMA.items():
        raw = merged.get(group, {})
        values: dict[str, Any] = {}
        bad = False
        for key, check in schema.items():
            if key not in raw:
                continue  # only guardrails may omit keys; defaults cover the rest
            item = raw[key]
            try:
                values[key] = check(item.value, f"{item.origin}: {group}.{key}")
            except ConfigError as exc:
                problems.add(exc)
                bad = True
            sources[f"{group}.{key}"] = item.origin
        if bad:
            continue
        try:
            groups[group] = _build_group(group, values, raw)
        except ConfigError as exc:
            problems.add(exc)
    if len(problems.found) > before:
        return None
    return SpecgovConfig(**groups, source_path=path, sources=types.MappingProxyType(sources))


def _build_group(group: str, values: dict[str, Any], raw: Mapping[str, RawValue]) -> Any:
    if group == "guardrails":
        return _build_guardrails(values, raw)
    if group == "budget":
        try:
            return Budget(**values)
        except (PolicyTypeError, TypeError) as exc:  # pragma: no cover - checked above
            raise ConfigError(f"budget: {exc}") from None
    return SIMPLE_GROUPS[group](**values)


def _build_guardrails(values: Mapping[str, Any], raw: Mapping[str, RawValue]) -> Mapping[str, Any]:
    try:
        checked = to_data(GuardrailConfig.from_dict(values, where="guardrails"))
        checked["required_fields"] = tuple(checked["required_fields"])  # immutable
        return types.MappingProxyType(checked)
    except (GuardrailError, TypeError) as exc:
        # GuardrailConfig's own checks say "GuardrailConfig.key"; name the config key.
        message = re.sub(r"^GuardrailConfig\.", "guardrails.", str(exc))
        match = re.match(r"guardrails\.(\w+)", message)
        item = raw.get(match[1]) if match else None
        origin = item.origin if item is not None else _most_specific(raw.values())
        raise ConfigError(f"{origin}: {message}") from None


def _most_specific(items: Any) -> str:
    origins = [i.origin for i in items if i.origin != DEFAULTS_LABEL]
    return origins[-1] if origins else DEFAULTS_LABEL


def _check_relations(config: SpecgovConfig) -> None:
    """Rules across keys; attributed to the key that most likely needs changing."""
    src = config.sources
    control = config.control
    if control.token_required:
        listen = f"control.listen {control.listen} is not a loopback address"
        if control.token_env is None:
            raise ConfigError(
                f"{src.get('control.token_env', DEFAULTS_LABEL)}: control.token_env: {listen}, "
                f"so control.token_env must name the environment variable holding the API "
                f"token (or listen on 127.0.0.1), got null"
            )
    if config.loop.mode == "plugin" and config.spool.dir is None:
        raise ConfigError(
            f"{src.get('spool.dir', DEFAULTS_LABEL)}: spool.dir: loop.mode plugin publishes "
            f"step tables through the spool, so spool.dir must name a directory, got null"
        )
    loop = config.loop
    if not loop.telemetry_max_age_s >= loop.scrape_interval_s:
        # A bound shorter than one scrape interval fails readiness between every two
        # healthy scrapes.
        raise ConfigError(
            f"{src.get('loop.telemetry_max_age_s', DEFAULTS_LABEL)}: loop.telemetry_max_age_s: "
            f"expected >= loop.scrape_interval_s ({loop.scrape_interval_s:g} s, from "
            f"{src.get('loop.scrape_interval_s', DEFAULTS_LABEL)}), else readiness fails "
            f"between two healthy scrapes, got {loop.telemetry_max_age_s:g} s"
        )
    guard = config.guardrails
    limit = guard["table_ttl_s"] * (1.0 - guard["keepalive_fraction"])
    decide = config.loop.decide_interval_s
    if not decide < limit:
        raise ConfigError(
            f"{src.get('loop.decide_interval_s', DEFAULTS_LABEL)}: loop.decide_interval_s: "
            f"expected < guardrails.table_ttl_s * (1 - guardrails.keepalive_fraction) = "
            f"{limit:g} s, so a published table is re-issued before its TTL runs out, "
            f"got {decide:g} s"
        )


def check_secrets(config: SpecgovConfig, env: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`ConfigError` when a required secret's variable is unset or empty.

    Separate from :func:`load_config` so that a file can be validated and shown on a
    machine without the secrets; ``specgov run`` calls both.
    """
    control = config.control
    if control.token_required and control.token(env) is None:
        raise ConfigError(
            f"{config.sources.get('control.token_env', DEFAULTS_LABEL)}: control.token_env: "
            f"control.listen {control.listen} is not a loopback address, so the environment "
            f"variable {control.token_env} must hold the API token, but it is unset or empty"
        )


# ---------------------------------------------------------------------------- output


def effective_config_dict(config: SpecgovConfig) -> dict[str, dict[str, Any]]:
    """The configuration as plain YAML/JSON data, groups and keys in file order.

    Durations are seconds, paths and addresses strings. It holds no secret (the config
    only names their variables; :func:`secret_status` says whether they are set), and
    ``load_config`` of this data, dumped to a file, gives back an equal config.
    """
    out: dict[str, dict[str, Any]] = {}
    for group, keys in SCHEMA.items():
        obj = getattr(config, group)
        if isinstance(obj, Mapping):
            out[group] = {key: plain_value(obj[key]) for key in keys}
        else:
            out[group] = {key: plain_value(getattr(obj, key)) for key in keys}
    return out


def secret_status(
    config: SpecgovConfig, env: Mapping[str, str] = os.environ
) -> dict[str, dict[str, Any]]:
    """For each secret: the variable that holds it and whether it is set, never its value."""
    return {
        "server.api_key": {
            "env": config.server.api_key_env,
            "set": config.server.api_key(env) is not None,
            "required": False,
        },
        "control.token": {
            "env": config.control.token_env,
            "set": config.control.token(env) is not None,
            "required": config.control.token_required,
        },
    }
