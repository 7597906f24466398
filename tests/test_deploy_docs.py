"""The operator's papers say what the code does: every reason code, every alert and every
doctor check is documented; every relative link and repository path they name exists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from specgov.policies.common.decisions import ReasonCode

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
OPERATIONS = DOCS / "operations.md"
# A repository path in backquotes (globs left out).
REPO_PATH = r"`((?:deploy|policies|adapters|controller|simulator|tests)/[^`*]+)`"


def _table_first_column(text: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z_A-Z]+)` \|", text, flags=re.M))


def test_every_reason_code_is_explained() -> None:
    documented = _table_first_column(OPERATIONS.read_text())
    codes = {c.value for c in ReasonCode}
    assert codes - documented == set(), "reason codes operations.md does not explain"
    # ...and no code is documented that the code does not have (a rename shows here).
    section = OPERATIONS.read_text().split("## 8. Reason codes")[1].split("\n## ")[0]
    assert _table_first_column(section) == codes


def test_every_alert_is_explained() -> None:
    rules = yaml.safe_load((REPO / "deploy/prometheus/specgov-alerts.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert alerts - _table_first_column(OPERATIONS.read_text()) == set()


def test_every_doctor_check_is_explained() -> None:
    from specgov.controller.cli import doctor_cmd

    source = Path(doctor_cmd.__file__).read_text()
    names = set(re.findall(r'self\.add\(\s*"([a-z_]+)"', source))
    assert {"reachable", "metrics", "plugin", "spool", "clock"} <= names
    assert names - _table_first_column(OPERATIONS.read_text()) == set()


def test_links_and_paths_exist() -> None:
    missing: list[str] = []
    for doc in [*DOCS.glob("*.md"), REPO / "CHANGELOG.md"]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.name}: link {target}")
        for path in re.findall(
            r"`((?:deploy|policies|adapters|controller|simulator|tests)/[^`*]+)`", text
        ):
            if not (REPO / path.split(" ")[0]).exists():
                missing.append(f"{doc.name}: path {path}")
    assert not missing, missing


def test_license_is_apache_2() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
