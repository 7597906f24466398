"""The configuration's sources as layers (:mod:`specgov.controller.daemon.config`): the
file, the environment, the command line and the defaults, each a mapping of group and key
to a raw value with its origin (``FILE:LINE``, ``env NAME``, ``command line``), checked
for unknown and duplicate keys but not yet validated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from specgov.adapters.errors import escape_upstream
from specgov.controller.daemon.config_schema import GROUPS, SCHEMA, default_groups
from specgov.controller.daemon.config_values import (
    ConfigError,
    ConfigProblems,
    plain_value,
    show_value,
)

ENV_PREFIX: Final = "SPECGOV_"
ENV_SEPARATOR: Final = "__"
DEFAULTS_LABEL: Final = "packaged defaults"
CLI_LABEL: Final = "command line"

# Input bounds (the config module's docstring). The packaged config.yaml is about 9 KB
# and no value needs more than a few hundred characters, so these only stop abuse and
# accidents.
CONFIG_MAX_BYTES: Final = 1024 * 1024
ENV_VALUE_MAX_CHARS: Final = 16 * 1024
YAML_MAX_DEPTH: Final = 16


# ------------------------------------------------------------------------- the layers


@dataclass(frozen=True, slots=True)
class RawValue:
    value: object
    origin: str  # "FILE:LINE", "env NAME", "command line" or DEFAULTS_LABEL


ConfigLayer = dict[str, dict[str, RawValue]]


def _unknown_group(group: object) -> str:
    return f"unknown group {show_value(group)}; valid groups: {', '.join(GROUPS)}"


def _unknown_key(group: str, key: object) -> str:
    return f"unknown key {group}.{key}; valid keys of {group}: {', '.join(SCHEMA[group])}"


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


def yaml_layer(text: str, label: str, problems: ConfigProblems) -> ConfigLayer:
    """Parse a config document keeping each key's line. Unknown and duplicate groups and
    keys are added to ``problems`` and skipped, so the rest is still checked; a YAML
    syntax error ends the parse (ConfigError)."""
    loader = _new_loader(text, label)
    try:
        root = loader.get_single_node()
        layer: ConfigLayer = {}
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
            if group not in SCHEMA:
                problems.add(ConfigError(f"{label}:{line}: {_unknown_group(group)}"))
                continue
            if group in group_lines:
                first = group_lines[group]
                problems.add(
                    ConfigError(
                        f"{label}:{line}: duplicate group {show_value(group)} "
                        f"(first at line {first})"
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
                        f"({', '.join(SCHEMA[group])})"
                    )
                )
                continue
            key_lines: dict[str, int] = {}
            for key_node, value_node in body.value:
                kline = key_node.start_mark.line + 1
                key = _key_of(loader, key_node, label, f"{group}.")
                if key not in SCHEMA[group]:
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
                layer[group][key] = RawValue(value, f"{label}:{kline}")
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


def env_layer(env: Mapping[str, str], problems: ConfigProblems) -> ConfigLayer:
    layer: ConfigLayer = {}
    for name in sorted(env):
        rest = name[len(ENV_PREFIX) :]
        if not name.startswith(ENV_PREFIX) or ENV_SEPARATOR not in rest:
            continue  # not a config override (module docstring)
        try:
            group, key, value = _env_entry(name, rest, env[name])
        except ConfigError as exc:
            problems.add(exc)
            continue
        layer.setdefault(group, {})[key] = RawValue(value, f"env {name}")
    return layer


def _env_entry(name: str, rest: str, text: str) -> tuple[str, str, object]:
    group_part, _, key_part = rest.partition(ENV_SEPARATOR)
    group, key = group_part.lower(), key_part.lower()
    form = "SPECGOV_<GROUP>__<KEY>"
    if group not in SCHEMA:
        raise ConfigError(f"env {name}: {form}: {_unknown_group(group)}")
    if key not in SCHEMA[group]:
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


def override_layer(overrides: Mapping[str, Any]) -> ConfigLayer:
    layer: ConfigLayer = {}
    for dotted, value in overrides.items():
        group, dot, key = str(dotted).partition(".")
        if not dot or group not in SCHEMA:
            raise ConfigError(
                f"{CLI_LABEL}: override {show_value(dotted)}: expected GROUP.KEY like 'loop.mode'; "
                f"{_unknown_group(group)}"
            )
        if key not in SCHEMA[group]:
            raise ConfigError(
                f"{CLI_LABEL}: override {show_value(dotted)}: {_unknown_key(group, key)}"
            )
        layer.setdefault(group, {})[key] = RawValue(value, CLI_LABEL)
    return layer


def defaults_layer() -> ConfigLayer:
    # As plain data, the form a file gives, so the defaults pass the same validators.
    defaults = default_groups()
    return {
        group: {
            key: RawValue(plain_value(getattr(defaults[group], key)), DEFAULTS_LABEL)
            for key in keys
        }
        for group, keys in SCHEMA.items()
    }


def read_config_text(path: Path, label: str) -> str:
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
