"""The daemon's configuration: defaults, documentation, overrides, errors, CLI."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from specgov.adapters.spool import default_spool_dir
from specgov.controller.cli.config_cmd import config_group
from specgov.controller.daemon.config import (
    SpecgovConfig,
    check_secrets,
    effective_config_dict,
    load_config,
    secret_status,
)
from specgov.controller.daemon.config_layers import DEFAULTS_LABEL
from specgov.controller.daemon.config_schema import (
    NO_BUDGET_LIMITS,
    SCHEMA,
    StateConfig,
    default_groups,
)
from specgov.controller.daemon.config_values import (
    MAX_PROBLEMS,
    ConfigError,
    ListenAddress,
    parse_duration,
    parse_listen_address,
)
from specgov.policies.common.codec import to_data
from specgov.policies.common.types import Budget
from specgov.policies.daemon.spec import parse_policy_spec
from specgov.policies.guardrails import GuardrailConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_YAML = REPO_ROOT / "config.yaml"
# Every group and its keys, in file order (the schema the config loader walks).
CONFIG_KEYS = {group: tuple(keys) for group, keys in SCHEMA.items()}
SECRET = "s3cr3t-TOKEN-value-0123456789"
NO_ENV: dict[str, str] = {}


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load_text(tmp_path: Path, text: str, **kwargs: Any) -> SpecgovConfig:
    kwargs.setdefault("env", NO_ENV)
    return load_config(write(tmp_path, text), **kwargs)


# ------------------------------------------------------------------------ defaults


def test_defaults_load_with_the_documented_values() -> None:
    cfg = load_config(None, env=NO_ENV)
    assert cfg.server.url == "http://127.0.0.1:30000"
    assert cfg.server.api_key_env == "SPECGOV_SGLANG_API_KEY"
    assert cfg.server.timeout_s == 5.0
    assert cfg.loop.mode == "observe"
    assert (cfg.loop.scrape_interval_s, cfg.loop.decide_interval_s) == (1.0, 5.0)
    assert cfg.policy.spec == "goodput"
    assert cfg.policy.parsed() == parse_policy_spec("goodput")
    assert cfg.budget == Budget(None, None, None, None, None) == NO_BUDGET_LIMITS
    assert cfg.metrics.listen == ListenAddress("127.0.0.1", 9464)
    assert cfg.control.listen == ListenAddress("127.0.0.1", 9465)
    assert cfg.control.token_env == "SPECGOV_CONTROL_TOKEN"
    assert not cfg.control.token_required
    assert cfg.recommend.enabled and cfg.recommend.interval_s == 3600.0
    assert cfg.recommend.apply_command is None
    assert (cfg.log.format, cfg.log.level) == ("text", "INFO")
    assert (cfg.deployment.gpu, cfg.deployment.model, cfg.deployment.drafter) == (
        "h100",
        "llama-3.1-8b",
        "eagle3",
    )
    assert cfg.spool.dir == default_spool_dir() and not str(cfg.spool.dir).startswith("/tmp")
    assert cfg.spool.group is None
    assert cfg.state.db_path == Path("~/.local/state/specgov/state.db").expanduser()
    assert cfg.source_path is None
    assert set(cfg.sources.values()) == {DEFAULTS_LABEL}


def test_config_yaml_is_exactly_the_built_in_defaults() -> None:
    # The defaults are the typed groups' (controller/daemon/config_schema.py); config.yaml is their
    # commented copy: every key, no other, and the same value for each.
    raw = yaml.safe_load(CONFIG_YAML.read_text(encoding="utf-8"))
    assert {group: tuple(keys) for group, keys in raw.items()} == CONFIG_KEYS
    from_file = load_config(CONFIG_YAML, env=NO_ENV)
    built_in = load_config(None, env=NO_ENV)
    assert from_file == built_in
    assert effective_config_dict(from_file) == effective_config_dict(built_in)
    # Every value came from the file (none filled in from the defaults).
    assert all(origin.startswith(f"{CONFIG_YAML}:") for origin in from_file.sources.values())
    assert len(from_file.sources) == sum(len(keys) for keys in CONFIG_KEYS.values())


def test_the_defaults_are_the_typed_groups_field_defaults() -> None:
    cfg = load_config(None, env=NO_ENV)
    for group, default in default_groups().items():
        names = {f.name for f in fields(type(default))}
        assert set(CONFIG_KEYS[group]) == names, group
        if group == "guardrails":
            assert cfg.guardrail_config() == default
        elif group == "state":
            assert cfg.state == StateConfig(StateConfig().db_path.expanduser())
        else:
            assert getattr(cfg, group) == default, group


def _yaml_keys(text: str) -> list[tuple[int, str, str]]:
    """(line index, indent, dotted key) of every key line of config.yaml."""
    out: list[tuple[int, str, str]] = []
    group = ""
    for i, line in enumerate(text.splitlines()):
        match = re.match(r"^( *)([a-z0-9_]+):", line)
        if not match:
            continue
        if match[1]:
            out.append((i, match[1], f"{group}.{match[2]}"))
        else:
            group = match[2]
            out.append((i, "", group))
    return out


def test_config_yaml_lists_every_key_in_schema_order() -> None:
    text = CONFIG_YAML.read_text(encoding="utf-8")
    expected: list[str] = []
    for group, keys in CONFIG_KEYS.items():
        expected += [group, *(f"{group}.{k}" for k in keys)]
    assert [dotted for _, _, dotted in _yaml_keys(text)] == expected


def test_every_key_in_config_yaml_is_documented() -> None:
    lines = CONFIG_YAML.read_text(encoding="utf-8").splitlines()
    undocumented = []
    for i, indent, dotted in _yaml_keys("\n".join(lines)):
        above = lines[i - 1] if i > 0 else ""
        commented_above = above.startswith(indent + "#")
        if not (commented_above or " # " in lines[i]):
            undocumented.append(dotted)
    assert undocumented == []


def test_config_yaml_guardrails_are_the_policy_layer_defaults() -> None:
    data = yaml.safe_load(CONFIG_YAML.read_text(encoding="utf-8"))
    assert GuardrailConfig.from_dict(data["guardrails"]) == GuardrailConfig()
    cfg = load_config(None, env=NO_ENV)
    assert cfg.guardrail_config() == GuardrailConfig()
    assert dict(cfg.guardrails) == {
        **to_data(GuardrailConfig()),
        "required_fields": GuardrailConfig().required_fields,
    }


def test_the_ttl_poll_and_flush_defaults_are_each_defined_once() -> None:
    """config.yaml, the docs and every user of the 30 s TTL, the poll-every-64 and the
    1 s flush cadence take them from one constant each."""
    import inspect

    from specgov.adapters.sglang_plugin import SpecgovAdaptiveParams
    from specgov.controller.daemon.health import HealthInputs
    from specgov.policies.engine.table import (
        DEFAULT_FLUSH_INTERVAL_S,
        DEFAULT_POLL_EVERY_BATCHES,
        TablePolicy,
    )
    from specgov.policies.guardrails import DEFAULT_TABLE_TTL_S
    from specgov.simulator.replay.closed_loop import ControlLoopConfig
    from specgov.simulator.server.core import SimServer

    data = yaml.safe_load(CONFIG_YAML.read_text(encoding="utf-8"))
    assert data["guardrails"]["table_ttl_s"] == DEFAULT_TABLE_TTL_S
    assert GuardrailConfig().table_ttl_s == DEFAULT_TABLE_TTL_S
    assert HealthInputs.__dataclass_fields__["table_ttl_s"].default == DEFAULT_TABLE_TTL_S
    ops = (REPO_ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert f"(`guardrails.table_ttl_s`, {DEFAULT_TABLE_TTL_S:g} s)" in ops
    table = inspect.signature(TablePolicy).parameters
    plugin = inspect.signature(SpecgovAdaptiveParams).parameters
    assert table["poll_every_batches"].default == DEFAULT_POLL_EVERY_BATCHES == 64
    assert plugin["poll_every_batches"].default == DEFAULT_POLL_EVERY_BATCHES
    assert ControlLoopConfig().poll_every_batches == DEFAULT_POLL_EVERY_BATCHES
    assert table["flush_interval_s"].default == DEFAULT_FLUSH_INTERVAL_S == 1.0
    assert plugin["flush_interval_s"].default == DEFAULT_FLUSH_INTERVAL_S
    assert ControlLoopConfig().stats_flush_s == DEFAULT_FLUSH_INTERVAL_S
    sim = inspect.signature(SimServer).parameters
    assert sim["stats_interval_s"].default == DEFAULT_FLUSH_INTERVAL_S


def test_an_empty_or_partial_file_keeps_the_other_defaults(tmp_path: Path) -> None:
    assert load_text(tmp_path, "") == load_config(None, env=NO_ENV)
    assert load_text(tmp_path, "# nothing\nloop:\n") == load_config(None, env=NO_ENV)
    cfg = load_text(tmp_path, "loop:\n  mode: plugin\n  decide_interval_s: 2s\n")
    assert cfg.loop.mode == "plugin" and cfg.loop.decide_interval_s == 2.0
    assert cfg.loop.scrape_interval_s == 1.0
    path = str(tmp_path / "cfg.yaml")
    assert cfg.sources["loop.mode"] == f"{path}:2"
    assert cfg.sources["loop.decide_interval_s"] == f"{path}:3"
    assert cfg.sources["server.url"] == DEFAULTS_LABEL
    assert cfg.source_path == Path(path)


# ---------------------------------------------------------------------- round trips

CUSTOM = """\
server:
  url: https://sglang.internal:8443/
  api_key_env: null
  timeout_s: 250ms
spool:
  dir: null
loop:
  scrape_interval_s: 0.5
  decide_interval_s: 2s
policy:
  spec: "static:3"
budget:
  vram_gib: 80
  slo_tpot_ms: 40
  slo_itl_p99_ms: 120.5
  slo_ttft_p99_ms: 2000
  allowed_steps: [0, 1, 3, 5]
guardrails:
  min_gain: 0.05
  min_dwell_s: 1m
  max_dwell_s: 2h
  required_fields: [slot_candidates, tier_stats]
state:
  db_path: relative/state.db
metrics:
  listen: "[::1]:0"
control:
  listen: 0.0.0.0:9465
  token_env: MY_TOKEN
recommend:
  enabled: false
  interval_s: 30m
  apply_command: [/usr/local/bin/restart-sglang, --reason, "from specgov"]
deployment:
  gpu: h200
  model: qwen3-8b
  drafter: standalone-llama-3.2-1b
log:
  format: json
  level: Debug
"""


def test_custom_values_are_typed(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, CUSTOM)
    assert cfg.server.url == "https://sglang.internal:8443"
    assert cfg.server.api_key_env is None and cfg.server.api_key({"X": "y"}) is None
    assert cfg.server.timeout_s == pytest.approx(0.25)
    assert cfg.spool.dir is None
    assert cfg.policy.spec == "static:3"
    assert cfg.budget == Budget(80.0, 40.0, 120.5, 2000.0, (0, 1, 3, 5))
    guard = cfg.guardrail_config()
    assert (guard.min_gain, guard.min_dwell_s, guard.max_dwell_s) == (0.05, 60.0, 7200.0)
    assert guard.required_fields == ("slot_candidates", "tier_stats")
    assert guard.table_ttl_s == GuardrailConfig().table_ttl_s
    assert cfg.state.db_path == Path("relative/state.db")
    assert cfg.metrics.listen == ListenAddress("::1", 0)
    assert cfg.control.listen == ListenAddress("0.0.0.0", 9465)
    assert cfg.control.token_required
    assert cfg.recommend.apply_command == (
        "/usr/local/bin/restart-sglang",
        "--reason",
        "from specgov",
    )
    assert cfg.recommend.interval_s == 1800.0
    assert cfg.deployment.drafter == "standalone-llama-3.2-1b"
    assert (cfg.log.format, cfg.log.level) == ("json", "DEBUG")


@pytest.mark.parametrize("text", ["", CUSTOM])
@pytest.mark.parametrize("dump", ["yaml", "json"])
def test_effective_config_round_trips(tmp_path: Path, text: str, dump: str) -> None:
    cfg = load_text(tmp_path, text)
    data = effective_config_dict(cfg)
    out = yaml.safe_dump(data, sort_keys=False) if dump == "yaml" else json.dumps(data)
    again = load_config(write(tmp_path, out, "again.yaml"), env=NO_ENV)
    assert again == cfg
    assert effective_config_dict(again) == data
    assert list(data) == list(CONFIG_KEYS)


# --------------------------------------------------------------------------- errors


def _error(tmp_path: Path, text: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text, **kwargs)
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "loop:\n  decide_interval_s: soon\n",
            "cfg.yaml:2: loop.decide_interval_s: expected a duration like '5s', '250ms', "
            "'5m', '1h', '1d' or a number of seconds > 0, got 'soon'",
        ),
        ("server:\n  timeout_s: -1\n", "cfg.yaml:2: server.timeout_s: expected a duration"),
        ("server:\n  timeout_s: 0\n", "server.timeout_s: expected a duration"),
        (
            "state:\n  policy_state_interval_s: -1\n",
            "cfg.yaml:2: state.policy_state_interval_s: expected a duration like '5s', "
            "'250ms', '5m', '1h', '1d' or a number of seconds >= 0, got -1",
        ),
        ("loop:\n  mode: fast\n", "loop.mode: expected one of observe, plugin, got 'fast'"),
        ("budget:\n  vram_gib: lots\n", "budget.vram_gib: expected a number of GiB > 0 or null"),
        ("budget:\n  slo_tpot_ms: 0\n", "budget.slo_tpot_ms: expected a number of milliseconds"),
        ("budget:\n  allowed_steps: [3, 1]\n", "budget.allowed_steps: expected null or a"),
        ("budget:\n  allowed_steps: []\n", "strictly increasing ints >= 0"),
        ("budget:\n  allowed_steps: [true]\n", "strictly increasing ints >= 0"),
        ("metrics:\n  listen: 9464\n", "metrics.listen: expected 'HOST:PORT'"),
        ("metrics:\n  listen: ':9464'\n", "metrics.listen: expected 'HOST:PORT'"),
        ("metrics:\n  listen: 127.0.0.1:70000\n", "(port out of range), got"),
        ("metrics:\n  listen: '::1:9464'\n", "(an IPv6 address needs brackets)"),
        ("metrics:\n  listen: 300.1.2.3:80\n", "(not an IPv4 address)"),
        ("control:\n  listen: 'bad host:1'\n", "control.listen: expected 'HOST:PORT'"),
        ("server:\n  url: ftp://127.0.0.1:30000\n", "server.url: expected an http(s) base URL"),
        ("server:\n  url: http://127.0.0.1:notaport\n", "server.url: expected an http(s)"),
        ("log:\n  format: xml\n", "log.format: expected one of text, json, got 'xml'"),
        ("log:\n  level: loud\n", "log.level: expected one of debug, info, warning"),
        ("policy:\n  spec: 'static:x'\n", "cfg.yaml:2: policy.spec: static:x: parameter"),
        ("policy:\n  spec: 'magic'\n", "policy.spec: magic: unknown policy kind 'magic'"),
        ("policy:\n  spec: 3\n", "policy.spec: expected a policy spec string"),
        ("guardrails:\n  min_gain: -1\n", "cfg.yaml:2: guardrails.min_gain: expected"),
        ("guardrails:\n  min_dwell_s: soon\n", "cfg.yaml:2: guardrails.min_dwell_s: expected a"),
        (
            "guardrails:\n  min_dwell_s: 10\n  max_dwell_s: 5\n",
            "cfg.yaml:3: guardrails.max_dwell_s: expected >= min_dwell_s",
        ),
        ("deployment:\n  gpu: 5\n", "deployment.gpu: expected a catalog name"),
        ("state:\n  db_path: ''\n", "state.db_path: expected a non-empty path"),
        ("recommend:\n  enabled: 1\n", "recommend.enabled: expected true or false, got 1"),
        ("recommend:\n  apply_command: []\n", "recommend.apply_command: expected an argument"),
        ("recommend:\n  apply_command: [run, '']\n", "recommend.apply_command[1]: expected"),
    ],
)
def test_bad_values_name_file_line_key_value_and_form(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert expected in _error(tmp_path, text)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("serve:\n  url: x\n", r"cfg\.yaml:1: unknown group 'serve'; valid groups: server, "),
        ("loop:\n  mode: observe\n  modee: plugin\n", r"cfg\.yaml:3: unknown key loop\.modee;"),
        ("guardrails:\n  bogus: 1\n", r"unknown key guardrails\.bogus; valid keys .*min_gain"),
        ("loop:\n  mode: observe\n  mode: plugin\n", r"duplicate key loop\.mode \(first at line 2"),
        ("loop: {}\nloop: {}\n", r"cfg\.yaml:2: duplicate group 'loop'"),
        ("- a\n- b\n", r"cfg\.yaml:1: expected a mapping of groups"),
        ("loop: fast\n", r"cfg\.yaml:1: loop: expected a mapping of keys"),
        ("loop:\n  mode: [observe\n", r"cfg\.yaml:\d+:\d+: invalid YAML: "),
        ("loop:\n\tmode: plugin\n", r"cfg\.yaml:2:1: invalid YAML: "),
        ("base: &b {mode: plugin}\n", r"cfg\.yaml:1: YAML anchor '&b' is not allowed"),
        ("loop:\n  <<: {mode: plugin}\n", r"cfg\.yaml:2: YAML merge keys"),
        ("loop:\n  mode: !!python/name:os.system\n", r"cfg\.yaml:2:\d+: invalid YAML: "),
        ("a: 1\n---\nb: 2\n", r"cfg\.yaml:\d+:\d+: invalid YAML: "),
    ],
)
def test_structure_and_syntax_errors(tmp_path: Path, text: str, pattern: str) -> None:
    assert re.search(pattern, _error(tmp_path, text))


def test_budget_allow_lossy_is_not_a_key(tmp_path: Path) -> None:
    # The knob was dead (nothing applied it): a file, variable or flag naming it fails.
    expected = "unknown key budget.allow_lossy; valid keys of budget: vram_gib, "
    assert f"cfg.yaml:2: {expected}" in _error(tmp_path, "budget:\n  allow_lossy: false\n")
    with pytest.raises(ConfigError, match=r"^env SPECGOV_BUDGET__ALLOW_LOSSY: .*allow_lossy"):
        load_config(None, env={"SPECGOV_BUDGET__ALLOW_LOSSY": "true"})
    with pytest.raises(ConfigError, match=r"^command line: override 'budget\.allow_lossy'"):
        load_config(None, env=NO_ENV, overrides={"budget.allow_lossy": True})
    assert "allow_lossy" not in effective_config_dict(load_config(None, env=NO_ENV))["budget"]


def test_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read"):
        load_config(tmp_path / "missing.yaml", env=NO_ENV)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path, env=NO_ENV)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"loop:\n  mode: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"bin\.yaml: not UTF-8"):
        load_config(binary, env=NO_ENV)


def test_apply_command_as_a_shell_string_is_rejected(tmp_path: Path) -> None:
    message = _error(tmp_path, "recommend:\n  apply_command: systemctl restart sglang\n")
    assert "recommend.apply_command: expected an argument list" in message
    assert "never runs one" in message and "'systemctl restart sglang'" in message
    with pytest.raises(ConfigError, match="never runs one"):
        load_config(None, env=NO_ENV, overrides={"recommend.apply_command": "restart.sh"})


def test_non_loopback_control_listen_needs_a_token_env(tmp_path: Path) -> None:
    message = _error(tmp_path, "control:\n  listen: 0.0.0.0:9465\n  token_env: null\n")
    assert "control.token_env: control.listen 0.0.0.0:9465 is not a loopback address" in message
    for addr in ("10.1.2.3:1", "example.com:9465", "[::]:9465"):
        with pytest.raises(ConfigError, match=r"control\.token_env"):
            load_config(
                None,
                env=NO_ENV,
                overrides={"control.listen": addr, "control.token_env": None},
            )
    # Loopback needs none.
    for addr in ("127.0.0.1:1", "127.8.9.10:2", "[::1]:3", "localhost:4"):
        cfg = load_config(None, env=NO_ENV, overrides={"control.listen": addr})
        assert not cfg.control.token_required


def test_a_required_token_must_be_set_to_run(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, "control:\n  listen: 0.0.0.0:9465\n  token_env: MY_TOKEN\n")
    with pytest.raises(ConfigError) as info:
        check_secrets(cfg, {"MY_TOKEN": ""})
    assert "MY_TOKEN must hold the API token, but it is unset or empty" in str(info.value)
    check_secrets(cfg, {"MY_TOKEN": SECRET})
    assert cfg.control.token({"MY_TOKEN": SECRET}) == SECRET
    check_secrets(load_config(None, env=NO_ENV), NO_ENV)  # loopback: optional


def test_plugin_mode_needs_a_spool_dir(tmp_path: Path) -> None:
    message = _error(tmp_path, "spool:\n  dir: null\nloop:\n  mode: plugin\n")
    assert "cfg.yaml:2: spool.dir: loop.mode plugin publishes step tables" in message


def test_decide_interval_must_leave_time_to_reissue_the_table(tmp_path: Path) -> None:
    message = _error(tmp_path, "loop:\n  decide_interval_s: 20\n")
    assert "cfg.yaml:2: loop.decide_interval_s: expected < guardrails.table_ttl_s" in message
    assert "= 15 s" in message and "got 20 s" in message
    cfg = load_text(tmp_path, "loop:\n  decide_interval_s: 20\nguardrails:\n  table_ttl_s: 2m\n")
    assert cfg.loop.decide_interval_s == 20.0


def test_telemetry_max_age_must_cover_one_scrape_interval(tmp_path: Path) -> None:
    message = _error(tmp_path, "loop:\n  scrape_interval_s: 10s\n  telemetry_max_age_s: 5s\n")
    assert "cfg.yaml:3: loop.telemetry_max_age_s: expected >= " in message
    assert "loop.scrape_interval_s (10 s, from " in message and "cfg.yaml:2)" in message
    assert "got 5 s" in message
    # Through the environment too, and the equal bound is accepted.
    env = {"SPECGOV_LOOP__TELEMETRY_MAX_AGE_S": "0.5"}
    with pytest.raises(ConfigError, match=r"loop\.telemetry_max_age_s: expected >= loop\."):
        load_config(None, env=env)
    cfg = load_text(tmp_path, "loop:\n  scrape_interval_s: 10s\n  telemetry_max_age_s: 10s\n")
    assert cfg.loop.telemetry_max_age_s == cfg.loop.scrape_interval_s == 10.0


def test_secret_looking_values_are_not_echoed(tmp_path: Path) -> None:
    message = _error(tmp_path, f"server:\n  api_key_env: '{SECRET}'\n")
    assert "server.api_key_env: expected the NAME of an environment variable" in message
    assert SECRET not in message
    message = _error(tmp_path, f"server:\n  url: 'http://admin:{SECRET}@127.0.0.1:30000'\n")
    assert "server.url: credentials in the URL are not allowed" in message
    assert SECRET not in message
    message = _error(tmp_path, f"server:\n  url: 'http://127.0.0.1:30000/?key={SECRET}'\n")
    assert "without '?query'" in message and SECRET not in message
    message = _error(tmp_path, "x: 1\n", env={"SPECGOV_SERVER__API_KEY": SECRET})
    assert SECRET not in message


# ----------------------------------------------------------------- value parsers


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("2d", 172800.0),
        ("250ms", 0.25),
        ("1.5h", 5400.0),
        (" 2 s ", 2.0),
        ("30", 30.0),
        ("1e-3", 0.001),
        (2, 2.0),
        (0.5, 0.5),
    ],
)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value, where="x") == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value", ["soon", "", "-1s", "5 min", "2 days", "nan", "inf", 0, -2, True, None, float("inf")]
)
def test_parse_duration_rejects(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^--ttl: expected a duration like '5s'.* > 0, got "):
        parse_duration(value, where="--ttl")


def test_parse_duration_allow_zero() -> None:
    assert parse_duration("0s", allow_zero=True) == 0.0
    with pytest.raises(ConfigError, match=">= 0"):
        parse_duration("-1", allow_zero=True)


@pytest.mark.parametrize(
    ("text", "host", "port", "loopback"),
    [
        ("127.0.0.1:9465", "127.0.0.1", 9465, True),
        ("[::1]:9465", "::1", 9465, True),
        ("localhost:0", "localhost", 0, True),
        ("0.0.0.0:9464", "0.0.0.0", 9464, False),
        ("[::]:1", "::", 1, False),
        ("metrics.example.com:65535", "metrics.example.com", 65535, False),
    ],
)
def test_parse_listen_address(text: str, host: str, port: int, loopback: bool) -> None:
    addr = parse_listen_address(text, where="--control-addr")
    assert (addr.host, addr.port, addr.is_loopback) == (host, port, loopback)
    assert parse_listen_address(str(addr)) == addr


# ---------------------------------------------------------------- env and overrides


def test_env_overrides_are_yaml_values() -> None:
    env = {
        "SPECGOV_LOOP__MODE": "plugin",
        "SPECGOV_LOOP__DECIDE_INTERVAL_S": "2s",
        "SPECGOV_BUDGET__ALLOWED_STEPS": "[0, 1, 3]",
        "SPECGOV_BUDGET__SLO_TPOT_MS": "35",
        "SPECGOV_GUARDRAILS__MIN_GAIN": "0.05",
        "SPECGOV_SERVER__API_KEY_ENV": "null",
        "SPECGOV_RECOMMEND__APPLY_COMMAND": "[/bin/true, --now]",
    }
    cfg = load_config(None, env=env)
    assert cfg.loop.mode == "plugin" and cfg.loop.decide_interval_s == 2.0
    assert cfg.budget.allowed_steps == (0, 1, 3) and cfg.budget.slo_tpot_ms == 35.0
    assert cfg.guardrails["min_gain"] == 0.05
    assert cfg.server.api_key_env is None
    assert cfg.recommend.apply_command == ("/bin/true", "--now")
    assert cfg.sources["loop.mode"] == "env SPECGOV_LOOP__MODE"
    assert cfg.sources["guardrails.min_gain"] == "env SPECGOV_GUARDRAILS__MIN_GAIN"


def test_other_specgov_variables_are_ignored() -> None:
    env = {
        "SPECGOV_SPOOL_DIR": "/elsewhere",
        "SPECGOV_SHARED_DATA": "/data",
        "SPECGOV_SGLANG_SRC": "/src",
        "SPECGOV_REQUIRE_SGLANG": "1",
        "SPECGOV_REQUIRE_SHARED_DATA": "1",
        "SPECGOV_SLOT_CANDIDATES": "1,2",
        "SPECGOV_CONFIG_SHOW_OUTPUT": "json",
        "SPECGOV_CONTROL_TOKEN": SECRET,
        "OTHER__THING": "x",
    }
    assert load_config(None, env=env) == load_config(None, env=NO_ENV)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("SPECGOV_LOOP__MODEE", "plugin", "env SPECGOV_LOOP__MODEE: SPECGOV_<GROUP>__<KEY>: "),
        ("SPECGOV_LOOP__MODEE", "plugin", "unknown key loop.modee; valid keys of loop: mode,"),
        ("SPECGOV_LOOPS__MODE", "plugin", "unknown group 'loops'; valid groups: server,"),
        ("SPECGOV_GUARDRAILS__NOPE", "1", "unknown key guardrails.nope"),
        ("SPECGOV_LOOP__MODE__X", "1", "unknown key loop.mode__x"),
        (
            "SPECGOV_LOOP__DECIDE_INTERVAL_S",
            "soon",
            "env SPECGOV_LOOP__DECIDE_INTERVAL_S: loop.decide_interval_s: expected a duration",
        ),
        ("SPECGOV_BUDGET__ALLOWED_STEPS", "[1,", "env SPECGOV_BUDGET__ALLOWED_STEPS: cannot read"),
        ("SPECGOV_GUARDRAILS__MIN_GAIN", "-1", "env SPECGOV_GUARDRAILS__MIN_GAIN: guardrails."),
    ],
)
def test_bad_env_overrides_are_rejected(name: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={name: value})
    assert expected in str(info.value)


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    path = write(
        tmp_path, "loop:\n  mode: plugin\n  decide_interval_s: 3\n  scrape_interval_s: 2\n"
    )
    env = {"SPECGOV_LOOP__DECIDE_INTERVAL_S": "2", "SPECGOV_LOOP__SCRAPE_INTERVAL_S": "0.5"}
    cli = {"loop.decide_interval_s": "1s", "server.url": "http://127.0.0.1:31000"}
    only_file = load_config(path, env=NO_ENV)
    assert (only_file.loop.decide_interval_s, only_file.loop.scrape_interval_s) == (3.0, 2.0)
    with_env = load_config(path, env=env)
    assert (with_env.loop.decide_interval_s, with_env.loop.scrape_interval_s) == (2.0, 0.5)
    assert with_env.loop.mode == "plugin"
    full = load_config(path, env=env, overrides=cli)
    assert (full.loop.decide_interval_s, full.loop.scrape_interval_s) == (1.0, 0.5)
    assert full.server.url == "http://127.0.0.1:31000"
    assert full.sources["loop.decide_interval_s"] == "command line"
    assert full.sources["loop.scrape_interval_s"] == "env SPECGOV_LOOP__SCRAPE_INTERVAL_S"
    assert full.sources["loop.mode"] == f"{path}:2"


def test_cli_override_errors_name_the_override() -> None:
    with pytest.raises(ConfigError, match=r"command line: override 'loop': expected GROUP\.KEY"):
        load_config(None, env=NO_ENV, overrides={"loop": "x"})
    with pytest.raises(ConfigError, match=r"override 'loop.speed': unknown key loop\.speed"):
        load_config(None, env=NO_ENV, overrides={"loop.speed": 1})
    with pytest.raises(ConfigError, match=r"^command line: control\.listen: expected 'HOST:PORT'"):
        load_config(None, env=NO_ENV, overrides={"control.listen": "nowhere"})
    cfg = load_config(None, env=NO_ENV, overrides={"spool.dir": Path("/x"), "state.db_path": "s"})
    assert (cfg.spool.dir, cfg.state.db_path) == (Path("/x"), Path("s"))


def test_secret_status_reports_names_and_presence_only() -> None:
    cfg = load_config(None, env=NO_ENV)
    status = secret_status(cfg, {"SPECGOV_SGLANG_API_KEY": SECRET})
    assert status["server.api_key"] == {
        "env": "SPECGOV_SGLANG_API_KEY",
        "set": True,
        "required": False,
    }
    assert status["control.token"]["set"] is False
    assert SECRET not in json.dumps(status)
    assert cfg.server.api_key({"SPECGOV_SGLANG_API_KEY": SECRET}) == SECRET
    assert cfg.server.api_key({"SPECGOV_SGLANG_API_KEY": ""}) is None
    assert SECRET not in repr(cfg) and SECRET not in json.dumps(effective_config_dict(cfg))


# ------------------------------------------------------------------------------ CLI


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("SPECGOV_"):
            monkeypatch.delenv(name)


def test_cli_validate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    runner = CliRunner()
    ok = runner.invoke(config_group, ["validate"])
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.startswith("OK: packaged defaults: mode observe, policy goodput")
    good = write(tmp_path, "loop:\n  mode: plugin\n")
    ok = runner.invoke(config_group, ["validate", str(good)], env={"SPECGOV_LOG__LEVEL": "debug"})
    assert ok.exit_code == 0
    assert ok.stdout.startswith(f"OK: {good} + 1 environment override(s): mode plugin")
    bad = write(tmp_path, "loop:\n  decide_interval_s: soon\n", "bad.yaml")
    result = runner.invoke(config_group, ["validate", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2: loop.decide_interval_s: expected a duration like '5s'" in result.stderr
    assert result.stdout == ""
    missing = runner.invoke(config_group, ["validate", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 2 and "cannot read" in missing.stderr
    env_bad = runner.invoke(config_group, ["validate"], env={"SPECGOV_LOOP__NOPE": "1"})
    assert env_bad.exit_code == 2 and "unknown key loop.nope" in env_bad.stderr


def test_cli_validate_reports_every_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23: validate stopped at the first error. Now every bad key of the file and
    the environment is reported, one line each with its line or variable (exit 2)."""
    _clean_env(monkeypatch)
    bad = write(
        tmp_path,
        "loop:\n  mode: plug\n  decide_interval_s: soon\n  bogus: 1\n"
        "server:\n  url: ftp://x\nnope:\n  a: 1\nguardrails:\n  min_gain: -1\n",
        "bad.yaml",
    )
    result = CliRunner().invoke(
        config_group, ["validate", str(bad)], env={"SPECGOV_LOOP__NOPE": "1"}
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == "Error: 7 errors:", lines
    expected = [
        f"{bad}:2: loop.mode: expected one of observe, plugin",
        f"{bad}:3: loop.decide_interval_s: expected a duration",
        f"{bad}:4: unknown key loop.bogus",
        f"{bad}:6: server.url: expected an http(s) base URL",
        f"{bad}:7: unknown group 'nope'",
        f"{bad}:10: guardrails.min_gain: expected a finite number >= 0",
        "env SPECGOV_LOOP__NOPE: SPECGOV_<GROUP>__<KEY>: unknown key loop.nope",
    ]
    for text in expected:
        assert sum(text in line for line in lines[1:]) == 1, (text, lines)
    assert len(lines) == 1 + len(expected)
    # A bounded report: a file of many bad keys lists MAX_PROBLEMS and counts the rest.
    many = write(tmp_path, "loop:\n" + "".join(f"  k{i}: 1\n" for i in range(80)), "many.yaml")
    with pytest.raises(ConfigError) as err:
        load_config(many, env={})
    assert len(err.value.problems) == MAX_PROBLEMS + 1
    assert err.value.problems[-1] == f"... and {80 - MAX_PROBLEMS} more errors"


def test_cli_validate_warns_about_an_unset_required_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clean_env(monkeypatch)
    path = write(tmp_path, "control:\n  listen: 0.0.0.0:9465\n")
    result = CliRunner().invoke(config_group, ["validate", str(path)])
    assert result.exit_code == 0
    assert "warning:" in result.stderr and "SPECGOV_CONTROL_TOKEN" in result.stderr
    result = CliRunner().invoke(
        config_group, ["validate", str(path)], env={"SPECGOV_CONTROL_TOKEN": SECRET}
    )
    assert result.exit_code == 0 and "warning" not in result.stderr
    assert SECRET not in result.output


@pytest.mark.parametrize("output", ["json", "table"])
def test_cli_show_never_prints_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str
) -> None:
    _clean_env(monkeypatch)
    path = write(tmp_path, "budget:\n  allowed_steps: [0, 1, 3]\ncontrol:\n  listen: 0.0.0.0:1\n")
    env = {
        "SPECGOV_SGLANG_API_KEY": SECRET,
        "SPECGOV_CONTROL_TOKEN": SECRET + "-control",
        "SPECGOV_LOOP__MODE": "plugin",
    }
    result = CliRunner().invoke(
        config_group, ["show", "--config", str(path), "--output", output], env=env
    )
    assert result.exit_code == 0, result.output
    assert SECRET not in result.output
    if output == "json":
        doc = json.loads(result.stdout)
        assert doc["file"] == str(path)
        assert doc["config"]["loop"]["mode"] == "plugin"
        assert doc["config"]["budget"]["allowed_steps"] == [0, 1, 3]
        assert doc["sources"]["loop.mode"] == "env SPECGOV_LOOP__MODE"
        assert doc["sources"]["budget.allowed_steps"] == f"{path}:2"
        assert doc["secrets"]["server.api_key"] == {
            "env": "SPECGOV_SGLANG_API_KEY",
            "set": True,
            "required": False,
        }
        assert doc["secrets"]["control.token"]["required"] is True
        # The "config" part is a config file again.
        again = load_config(write(tmp_path, json.dumps(doc["config"]), "j.yaml"), env=NO_ENV)
        assert again == load_config(path, env=env)
    else:
        assert "$SPECGOV_SGLANG_API_KEY is set (value hidden)" in result.stdout
        assert "[0, 1, 3]" in result.stdout  # printed as written, not eaten as markup
        assert "env SPECGOV_LOOP__MODE" in result.stdout
        assert "127.0.0.1:9464" in result.stdout


def test_cli_show_invalid_config_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    path = write(tmp_path, "loop:\n  mode: fast\n")
    result = CliRunner().invoke(config_group, ["show", "--config", str(path)])
    assert result.exit_code == 2
    assert "loop.mode: expected one of observe, plugin, got 'fast'" in result.stderr
    usage = CliRunner().invoke(config_group, ["show", "--output", "xml"])
    assert usage.exit_code == 2


def test_huge_numbers_are_errors_not_crashes(tmp_path: Path) -> None:
    big = "1" + "0" * 400
    assert "loop.decide_interval_s: expected a duration" in _error(
        tmp_path, f"loop:\n  decide_interval_s: {big}\n"
    )
    assert "budget.vram_gib: expected a number of GiB" in _error(
        tmp_path, f"budget:\n  vram_gib: {big}\n"
    )


def test_spool_dir_auto_and_group(tmp_path: Path) -> None:
    # auto: the default resolution (never /tmp, where another user could create it
    # first); group: a name or a gid, resolved to the gid the spool files get.
    path = tmp_path / "c.yaml"
    path.write_text("spool:\n  dir: auto\n  group: 0\n")
    cfg = load_config(path, env=NO_ENV)
    assert cfg.spool.dir == default_spool_dir() and cfg.spool.group == 0
    path.write_text("spool:\n  group: root\n")
    assert load_config(path, env=NO_ENV).spool.group == 0
    path.write_text("spool:\n  group: no-such-group-here\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: spool.group: no group named"):
        load_config(path, env=NO_ENV)
    path.write_text("spool:\n  group: [1]\n")
    with pytest.raises(ConfigError, match="expected a group name or a numeric gid"):
        load_config(path, env=NO_ENV)
