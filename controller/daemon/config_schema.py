"""The configuration's schema (:mod:`specgov.controller.daemon.config`): the typed groups
with their defaults, and each key's check.

Each group's field defaults are the daemon's defaults (the config module's docstring);
:data:`SCHEMA` maps every group and key, in file order, to the check that turns a raw
value (from a file, the environment or a flag) into the typed one.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Literal, cast
from urllib.parse import urlsplit

from specgov.adapters.spool import SpoolError, default_spool_dir, resolve_gid
from specgov.controller.daemon.config_values import (
    ConfigError,
    ListenAddress,
    parse_duration,
    parse_listen_address,
    show_value,
)
from specgov.policies.common.types import Budget
from specgov.policies.common.validation import check_real, is_int
from specgov.policies.daemon.spec import PolicySpec, PolicySpecError, parse_policy_spec
from specgov.policies.guardrails import GuardrailConfig

LoopMode = Literal["observe", "plugin"]
LogFormat = Literal["text", "json"]
LOOP_MODES: Final[tuple[LoopMode, ...]] = ("observe", "plugin")
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_ENV_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CATALOG_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.+-]+")


def env_secret(variable: str | None, env: Mapping[str, str]) -> str | None:
    """The value of the environment *variable* (a key or token); None when no variable
    is configured, or it is unset or empty."""
    if variable is None:
        return None
    return env.get(variable) or None


# ------------------------------------------------------------------------- the groups


# Each group's field defaults are the daemon's defaults (the config module's docstring);
# config.yaml documents them key by key and must say the same.


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The SGLang server this daemon governs."""

    url: str = "http://127.0.0.1:30000"  # 30000: SGLang's default --port
    api_key_env: str | None = "SPECGOV_SGLANG_API_KEY"
    timeout_s: float = 5.0

    def api_key(self, env: Mapping[str, str] = os.environ) -> str | None:
        """The key from the named variable; None when not configured, unset or empty."""
        return env_secret(self.api_key_env, env)


@dataclass(frozen=True, slots=True)
class SpoolConfig:
    """The directory shared with the in-engine plugin; None: no plugin (observe mode only).

    The default (``auto`` in a file) is :func:`~specgov.adapters.spool.default_spool_dir`,
    never a world-writable place like ``/tmp`` where another user could create it first.
    ``group``: the gid shared with the server in a two-user deployment (given as a name
    or a gid; docs/spool-security.md); None: one user, everything 0700/0600.
    """

    dir: Path | None = field(default_factory=default_spool_dir)
    group: int | None = None


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """The slow control loop: its mode and intervals."""

    mode: LoopMode = "observe"
    scrape_interval_s: float = 1.0
    decide_interval_s: float = 5.0
    # Readiness (/v1/health) fails when no telemetry arrived for longer than this.
    telemetry_max_age_s: float = 60.0


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The policy: ``spec`` is the spec text as written, already validated."""

    spec: str = "goodput"

    def parsed(self) -> PolicySpec:
        return parse_policy_spec(self.spec)


@dataclass(frozen=True, slots=True)
class StateConfig:
    """The SQLite state database."""

    db_path: Path = Path("~/.local/state/specgov/state.db")  # "~" expanded when loaded
    # Group given read access to the state files (0640 instead of 0600); None: nobody.
    group: str | int | None = None
    # The learned policy state is saved at once whenever what the guard acts on changes
    # (a table, a trial, a block, an overridden slot, the running policy), and between
    # such changes every this many seconds (0: every decision). Encoding a full
    # estimator buffer every second was the largest share of the daemon's CPU; a crash
    # loses at most this much learning, which the next windows re-learn. The audit log
    # is written every decision.
    policy_state_interval_s: float = 10.0


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The daemon's own Prometheus endpoint."""

    # 9464: OpenTelemetry's default Prometheus exporter port.
    listen: ListenAddress = ListenAddress("127.0.0.1", 9464)  # noqa: RUF009 - frozen


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control API; a token is required whenever ``listen`` is not loopback."""

    listen: ListenAddress = ListenAddress("127.0.0.1", 9465)  # noqa: RUF009 - frozen
    token_env: str | None = "SPECGOV_CONTROL_TOKEN"
    # Where the daemon keeps the token its mutating routes need when token_env's variable
    # is unset (controller/daemon/control_token.py): "auto" is control.token beside the state
    # database; None is the opt-out (loopback only: any local user may then steer).
    token_file: Path | Literal["auto"] | None = "auto"

    @property
    def token_required(self) -> bool:
        return not self.listen.is_loopback

    def token(self, env: Mapping[str, str] = os.environ) -> str | None:
        """The token from the named variable; None when not configured, unset or empty."""
        return env_secret(self.token_env, env)


@dataclass(frozen=True, slots=True)
class RecommendConfig:
    """Restart recommendations; ``apply_command`` is an argv, never a shell string."""

    enabled: bool = True
    interval_s: float = 3600.0
    apply_command: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    """Catalog names for the restart-loop simulator (the daemon checks them lazily)."""

    gpu: str = "h100"
    model: str = "llama-3.1-8b"
    drafter: str = "eagle3"


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Logging; ``level`` is an upper-case :mod:`logging` level name."""

    format: LogFormat = "text"
    level: str = "INFO"


# Budget (policies/common/types.py) declares no field defaults; "no limit" is None for each.
NO_BUDGET_LIMITS: Final = Budget(
    vram_gib=None,
    slo_tpot_ms=None,
    slo_itl_p99_ms=None,
    slo_ttft_p99_ms=None,
    allowed_steps=None,
)


def default_groups() -> dict[str, object]:
    """Each group's default object, in file order: the one source of the defaults."""
    return {
        "server": ServerConfig(),
        "spool": SpoolConfig(),
        "loop": LoopConfig(),
        "policy": PolicyConfig(),
        "budget": NO_BUDGET_LIMITS,
        "guardrails": GuardrailConfig(),
        "state": StateConfig(),
        "metrics": MetricsConfig(),
        "control": ControlConfig(),
        "recommend": RecommendConfig(),
        "deployment": DeploymentConfig(),
        "log": LogConfig(),
    }


# ------------------------------------------------------------------------ validators

_Validator = Callable[[object, str], object]


def _duration(value: object, where: str) -> float:
    return parse_duration(value, where=where)


def _duration_or_zero(value: object, where: str) -> float:
    return parse_duration(value, where=where, allow_zero=True)


def _listen(value: object, where: str) -> ListenAddress:
    if isinstance(value, ListenAddress):  # from a CLI flag already parsed
        value = str(value)
    return parse_listen_address(value, where=where)


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {show_value(value)}")
    return value


def _choice(options: tuple[str, ...]) -> _Validator:
    def check(value: object, where: str) -> str:
        if not isinstance(value, str) or value not in options:
            raise ConfigError(
                f"{where}: expected one of {', '.join(options)}, got {show_value(value)}"
            )
        return value

    return check


def _log_level(value: object, where: str) -> str:
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        levels = ", ".join(level.lower() for level in LOG_LEVELS)
        raise ConfigError(f"{where}: expected one of {levels}, got {show_value(value)}")
    return value.upper()


def _path(value: object, where: str) -> Path:
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ConfigError(f"{where}: expected a non-empty path, got {show_value(value)}")
    return Path(value).expanduser()


def _spool_dir(value: object, where: str) -> Path | None:
    if isinstance(value, str) and value.strip() == "auto":
        return default_spool_dir()
    return _optional_path(value, where)


def _spool_group(value: object, where: str) -> int | None:
    try:
        return resolve_gid(value, where=where)
    except SpoolError as exc:
        raise ConfigError(str(exc)) from None


def _optional_path(value: object, where: str) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str | Path):
        raise ConfigError(f"{where}: expected a non-empty path or null, got {show_value(value)}")
    return _path(value, where)


def _token_file(value: object, where: str) -> Path | Literal["auto"] | None:
    if isinstance(value, str) and value.strip() == "auto":
        return "auto"
    return _optional_path(value, where)


def _optional_group(value: object, where: str) -> str | int | None:
    if value is None:
        return None
    if is_int(value) and value >= 0:
        return value
    if isinstance(value, str) and value.strip() and value == value.strip():
        return value
    raise ConfigError(
        f"{where}: expected a group name, a group id >= 0 or null, got {show_value(value)}"
    )


def _catalog_name(value: object, where: str) -> str:
    if not isinstance(value, str) or not _CATALOG_NAME_RE.fullmatch(value):
        raise ConfigError(
            f"{where}: expected a catalog name (letters, digits, '_', '.', '+', '-'), "
            f"got {show_value(value)}"
        )
    return value


def _env_name(value: object, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _ENV_NAME_RE.fullmatch(value):
        # Never echoed: a user may have pasted the secret itself here.
        raise ConfigError(
            f"{where}: expected the NAME of an environment variable (letters, digits and "
            f"'_', not starting with a digit) or null; the value is not shown in case it "
            f"is the secret itself"
        )
    return value


def _url(value: object, where: str) -> str:
    form = "an http(s) base URL like 'http://127.0.0.1:30000'"
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected {form}, got {show_value(value)}")
    try:
        parts = urlsplit(value.strip())
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ConfigError(f"{where}: expected {form}, got {show_value(value)}") from None
    if parts.username is not None or parts.password is not None:
        # Not echoed: the URL carries a credential.
        raise ConfigError(
            f"{where}: credentials in the URL are not allowed (they would be logged); "
            f"name the variable holding the key in server.api_key_env"
        )
    if parts.query or parts.fragment:
        raise ConfigError(
            f"{where}: expected {form} without '?query' or '#fragment' (value not shown)"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: expected {form}, got {show_value(value)}")
    # No trailing slash, so clients can append "/metrics".
    return value.strip().rstrip("/")


def _policy_spec(value: object, where: str) -> str:
    if isinstance(value, PolicySpec):
        value = value.text
    if not isinstance(value, str):
        raise ConfigError(
            f"{where}: expected a policy spec string like 'goodput', got {show_value(value)}"
        )
    try:
        parse_policy_spec(value)
    except PolicySpecError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return value.strip()


def _optional_positive(unit: str) -> _Validator:
    def check(value: object, where: str) -> float | None:
        if value is None:
            return None
        form = f"a number of {unit} > 0 or null"
        return check_real(where, value, error=ConfigError, positive=True, form=form)

    return check


def _allowed_steps(value: object, where: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    steps: list[Any] = list(value) if isinstance(value, list | tuple) else []
    ok = bool(steps) and all(is_int(s) for s in steps)
    ok = ok and steps[0] >= 0 and all(a < b for a, b in itertools.pairwise(steps))
    if not ok:
        raise ConfigError(
            f"{where}: expected null or a non-empty list of strictly increasing ints >= 0 "
            f"like [0, 1, 3, 5], got {show_value(value)}"
        )
    return tuple(steps)


def _argv(value: object, where: str) -> tuple[str, ...] | None:
    form = "an argument list like ['/usr/local/bin/restart-sglang', '--from-specgov'] or null"
    if value is None:
        return None
    if isinstance(value, str):
        raise ConfigError(
            f"{where}: expected {form}, got the string {show_value(value)}: a command line "
            f"would need a shell to split it, and specgov never runs one"
        )
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{where}: expected {form}, got {show_value(value)}")
    for i, arg in enumerate(value):
        if not isinstance(arg, str) or not arg or "\0" in arg:
            raise ConfigError(f"{where}[{i}]: expected a non-empty string, got {show_value(arg)}")
    return tuple(cast(list[str], value))


def _guardrail_value(key: str, default: object) -> _Validator:
    # GuardrailConfig.from_dict checks the values (and names the key); here only the
    # duration strings every other *_s key accepts become seconds, and an int given for
    # a float field becomes a float (so the config holds the declared types).
    def convert(value: object, where: str) -> object:
        if key.endswith("_s") and isinstance(value, str):
            return parse_duration(value, where=where, allow_zero=True)
        if isinstance(default, float) and is_int(value):
            return float(value)
        return value

    return convert


SCHEMA: Final[dict[str, dict[str, _Validator]]] = {
    "server": {"url": _url, "api_key_env": _env_name, "timeout_s": _duration},
    "spool": {"dir": _spool_dir, "group": _spool_group},
    "loop": {
        "mode": _choice(LOOP_MODES),
        "scrape_interval_s": _duration,
        "decide_interval_s": _duration,
        "telemetry_max_age_s": _duration,
    },
    "policy": {"spec": _policy_spec},
    "budget": {
        "vram_gib": _optional_positive("GiB"),
        "slo_tpot_ms": _optional_positive("milliseconds"),
        "slo_itl_p99_ms": _optional_positive("milliseconds"),
        "slo_ttft_p99_ms": _optional_positive("milliseconds"),
        "allowed_steps": _allowed_steps,
    },
    "guardrails": {f.name: _guardrail_value(f.name, f.default) for f in fields(GuardrailConfig)},
    "state": {
        "db_path": _path,
        "group": _optional_group,
        "policy_state_interval_s": _duration_or_zero,
    },
    "metrics": {"listen": _listen},
    "control": {"listen": _listen, "token_env": _env_name, "token_file": _token_file},
    "recommend": {"enabled": _bool, "interval_s": _duration, "apply_command": _argv},
    "deployment": {"gpu": _catalog_name, "model": _catalog_name, "drafter": _catalog_name},
    "log": {"format": _choice(LOG_FORMATS), "level": _log_level},
}
SIMPLE_GROUPS: Final[dict[str, type]] = {
    "server": ServerConfig,
    "spool": SpoolConfig,
    "loop": LoopConfig,
    "policy": PolicyConfig,
    "state": StateConfig,
    "metrics": MetricsConfig,
    "control": ControlConfig,
    "recommend": RecommendConfig,
    "deployment": DeploymentConfig,
    "log": LogConfig,
}
GROUPS: Final = tuple(SCHEMA)
