"""Nobody steers without a token (issue 23 §2), against real `specgov run` and
`specgov sim-server` processes with default control settings (loopback, no token
variable set).

Another local user can reach the loopback port but cannot read the daemon's token file:
their requests are plain HTTP without the token. Before this change such a request,
`override set --disable --ttl 168h`, took the engine's table to 0 steps everywhere.
"""

from __future__ import annotations

import os
import stat

from .conftest import E2E, http_json, wait_until

TRACE = "synthetic:duration=120,rate=6,phases=chat@120,seed=4"


def test_a_caller_without_the_token_cannot_steer_but_the_daemons_user_can(e2e: E2E) -> None:
    sim = e2e.start_sim(TRACE, speed=20.0, loop=True)
    daemon = e2e.start_daemon(sim)
    token_file = daemon.db_path.parent / "control.token"
    st = token_file.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    base = f"http://{daemon.control_addr}/v1"
    wait_until(lambda: sim.spool_version() > 0, what="a first published table")

    # Another user: no token.
    attempts = [
        http_json("POST", f"{base}/overrides", {"disable": True, "ttl": "168h", "reason": "x"}),
        http_json("PUT", f"{base}/policy", {"spec": "none"}),
        http_json("DELETE", f"{base}/overrides?all=true"),
    ]
    for status, body in attempts:
        assert status == 401, (status, body)
        assert "Authorization: Bearer <token>" in body["error"]
    assert daemon.api("overrides")["overrides"] == []
    assert daemon.api("policy")["policy"].startswith("goodput")  # reads stay open

    # The daemon's user: the CLI finds the token beside the state database by itself.
    done = daemon.cli("override", "set", "--disable", "--ttl", "2m", "--reason", "ops")
    assert done.returncode == 0, done.stdout + done.stderr
    listed = daemon.api("overrides")["overrides"]
    assert [o["disable_speculation"] for o in listed] == [True]
