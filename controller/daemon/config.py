"""The daemon's configuration: typed, grouped, validated, with env and CLI overrides.

Sources, lowest to highest precedence:

1. the defaults: the field defaults of the typed groups (:class:`ServerConfig` ...
   :class:`LogConfig` below, :class:`~specgov.policies.guardrails.GuardrailConfig`'s for
   ``guardrails``) and no budget limits (:data:`NO_BUDGET_LIMITS`), collected by
   :func:`default_groups`. They are the one source: the repository's ``config.yaml`` is
   their commented, human-readable copy, and ``tests/test_config.py`` fails unless it has
   exactly the same keys and values. (Why not read ``config.yaml``: the wheel ships Python
   packages only, so the root file is not there at run time, and a typed default is
   checked by mypy and by the group's own validation, a YAML copy by nothing.);
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

Relative paths are kept relative (to the daemon's working directory); ``~`` is expanded.

Bounded input: a config file is at most :data:`CONFIG_MAX_BYTES` (1 MiB), a
``SPECGOV_<GROUP>__<KEY>`` value at most :data:`ENV_VALUE_MAX_CHARS` (16 KiB); YAML
anchors and aliases (``&name``, ``*name``: the alias-expansion "billion laughs" bomb) and
nesting deeper than :data:`YAML_MAX_DEPTH` are refused with the file and line; error
messages quote values elided (:mod:`reprlib`), escape control characters and are cut at
:data:`MESSAGE_MAX_CHARS`.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import os
import re
import reprlib
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Literal, cast
from urllib.parse import urlsplit

import yaml

from specgov.adapters.errors import escape_upstream
from specgov.adapters.spool import SpoolError, default_spool_dir, resolve_gid
from specgov.controller.daemon.control_token import TOKEN_FILENAME
from specgov.policies.common.types import Budget, PolicyTypeError
from specgov.policies.common.validation import check_real, is_int, is_real
from specgov.policies.daemon.spec import PolicySpec, PolicySpecError, parse_policy_spec
from specgov.policies.guardrails import GuardrailConfig, GuardrailError

ENV_PREFIX: Final = "SPECGOV_"
ENV_SEPARATOR: Final = "__"
DEFAULTS_LABEL: Final = "packaged defaults"
CLI_LABEL: Final = "command line"

LoopMode = Literal["observe", "plugin"]
LogFormat = Literal["text", "json"]
LOOP_MODES: Final[tuple[LoopMode, ...]] = ("observe", "plugin")
LOG_FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Input bounds (module docstring). The packaged config.yaml is about 9 KB and no value
# needs more than a few hundred characters, so these only stop abuse and accidents.
CONFIG_MAX_BYTES: Final = 1024 * 1024
ENV_VALUE_MAX_CHARS: Final = 16 * 1024
YAML_MAX_DEPTH: Final = 16
MESSAGE_MAX_CHARS: Final = 2000
MAX_PROBLEMS: Final = 50  # errors listed by one failed load (the rest are counted)


class ConfigError(ValueError):
    """Bad configuration; the message names the source, key path, value and expected form.

    ``problems``: one printable line per error found (at most about
    :data:`MESSAGE_MAX_CHARS` characters each, control characters escaped, the rest cut
    with a marker; at most :data:`MAX_PROBLEMS` of them, then how many more). The message
    is the one line, or ``N errors:`` and one indented line per error.
    """

    def __init__(self, message: str | Sequence[str]) -> None:
        found = [message] if isinstance(message, str) else list(message)
        lines = [escape_upstream(m, MESSAGE_MAX_CHARS) for m in found[:MAX_PROBLEMS]]
        if len(found) > MAX_PROBLEMS:
            lines.append(f"... and {len(found) - MAX_PROBLEMS} more errors")
        self.problems: tuple[str, ...] = tuple(lines)
        if len(found) == 1:
            text = lines[0]
        else:
            text = f"{len(found)} errors:\n" + "\n".join(f"  {line}" for line in lines)
        super().__init__(text)


class _Problems:
    """Errors found while loading, so that one run reports every one of them."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def add(self, exc: ConfigError) -> None:
        self.found.extend(exc.problems)

    def raise_any(self) -> None:
        if self.found:
            raise ConfigError(self.found)


_SHOW: Final = reprlib.Repr()
_SHOW.maxlevel = 3
_SHOW.maxstring = 200
_SHOW.maxother = 200
_SHOW.maxlong = 40
for _limit in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque"):
    setattr(_SHOW, _limit, 12)


def _show(value: object) -> str:
    """``repr(value)`` for a message, elided: a huge value is never rendered whole."""
    return _SHOW.repr(value)


# ----------------------------------------------------------------------- value forms

DURATION_FORM: Final = "a duration like '5s', '250ms', '5m', '1h', '1d' or a number of seconds"
_DURATION_RE: Final = re.compile(
    r"(?P<num>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>ms|s|m|h|d)?"
)
_UNIT_S: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_ENV_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CATALOG_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.+-]+")
_HOSTNAME_RE: Final = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
LISTEN_FORM: Final = "'HOST:PORT' like '127.0.0.1:9465' or '[::1]:9465' (port 0-65535)"


def parse_duration(value: object, *, where: str = "duration", allow_zero: bool = False) -> float:
    """Seconds from ``"30s"``, ``"250ms"``, ``"5m"``, ``"1h"``, ``"1d"``, ``"30"`` or a number.

    Must be finite and > 0 (>= 0 with ``allow_zero``). Raises :class:`ConfigError`
    ``"{where}: expected ..., got {_show(value)}"``; the CLI uses it for ``--ttl`` and friends.
    """
    seconds: float | None = None
    if is_real(value):  # finite: NaN, inf and ints beyond float range are refused below
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.fullmatch(value.strip())
        if match is not None:
            seconds = float(match["num"]) * _UNIT_S[match["unit"]]
    ok = seconds is not None and math.isfinite(seconds) and seconds >= 0.0
    ok = ok and (allow_zero or cast(float, seconds) > 0.0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{where}: expected {DURATION_FORM} {bound}, got {_show(value)}")
    return cast(float, seconds)


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A ``HOST:PORT`` to listen on (or connect to); port 0 picks a free port."""

    host: str
    port: int

    @property
    def is_loopback(self) -> bool:
        """True only for addresses that cannot be reached from another machine."""
        if self.host.lower().rstrip(".") == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # another host name: it may resolve to anything

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen_address(value: object, *, where: str = "address") -> ListenAddress:
    """``"127.0.0.1:9465"``, ``"[::1]:9465"``, ``"localhost:9465"`` -> ListenAddress."""

    def bad(why: str = "") -> ConfigError:
        return ConfigError(f"{where}: expected {LISTEN_FORM}{why}, got {_show(value)}")

    if not isinstance(value, str):
        raise bad()
    text = value.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isascii() or not port_text.isdigit():
        raise bad()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(" (not an IPv6 address in the brackets)") from None
    elif ":" in host:
        raise bad(" (an IPv6 address needs brackets)")
    elif all(part.isdigit() for part in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise bad(" (not an IPv4 address)") from None
    elif not _HOSTNAME_RE.fullmatch(host):
        raise bad(" (not a host name)")
    port = int(port_text)
    if port > 65535:
        raise bad(" (port out of range)")
    return ListenAddress(host=host, port=port)


# ------------------------------------------------------------------------- the groups


# Each group's field defaults are the daemon's defaults (module docstring); config.yaml
# documents them key by key and must say the same.


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The SGLang server this daemon governs."""

    url: str = "http://127.0.0.1:30000"  # 30000: SGLang's default --port
    api_key_env: str | None = "SPECGOV_SGLANG_API_KEY"
    timeout_s: float = 5.0

    def api_key(self, env: Mapping[str, str] = os.environ) -> str | None:
        """The key from the named variable; None when not configured, unset or empty."""
        if self.api_key_env is None:
            return None
        return env.get(self.api_key_env) or None


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
    listen: ListenAddress = ListenAddress("127.0.0.1", 9464)


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control API; a token is required whenever ``listen`` is not loopback."""

    listen: ListenAddress = ListenAddress("127.0.0.1", 9465)
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
        if self.token_env is None:
            return None
        return env.get(self.token_env) or None


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
        return GuardrailConfig.from_dict(self.guardrails, where="guardrails")

    @property
    def control_token_path(self) -> Path | None:
        """The control token file (``control.token_file``, ``auto`` resolved); None: no
        token file (the operator opted out)."""
        path = self.control.token_file
        if path == "auto":
            return self.state.db_path.parent / TOKEN_FILENAME
        return path


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
        raise ConfigError(f"{where}: expected true or false, got {_show(value)}")
    return value


def _choice(options: tuple[str, ...]) -> _Validator:
    def check(value: object, where: str) -> str:
        if not isinstance(value, str) or value not in options:
            raise ConfigError(f"{where}: expected one of {', '.join(options)}, got {_show(value)}")
        return value

    return check


def _log_level(value: object, where: str) -> str:
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        levels = ", ".join(level.lower() for level in LOG_LEVELS)
        raise ConfigError(f"{where}: expected one of {levels}, got {_show(value)}")
    return value.upper()


def _path(value: object, where: str) -> Path:
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ConfigError(f"{where}: expected a non-empty path, got {_show(value)}")
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
        raise ConfigError(f"{where}: expected a non-empty path or null, got {_show(value)}")
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
        f"{where}: expected a group name, a group id >= 0 or null, got {_show(value)}"
    )


def _catalog_name(value: object, where: str) -> str:
    if not isinstance(value, str) or not _CATALOG_NAME_RE.fullmatch(value):
        raise ConfigError(
            f"{where}: expected a catalog name (letters, digits, '_', '.', '+', '-'), "
            f"got {_show(value)}"
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
        raise ConfigError(f"{where}: expected {form}, got {_show(value)}")
    try:
        parts = urlsplit(value.strip())
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ConfigError(f"{where}: expected {form}, got {_show(value)}") from None
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
        raise ConfigError(f"{where}: expected {form}, got {_show(value)}")
    # No trailing slash, so clients can append "/metrics".
    return value.strip().rstrip("/")


def _policy_spec(value: object, where: str) -> str:
    if isinstance(value, PolicySpec):
        value = value.text
    if not isinstance(value, str):
        raise ConfigError(
            f"{where}: expected a policy spec string like 'goodput', got {_show(value)}"
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
            f"like [0, 1, 3, 5], got {_show(value)}"
        )
    return tuple(steps)


def _argv(value: object, where: str) -> tuple[str, ...] | None:
    form = "an argument list like ['/usr/local/bin/restart-sglang', '--from-specgov'] or null"
    if value is None:
        return None
    if isinstance(value, str):
        raise ConfigError(
            f"{where}: expected {form}, got the string {_show(value)}: a command line would need "
            f"a shell to split it, and specgov never runs one"
        )
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{where}: expected {form}, got {_show(value)}")
    for i, arg in enumerate(value):
        if not isinstance(arg, str) or not arg or "\0" in arg:
            raise ConfigError(f"{where}[{i}]: expected a non-empty string, got {_show(arg)}")
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


_SCHEMA: Final[dict[str, dict[str, _Validator]]] = {
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
_SIMPLE_GROUPS: Final[dict[str, type]] = {
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
GROUPS: Final = tuple(_SCHEMA)


def config_keys() -> dict[str, tuple[str, ...]]:
    """Every group and its keys, in file order."""
    return {group: tuple(keys) for group, keys in _SCHEMA.items()}


# ------------------------------------------------------------------------- the layers


@dataclass(frozen=True, slots=True)
class _Raw:
    value: object
    origin: str  # "FILE:LINE", "env NAME", "command line" or DEFAULTS_LABEL


_Layer = dict[str, dict[str, _Raw]]


def _unknown_group(group: object) -> str:
    return f"unknown group {_show(group)}; valid groups: {', '.join(GROUPS)}"


def _unknown_key(group: str, key: object) -> str:
    return f"unknown key {group}.{key}; valid keys of {group}: {', '.join(_SCHEMA[group])}"


def _yaml_error(label: str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f"{label}:{mark.line + 1}:{mark.column + 1}" if mark is not None else label
    detail = f"{problem} ({context})" if context else problem
    return ConfigError(f"{where}: invalid YAML: {detail}")


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors, aliases and deep nesting while composing, before
    any expansion: an alias bomb costs nothing but its own bytes."""

    def __init__(self, text: str, label: str) -> None:
        super().__init__(text)
        self._label = label
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]  # stub lacks it
        line = event.start_mark.line + 1 if event.start_mark is not None else 0
        if isinstance(event, yaml.AliasEvent):
            raise ConfigError(
                f"{self._label}:{line}: YAML alias '*{_show_name(event.anchor)}' is not "
                f"allowed in a specgov config (anchors and aliases are refused: they let a "
                f"small file expand without bound); write the value out"
            )
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise ConfigError(
                f"{self._label}:{line}: YAML anchor '&{_show_name(anchor)}' is not allowed "
                f"in a specgov config (anchors and aliases are refused: they let a small "
                f"file expand without bound); write the value out"
            )
        if isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            if self._depth >= YAML_MAX_DEPTH:
                raise ConfigError(
                    f"{self._label}:{line}: YAML nested deeper than {YAML_MAX_DEPTH} levels; "
                    f"a specgov config needs at most 3 (group, key, list)"
                )
            self._depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)


def _new_loader(text: str, label: str) -> _BoundedLoader:
    try:
        return _BoundedLoader(text, label)
    except yaml.reader.ReaderError as exc:  # a character YAML forbids, found up front
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        raise ConfigError(
            f"{label}:{line}: invalid YAML: {exc.reason} (character U+{exc.character:04X})"
        ) from None


def _show_name(anchor: object) -> str:
    return escape_upstream(anchor, 40)


def _yaml_layer(text: str, label: str, problems: _Problems) -> _Layer:
    """Parse a config document keeping each key's line. Unknown and duplicate groups and
    keys are added to ``problems`` and skipped, so the rest is still checked; a YAML
    syntax error ends the parse (ConfigError)."""
    loader = _new_loader(text, label)
    try:
        root = loader.get_single_node()
        layer: _Layer = {}
        if root is None or (isinstance(root, yaml.ScalarNode) and root.tag.endswith(":null")):
            return layer
        if not isinstance(root, yaml.MappingNode):
            raise ConfigError(
                f"{label}:{root.start_mark.line + 1}: expected a mapping of groups "
                f"({', '.join(GROUPS)}) at the top level"
            )
        group_lines: dict[str, int] = {}
        for group_node, body in root.value:
            line = group_node.start_mark.line + 1
            group = _key_of(loader, group_node, label, "")
            if group not in _SCHEMA:
                problems.add(ConfigError(f"{label}:{line}: {_unknown_group(group)}"))
                continue
            if group in group_lines:
                first = group_lines[group]
                problems.add(
                    ConfigError(
                        f"{label}:{line}: duplicate group {_show(group)} (first at line {first})"
                    )
                )
                continue
            group_lines[group] = line
            layer[group] = {}
            if isinstance(body, yaml.ScalarNode) and body.tag.endswith(":null"):
                continue  # "group:" with every key commented out
            if not isinstance(body, yaml.MappingNode):
                problems.add(
                    ConfigError(
                        f"{label}:{line}: {group}: expected a mapping of keys "
                        f"({', '.join(_SCHEMA[group])})"
                    )
                )
                continue
            key_lines: dict[str, int] = {}
            for key_node, value_node in body.value:
                kline = key_node.start_mark.line + 1
                key = _key_of(loader, key_node, label, f"{group}.")
                if key not in _SCHEMA[group]:
                    problems.add(ConfigError(f"{label}:{kline}: {_unknown_key(group, key)}"))
                    continue
                if key in key_lines:
                    problems.add(
                        ConfigError(
                            f"{label}:{kline}: duplicate key {group}.{key} "
                            f"(first at line {key_lines[key]})"
                        )
                    )
                    continue
                key_lines[key] = kline
                value = loader.construct_object(value_node, deep=True)
                layer[group][key] = _Raw(value, f"{label}:{kline}")
        return layer
    except yaml.YAMLError as exc:
        raise _yaml_error(label, exc) from None
    finally:
        loader.dispose()


def _key_of(loader: _BoundedLoader, node: yaml.Node, label: str, prefix: str) -> str:
    line = node.start_mark.line + 1
    if node.tag.endswith(":merge"):
        raise ConfigError(f"{label}:{line}: YAML merge keys ('<<') are not supported")
    key = loader.construct_object(node, deep=True) if isinstance(node, yaml.ScalarNode) else None
    if not isinstance(key, str):
        raise ConfigError(f"{label}:{line}: expected a key name under {prefix or 'the top'}")
    return key


def _env_layer(env: Mapping[str, str], problems: _Problems) -> _Layer:
    layer: _Layer = {}
    for name in sorted(env):
        rest = name[len(ENV_PREFIX) :]
        if not name.startswith(ENV_PREFIX) or ENV_SEPARATOR not in rest:
            continue  # not a config override (module docstring)
        try:
            group, key, value = _env_entry(name, rest, env[name])
        except ConfigError as exc:
            problems.add(exc)
            continue
        layer.setdefault(group, {})[key] = _Raw(value, f"env {name}")
    return layer


def _env_entry(name: str, rest: str, text: str) -> tuple[str, str, object]:
    group_part, _, key_part = rest.partition(ENV_SEPARATOR)
    group, key = group_part.lower(), key_part.lower()
    form = "SPECGOV_<GROUP>__<KEY>"
    if group not in _SCHEMA:
        raise ConfigError(f"env {name}: {form}: {_unknown_group(group)}")
    if key not in _SCHEMA[group]:
        raise ConfigError(f"env {name}: {form}: {_unknown_key(group, key)}")
    if len(text) > ENV_VALUE_MAX_CHARS:
        raise ConfigError(
            f"env {name}: the value has {len(text)} characters; a config override "
            f"holds at most {ENV_VALUE_MAX_CHARS}"
        )
    return group, key, _env_value(text, f"env {name}")


def _env_value(text: str, label: str) -> object:
    """One environment value read as YAML, with the file's bounds (no aliases, depth)."""
    loader = _new_loader(text, label)
    try:
        node = loader.get_single_node()
        return None if node is None else loader.construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"{label}: cannot read the value as YAML ({problem})") from None
    finally:
        loader.dispose()


def _override_layer(overrides: Mapping[str, Any]) -> _Layer:
    layer: _Layer = {}
    for dotted, value in overrides.items():
        group, dot, key = str(dotted).partition(".")
        if not dot or group not in _SCHEMA:
            raise ConfigError(
                f"{CLI_LABEL}: override {_show(dotted)}: expected GROUP.KEY like 'loop.mode'; "
                f"{_unknown_group(group)}"
            )
        if key not in _SCHEMA[group]:
            raise ConfigError(f"{CLI_LABEL}: override {_show(dotted)}: {_unknown_key(group, key)}")
        layer.setdefault(group, {})[key] = _Raw(value, CLI_LABEL)
    return layer


def _defaults_layer() -> _Layer:
    # As plain data, the form a file gives, so the defaults pass the same validators.
    defaults = default_groups()
    return {
        group: {key: _Raw(_plain(getattr(defaults[group], key)), DEFAULTS_LABEL) for key in keys}
        for group, keys in _SCHEMA.items()
    }


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
    merged = _defaults_layer()
    problems = _Problems()  # every error of the file, the environment and the values
    layers: list[_Layer] = []
    if path is not None:
        label = str(path)
        text = _read_config_text(Path(path), label)
        layers.append(_yaml_layer(text, label, problems))
    layers.append(_env_layer(env, problems))
    layers.append(_override_layer(overrides))
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
        f"{group}.{key}: {_show(value)} -> {_show(after[group][key])} "
        f"({new.sources.get(f'{group}.{key}', DEFAULTS_LABEL)})"
        for group, keys in before.items()
        for key, value in keys.items()
        if after[group][key] != value
    ]


def _read_config_text(path: Path, label: str) -> str:
    """The file's text; at most CONFIG_MAX_BYTES are read, whatever the file's size."""
    try:
        with path.open("rb") as file:
            data = file.read(CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{label}: cannot read: {exc.strerror or exc}") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise ConfigError(
            f"{label}: the file is larger than {CONFIG_MAX_BYTES} bytes (1 MiB), the most a "
            f"specgov config may hold"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label}: not UTF-8 text ({exc.reason})") from None


def _build(merged: _Layer, path: Path | None, problems: _Problems) -> SpecgovConfig | None:
    """The typed config; every bad value is added to ``problems`` (None when any was)."""
    groups: dict[str, Any] = {}
    sources: dict[str, str] = {}
    before = len(problems.found)
    for group, schema in _SCHEMA.items():
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


def _build_group(group: str, values: dict[str, Any], raw: Mapping[str, _Raw]) -> Any:
    if group == "guardrails":
        return _build_guardrails(values, raw)
    if group == "budget":
        try:
            return Budget(**values)
        except (PolicyTypeError, TypeError) as exc:  # pragma: no cover - checked above
            raise ConfigError(f"budget: {exc}") from None
    return _SIMPLE_GROUPS[group](**values)


def _build_guardrails(values: Mapping[str, Any], raw: Mapping[str, _Raw]) -> Mapping[str, Any]:
    try:
        checked = GuardrailConfig.from_dict(values, where="guardrails").to_dict()
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


def _plain(value: object) -> Any:
    if isinstance(value, Path | ListenAddress):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def effective_config_dict(config: SpecgovConfig) -> dict[str, dict[str, Any]]:
    """The configuration as plain YAML/JSON data, groups and keys in file order.

    Durations are seconds, paths and addresses strings. It holds no secret (the config
    only names their variables; :func:`secret_status` says whether they are set), and
    ``load_config`` of this data, dumped to a file, gives back an equal config.
    """
    out: dict[str, dict[str, Any]] = {}
    for group, keys in _SCHEMA.items():
        obj = getattr(config, group)
        if isinstance(obj, Mapping):
            out[group] = {key: _plain(obj[key]) for key in keys}
        else:
            out[group] = {key: _plain(getattr(obj, key)) for key in keys}
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
