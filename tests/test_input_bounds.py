"""Bounded input (issue 9, section 3): the config loader, the trace readers and the error
messages built from what they read.

Each case from the top of issue 9 in this area has a test here that failed on the code
before the fix: a YAML alias bomb in a file or in SPECGOV_LOOP__MODE, a trace with
``arrival_s: 1e308``, ``output_tokens: 2e9``, ``input_tokens: 1e29``, a huge line. Inputs
are generated, and scaled down where the old code's cost grew with them (a 9^6 alias
bomb, not the 1.26 GB one; a 3 MB line against the line limit, not a 2 GB one).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from specgov.adapters.errors import bounded_repr, escape_upstream
from specgov.controller.config import (
    CONFIG_MAX_BYTES,
    ENV_VALUE_MAX_CHARS,
    MESSAGE_MAX_CHARS,
    YAML_MAX_DEPTH,
    ConfigError,
    load_config,
)

# A message quoting upstream or user text stays one short printable line.
SHORT = MESSAGE_MAX_CHARS + 100


def _alias_bomb(levels: int, width: int = 9) -> str:
    """A flow sequence whose aliases expand to width**levels strings (about 40 bytes
    per level: the "billion laughs" of YAML)."""
    parts = ["&l0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        parts.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    return "[" + ", ".join(parts) + "]"


def _config_error(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text, encoding="utf-8")
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path, env=env or {})
    assert time.perf_counter() - start < 5.0  # refused, not expanded
    message = str(err.value)
    assert len(message) < SHORT and message.isprintable()
    return message


# ----------------------------------------------------------------------------- config


def test_a_yaml_alias_bomb_in_the_config_file_is_refused_at_its_anchor(tmp_path: Path) -> None:
    # 9^6 = 531,441 strings from ~300 bytes: the old loader expanded them into the value
    # and quoted all of it in a multi-megabyte error message.
    text = f"loop:\n  scrape_interval_s: 1\n  mode: {_alias_bomb(6)}\n"
    message = _config_error(tmp_path, text)
    assert "cfg.yaml:3: YAML anchor '&l0' is not allowed" in message
    assert "write the value out" in message


def test_an_alias_alone_is_refused_with_its_line(tmp_path: Path) -> None:
    # An alias needs an anchor first; the anchor is what is refused, on its own line.
    text = "loop:\n  mode: observe\nserver:\n  url: &u http://127.0.0.1:30000\n"
    assert "cfg.yaml:4: YAML anchor '&u'" in _config_error(tmp_path, text)


def test_a_yaml_alias_bomb_in_an_environment_value_is_refused(tmp_path: Path) -> None:
    env = {"SPECGOV_LOOP__MODE": _alias_bomb(6)}
    message = _config_error(tmp_path, "", env)
    assert message.startswith("env SPECGOV_LOOP__MODE:1: YAML anchor '&l0' is not allowed")
    env = {"SPECGOV_LOOP__MODE": "*nothing"}
    message = _config_error(tmp_path, "", env)
    assert "env SPECGOV_LOOP__MODE" in message and "alias '*nothing'" in message


def test_config_file_size_is_capped_and_only_the_cap_is_read(tmp_path: Path) -> None:
    comment = "# " + "x" * 1000 + "\n"
    text = "loop:\n  mode: observe\n" + comment * (CONFIG_MAX_BYTES // len(comment) + 1)
    message = _config_error(tmp_path, text)
    assert f"larger than {CONFIG_MAX_BYTES} bytes (1 MiB)" in message
    # Just under the cap still loads.
    path = tmp_path / "ok.yaml"
    path.write_text(text[: CONFIG_MAX_BYTES - 10].rsplit("\n", 1)[0] + "\n", encoding="utf-8")
    assert load_config(path, env={}).loop.mode == "observe"


def test_environment_values_are_capped(tmp_path: Path) -> None:
    env = {"SPECGOV_POLICY__SPEC": "goodput:" + "x" * ENV_VALUE_MAX_CHARS}
    message = _config_error(tmp_path, "", env)
    assert f"holds at most {ENV_VALUE_MAX_CHARS}" in message
    assert message.startswith("env SPECGOV_POLICY__SPEC: the value has ")


def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path: Path) -> None:
    text = "budget:\n  allowed_steps: " + "[" * 50_000 + "]" * 50_000 + "\n"
    message = _config_error(tmp_path, text)
    assert f"cfg.yaml:2: YAML nested deeper than {YAML_MAX_DEPTH} levels" in message
    env = {"SPECGOV_BUDGET__ALLOWED_STEPS": "[" * 5000 + "]" * 5000}
    assert "nested deeper" in _config_error(tmp_path, "", env)


def test_long_and_control_laden_values_give_short_escaped_messages(tmp_path: Path) -> None:
    # A 200 KB value without aliases: quoted elided, the message cut, controls escaped.
    text = "loop:\n  mode: [" + ", ".join(["observe"] * 30_000) + "]\n"
    message = _config_error(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'cfg.yaml'}:2: loop.mode: expected one of")
    assert "..." in message
    text = 'deployment:\n  gpu: "h100\\u001b[2J\\u0000\\r"\n'
    message = _config_error(tmp_path, text)
    assert "\\x1b" in message and "\x1b" not in message and "\x00" not in message
    env = {"SPECGOV_LOOP__MODE": "x" * 10_000}
    message = _config_error(tmp_path, "", env)
    assert message.startswith("env SPECGOV_LOOP__MODE: loop.mode: expected one of")


# ---------------------------------------------------------------------- escape helpers


def test_escape_upstream_escapes_every_unprintable_and_cuts_with_the_length() -> None:
    assert escape_upstream("plain text") == "plain text"
    assert escape_upstream("a\x00b\x1bc\rd\ne\tf\x7fg\x85h\u202ei\u2028j\udcff") == (
        "a\\x00b\\x1bc\\rd\\ne\\tf\\x7fg\\x85h\\u202ei\\u2028j\\udcff"
    )
    cut = escape_upstream("y" * 10_000, 100)
    assert cut == "y" * 100 + "... [cut: 10000 characters in all]"
    # Escapes never overrun the limit, nor are they split.
    cut = escape_upstream("\x00" * 100, 50)
    assert cut.startswith("\\x00" * 12) and "... [cut: 100 characters in all]" in cut
    assert "\\x0..." not in cut and len(cut.split("...")[0]) <= 50
    # The cost is bounded by the limit, not by the input.
    start = time.perf_counter()
    escape_upstream("\x1b" * 50_000_000, 512)
    assert time.perf_counter() - start < 1.0


def test_bounded_repr_elides_huge_and_nested_values() -> None:
    text = bounded_repr({"a": list(range(10**6)), "b": "x" * 10**6, "c": [[[[[1]]]]]})
    assert len(text) < 600 and "..." in text
    assert bounded_repr("\x1b[2J").isprintable()
