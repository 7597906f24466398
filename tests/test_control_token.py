"""Nobody steers without a token (issue 23 §2): the control token file, where the daemon
and the CLI find it, and the control API's rule on loopback (reads open, mutations need
the token). The end-to-end check against `specgov run` is tests/e2e/test_control_auth_e2e.py.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from test_control_api import TOKEN, FakeService, good_override, run_requests

from specgov.controller.cli import daemon_cmds
from specgov.controller.daemon import serve
from specgov.controller.daemon.config import load_config
from specgov.controller.daemon.control_api import make_app
from specgov.controller.daemon.control_token import (
    TokenFileError,
    client_token,
    daemon_token,
    ensure_token_file,
    read_token_file,
)

OTHER_UID = 65534  # nobody


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_first_start_makes_a_private_token_file_and_later_starts_reuse_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state" / "control.token"
    token = ensure_token_file(path)
    assert len(token) >= 40 and token.isascii() and " " not in token
    assert _mode(path) == 0o600 and path.stat().st_uid == os.geteuid()
    assert _mode(path.parent) == 0o700
    assert ensure_token_file(path) == token  # reused, not regenerated
    assert read_token_file(path) == token
    assert [p.name for p in path.parent.iterdir()] == ["control.token"]  # no temp left
    other = ensure_token_file(tmp_path / "elsewhere" / "control.token")
    assert other != token  # random per file


def test_a_missing_token_file_reads_as_none(tmp_path: Path) -> None:
    assert read_token_file(tmp_path / "control.token") is None


def test_a_symlink_at_the_token_path_is_not_followed(tmp_path: Path) -> None:
    real = tmp_path / "real.token"
    real.write_text("abc\n")
    real.chmod(0o600)
    link = tmp_path / "control.token"
    link.symlink_to(real)
    with pytest.raises(TokenFileError, match="symbolic link; it is not followed"):
        read_token_file(link)
    dangling = tmp_path / "dangling.token"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(TokenFileError, match="symbolic link"):
        ensure_token_file(dangling)
    assert not (tmp_path / "nowhere").exists()


def test_a_token_file_others_could_read_or_own_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "control.token"
    ensure_token_file(path)
    path.chmod(0o640)
    with pytest.raises(TokenFileError, match=r"mode 0640: group or others may read it; fix"):
        read_token_file(path)
    path.chmod(0o600)
    os.chown(path, OTHER_UID, -1)
    with pytest.raises(TokenFileError, match=f"belongs to uid {OTHER_UID}, not to this user"):
        daemon_token(None, path, {})
    if os.geteuid() == 0:  # root's CLI may read the daemon user's file (sudo specgov ...)
        assert client_token(None, path, {}) == read_token_file(path, root_reads_any=True)


@pytest.mark.parametrize("content", [b"", b"two words\n", b"x" * 2000, b"\xff\xfe"])
def test_a_token_file_that_holds_no_token_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "control.token"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(TokenFileError, match="expected one token"):
        read_token_file(path)


def test_the_environment_variable_wins_and_null_is_the_opt_out(tmp_path: Path) -> None:
    path = tmp_path / "control.token"
    env = {"SPECGOV_CONTROL_TOKEN": "from-env"}
    assert daemon_token("SPECGOV_CONTROL_TOKEN", path, env) == "from-env"
    assert not path.exists()  # no file made when the operator manages the secret
    assert client_token("SPECGOV_CONTROL_TOKEN", path, {}) is None  # none yet: send none
    made = daemon_token("SPECGOV_CONTROL_TOKEN", path, {})
    assert client_token("SPECGOV_CONTROL_TOKEN", path, {}) == made
    assert client_token("SPECGOV_CONTROL_TOKEN", path, env) == "from-env"
    assert daemon_token("SPECGOV_CONTROL_TOKEN", None, {}) is None


def test_the_token_file_is_beside_the_state_database_unless_configured(tmp_path: Path) -> None:
    db = tmp_path / "s" / "state.db"
    cfg = load_config(None, env={}, overrides={"state.db_path": str(db)})
    assert cfg.control.token_file == "auto"
    assert cfg.control_token_path == db.parent / "control.token"
    env = {"SPECGOV_CONTROL__TOKEN_FILE": str(tmp_path / "t")}
    assert load_config(None, env=env).control_token_path == tmp_path / "t"
    off = load_config(None, env={"SPECGOV_CONTROL__TOKEN_FILE": "null"})
    assert off.control_token_path is None


def test_the_daemon_says_where_its_token_is_and_warns_about_the_opt_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECGOV_CONTROL_TOKEN", raising=False)
    db = tmp_path / "state.db"
    caplog.set_level(logging.INFO, logger="specgov.daemon")
    cfg = load_config(None, env={}, overrides={"state.db_path": str(db)})
    token = serve.control_api_token(cfg)
    assert token == read_token_file(tmp_path / "control.token")
    assert f"need the token in {tmp_path / 'control.token'}" in caplog.text
    caplog.clear()
    off = load_config(None, env={}, overrides={"control.token_file": None})
    assert serve.control_api_token(off) is None
    assert "ANY local user may steer this daemon" in caplog.text


def test_on_loopback_reads_are_open_and_every_mutation_needs_the_token() -> None:
    service = FakeService()
    app = make_app(service, token=TOKEN, listen_host="127.0.0.1", open_reads_on_loopback=True)
    good = {"Authorization": f"Bearer {TOKEN}"}
    bad = {"Authorization": "Bearer guessed"}
    replies = run_requests(
        app,
        ("POST", "/v1/overrides", {"json": good_override()}),
        ("POST", "/v1/overrides", {"json": good_override(), "headers": bad}),
        ("DELETE", "/v1/overrides", {"params": {"all": "true"}}),
        ("PUT", "/v1/policy", {"json": {"spec": "static:1"}}),
        ("GET", "/v1/status", {}),
        ("GET", "/v1/overrides", {}),
        ("GET", "/v1/decisions", {}),
        ("POST", "/v1/overrides", {"json": good_override(), "headers": good}),
        ("PUT", "/v1/policy", {"json": {"spec": "static:1"}, "headers": good}),
    )
    statuses = [r.status for r in replies]
    assert statuses == [401, 401, 401, 401, 200, 200, 200, 201, 200], statuses
    # Refused mutations never reached the service.
    assert service.names() == [
        "status",
        "list_overrides",
        "decisions",
        "set_override",
        "set_policy",
    ]


def test_beyond_loopback_reads_still_need_the_token() -> None:
    app = make_app(FakeService(), token=TOKEN, listen_host="0.0.0.0", open_reads_on_loopback=True)
    (reply,) = run_requests(app, ("GET", "/v1/status", {}))
    assert reply.status == 401


def test_the_cli_reads_the_token_file_of_its_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`specgov policy set` sends the token from the file beside the state database the
    config names, with nothing set up by hand; a file it may not trust is not sent."""
    sent: list[Any] = []

    class _Client:
        def __init__(self, addr: str, *, token: str | None, timeout_s: float) -> None:
            sent.append(token)

        def set_policy(self, spec: str) -> dict[str, Any]:
            return {"policy": spec}

    from specgov.controller.cli import control_client

    monkeypatch.setattr(control_client, "ControlClient", _Client)
    monkeypatch.delenv("SPECGOV_CONTROL_TOKEN", raising=False)
    db = tmp_path / "state.db"
    token = ensure_token_file(tmp_path / "control.token")
    env = {"SPECGOV_STATE__DB_PATH": str(db)}
    runner = CliRunner()
    done = runner.invoke(daemon_cmds.policy_set, ["static:1"], env=env)
    assert done.exit_code == 0, done.output
    (tmp_path / "control.token").chmod(0o644)
    done = runner.invoke(daemon_cmds.policy_set, ["static:1"], env=env)
    assert "not sending a control token" in done.output and "chmod 600" in done.output
    assert sent == [token, None]
