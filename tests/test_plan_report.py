"""The planning report: files, self-containment, data, and a render in headless Chromium.

The Chromium test skips with a reason where no Chromium binary is installed, except
when SPECGOV_REQUIRE_CHROMIUM=1 (CI sets it and installs Debian's chromium), where a
missing browser fails.
"""

from __future__ import annotations

import base64
import csv
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from specgov.simulator.planning.executor import run_jobs
from specgov.simulator.planning.fleet import plan_fleet
from specgov.simulator.planning.fleet_spec import FleetPlanConfig, enumerate_fleets
from specgov.simulator.planning.report import ReportError, write_report
from specgov.simulator.planning.router import parse_routers
from specgov.simulator.planning.search import SearchSettings
from specgov.simulator.planning.sweep import SweepSettings, enumerate_jobs
from specgov.simulator.planning.sweep_document import build_document
from specgov.simulator.planning.vram import vram_document, vram_plan
from specgov.simulator.replay.metrics import Slo
from specgov.simulator.replay.runner import ServerSpec
from specgov.simulator.workload.synthetic import generate_trace
from specgov.simulator.workload.synthetic_text import parse_synthetic_spec

TRACE = generate_trace(parse_synthetic_spec("synthetic:duration=20,rate=4,seed=1"))
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FIGURES = (
    "vram",
    "curves_h100",
    "slo_frontier",
    "replicas_cost",
    "fleets",
    "where_speculation_pays",
    "speculation_pays_h100",
)


@pytest.fixture(scope="module")
def docs() -> dict[str, Any]:
    vram = []
    for gpu, model, drafter in (
        ("h100", "llama-3.1-8b", "eagle3"),
        ("h100", "llama-3.1-8b", None),
        ("l40s", "llama-3.1-70b", "eagle3"),  # does not fit: shown with its overflow
    ):
        plan, used = vram_plan(gpu=gpu, model=model, drafter=drafter)
        vram.append(vram_document(plan, shape=used["shape"], max_running_requests=None))
    settings = SweepSettings(
        slo_tpot_ms=12.0, slo_ttft_ms=1000.0, search=SearchSettings(rel_tol=0.2)
    )
    jobs = enumerate_jobs(
        gpus=["h100"],
        drafters=["eagle3"],
        policies=["none", "static:3", "sglang-ema"],
        settings=settings,
        trace=TRACE,
    )
    rows, _ = run_jobs(jobs, TRACE, workers=1)
    sweep = build_document(
        rows, trace=TRACE, settings=settings, target_rps=20.0, prices=None, executor={}
    )
    cfg = FleetPlanConfig(
        fleets=enumerate_fleets((2,), ["all"]),
        routers=parse_routers("least-loaded,spec-aware"),
        slo=Slo(tpot_ms=12.0, ttft_ms=1000.0),
    )
    fleet = plan_fleet(TRACE, ServerSpec(), cfg, target_rps=12.0)
    return {"vram": vram, "sweep": sweep, "fleet": fleet}


@pytest.fixture(scope="module")
def report(docs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    return write_report(out, vram=docs["vram"], sweep=docs["sweep"], fleet=docs["fleet"])


class _Refs(HTMLParser):
    """Every tag and every src/href of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.srcs: list[str] = []
        self.hrefs: list[str] = []
        self.img_alts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        a = dict(attrs)
        if a.get("src") is not None:
            self.srcs.append(str(a["src"]))
        if a.get("href") is not None:
            self.hrefs.append(str(a["href"]))
        if tag == "img":
            self.img_alts.append(str(a.get("alt")))


def _refs(html_text: str) -> _Refs:
    parser = _Refs()
    parser.feed(html_text)
    return parser


def test_the_report_is_self_contained(report: Path) -> None:
    text = report.read_text(encoding="utf-8")
    refs = _refs(text)
    # Nothing from anywhere else: no script, stylesheet link, font or remote image.
    assert "script" not in refs.tags and "link" not in refs.tags
    assert not re.search(r"@import|@font-face|url\(", text)
    assert len(refs.srcs) == len(FIGURES)  # curves: one figure per GPU, one GPU here
    assert all(src.startswith("data:image/png;base64,") for src in refs.srcs)
    assert all(not re.match(r"[a-z]+:|//", h) for h in refs.hrefs), refs.hrefs
    for href in refs.hrefs:
        assert (report.parent / href).is_file(), href


def test_every_figure_is_a_png_and_the_page_embeds_the_same_bytes(report: Path) -> None:
    folder = report.parent / "figures"
    assert sorted(p.stem for p in folder.glob("*.png")) == sorted(FIGURES)
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', report.read_text())
    files = {p.read_bytes() for p in folder.glob("*.png")}
    assert {base64.b64decode(e) for e in embedded} == files
    for path in folder.glob("*.png"):
        with Image.open(path) as im:
            assert im.format == "PNG" and im.width >= 600 and im.height >= 200


def test_the_sections_and_the_recommendation(report: Path, docs: dict[str, Any]) -> None:
    text = report.read_text()
    for heading in (
        "Recommendation",
        "Launch configuration",
        "VRAM budgets",
        "Sustainable load: throughput-latency curves",
        "SLO frontier",
        "When speculation pays",
        "Replicas and cost",
        "Fleet comparison",
        "Data files",
    ):
        assert f">{heading}</h" in text, heading
    best = docs["sweep"]["best"]
    for flag in best["launch_args"]:
        assert flag in text or flag.endswith("adaptive-config.json"), flag
    assert "python -m sglang.launch_server --model-path MODEL --enable-metrics" in text
    assert "first item over the budget" in text  # the 70B on L40S overflow, explained
    assert f"Why: {docs['sweep']['recommendation']}." in text.replace("&#x27;", "'")
    assert docs["fleet"]["recommendation"] in text.replace("&#x27;", "'")


def test_the_data_files(report: Path, docs: dict[str, Any]) -> None:
    data = report.parent / "data"
    for name in ("vram", "sweep", "fleet"):
        assert json.loads((data / f"{name}.json").read_text()) == docs[name]

    def rows(name: str) -> list[dict[str, str]]:
        with (data / name).open(newline="") as fh:
            return list(csv.DictReader(fh))

    configs = docs["sweep"]["configurations"]
    assert [r["id"] for r in rows("sweep_configurations.csv")] == [c["id"] for c in configs]
    points = sum(len(c["curve"]) for c in configs)
    assert len(rows("sweep_curves.csv")) == points
    fleets = rows("fleets.csv")
    assert [(r["fleet"], r["router"]) for r in fleets] == [
        (r["fleet"], r["router"]) for r in docs["fleet"]["fleets"]
    ]
    replicas = rows("fleet_replicas.csv")
    assert len(replicas) == sum(len(r["per_replica"]) for r in docs["fleet"]["fleets"])
    items = rows("vram_items.csv")
    assert {r["item"] for r in items} >= {"target weights", "target KV pool", "left"}


def test_absent_documents_say_which_command_fills_them(
    tmp_path: Path, docs: dict[str, Any]
) -> None:
    only_fleet = write_report(tmp_path / "f", vram=None, sweep=None, fleet=docs["fleet"])
    text = only_fleet.read_text()
    assert "No sweep in this report (run specgov plan sweep --report DIR)" in text
    assert "VRAM budget" in text  # the fleet's replica kinds carry their VRAM documents
    nothing = write_report(tmp_path / "n", vram=None, sweep=None, fleet=None).read_text()
    assert "No sweep or fleet plan in this report" in nothing
    assert "No VRAM documents" in nothing and "No fleet plan in this report" in nothing


def test_missing_optional_keys_are_tolerated(tmp_path: Path) -> None:
    sweep = {"configurations": [{"gpu": "h100", "policy": "none", "max_rps": 2.0}]}
    fleet = {"fleets": [{"fleet": "1+0", "router": "least-loaded", "goodput_tok_s": 10.0}]}
    index = write_report(tmp_path, vram=[{"gpu": "h100"}], sweep=sweep, fleet=fleet)
    text = index.read_text()
    assert "h100 none" in text
    assert (tmp_path / "figures" / "slo_frontier.png").is_file()
    assert (tmp_path / "figures" / "fleets.png").is_file()


def test_bad_documents_are_report_errors(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="sweep must be a dict"):
        write_report(tmp_path, vram=None, sweep=[], fleet=None)  # type: ignore[arg-type]
    with pytest.raises(ReportError, match="fleet is not JSON-clean"):
        write_report(tmp_path, vram=None, sweep=None, fleet={"x": float("nan")})
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ReportError, match="cannot write the report"):
        write_report(blocker, vram=None, sweep=None, fleet=None)


# --------------------------------------------------------------------------- Chromium


def _chromium() -> str:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    reason = (
        f"no headless Chromium found ({', '.join(CHROMIUM_NAMES)} not on PATH); "
        "install Debian's chromium to render the report"
    )
    if os.environ.get("SPECGOV_REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"{reason} (SPECGOV_REQUIRE_CHROMIUM=1, so this is an error)")
    pytest.skip(reason)


# Appended to a copy of the page only: the report itself carries no script.
PROBE = """<script>
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  var out = document.createElement('pre');
  out.id = 'figure-check';
  out.textContent = 'FIGURES ' + ok.length + '/' + imgs.length + ' ' +
    imgs.map(function (i) { return i.naturalWidth + 'x' + i.naturalHeight; }).join(',');
  document.body.appendChild(out);
});
</script>"""


def _browser(binary: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
        capture_output=True,
        text=True,
        timeout=240,  # a loaded CI machine starts Chromium slowly
        cwd=cwd,
        check=False,
    )


def test_headless_chromium_renders_every_figure(report: Path, tmp_path: Path) -> None:
    binary = _chromium()
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", PROBE + "</body>"))
    dom = _browser(
        binary, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri(), cwd=tmp_path
    )
    match = re.search(r"FIGURES (\d+)/(\d+) ([\dx,]*)", dom.stdout)
    assert match, f"no probe output; chromium said: {dom.stderr[-2000:]}"
    loaded, total = int(match.group(1)), int(match.group(2))
    assert total == len(_refs(report.read_text()).srcs) and loaded == total, match.group(0)
    for size in match.group(3).split(","):
        width, height = (int(v) for v in size.split("x"))
        assert width >= 600 and height >= 200
    # Screenshots of the page itself, top and a tall full view.
    for name, window in (("top", "1280,1400"), ("full", "1280,9000")):
        shot = tmp_path / f"report-{name}.png"
        done = _browser(
            binary, f"--window-size={window}", f"--screenshot={shot}", report.as_uri(), cwd=tmp_path
        )
        assert shot.is_file(), done.stderr[-2000:]
        with Image.open(shot) as im:
            colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colours is not None and len(colours) > 50  # not a blank page


def test_cell_text_is_escaped_once(tmp_path: Path) -> None:
    # A reason as the sweep writes them (quotes) and one with markup: the page shows the
    # text itself, not its escaped form (the table cells escaped twice).
    rows = [
        {"id": "a", "gpu": "h100", "policy": "sglang-ema", "status": "cannot-run",
         "reason": "policy 'sglang-ema' needs EAGLE"},
        {"id": "b", "gpu": "h100", "policy": "none", "status": "ok", "max_rps": 2.0,
         "reason": "a <b>tag</b> & more"},
    ]  # fmt: skip
    text = write_report(tmp_path, vram=None, sweep={"configurations": rows}, fleet=None).read_text()
    assert "policy &#x27;sglang-ema&#x27; needs EAGLE" in text
    assert "a &lt;b&gt;tag&lt;/b&gt; &amp; more" in text
    assert "&amp;#x27;" not in text and "&amp;lt;" not in text


def test_the_page_table_and_the_csv_are_built_from_the_same_columns(tmp_path: Path) -> None:
    row = {
        "id": "x1", "gpu": "h100", "drafter": "eagle3", "policy": "static:3", "status": "ok",
        "shape": {"name": "chain"}, "max_rps": 3.25, "replicas": 4,
        "saving_vs_none": {"replicas": 2, "cost_fraction": 0.25},
    }  # fmt: skip
    index = write_report(tmp_path, vram=None, sweep={"configurations": [row]}, fleet=None)
    with (tmp_path / "data" / "sweep_configurations.csv").open(newline="") as fh:
        (written,) = list(csv.DictReader(fh))
    assert written["shape"] == "chain" and written["saving_replicas"] == "2"
    assert written["saving_cost_fraction"] == "0.25" and written["cost_per_hour"] == ""
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", index.read_text())
    # configuration, status, max req/s, replicas, cost/h, cost/Mtok, replicas saved, reason
    assert cells[-8:] == ["h100 eagle3 chain static:3", "ok", "3.25", "4", "-", "-", "2", "-"]


def test_a_report_removes_the_temporary_files_of_an_interrupted_one(tmp_path: Path) -> None:
    (tmp_path / "figures").mkdir()
    (tmp_path / "data").mkdir()
    stale = [
        tmp_path / ".index.html.k2j4.tmp",
        tmp_path / "figures" / ".vram.png.x9a1.tmp",
        tmp_path / "data" / ".sweep.json.q0w8.tmp",
    ]
    for path in stale:
        path.write_text("half")
    keep = tmp_path / "notes.txt"
    keep.write_text("the operator's")
    write_report(tmp_path, vram=None, sweep=None, fleet=None)
    assert not any(path.exists() for path in stale)
    assert keep.read_text() == "the operator's"
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_the_launch_command_is_complete_and_names_the_adaptive_config_file(
    docs: dict[str, Any], tmp_path: Path
) -> None:
    # Issue 22 §4: --enable-metrics, and the adaptive config written next to the report.
    adaptive = next(
        r for r in docs["sweep"]["configurations"] if r.get("adaptive_config") is not None
    )
    report = write_report(
        tmp_path, vram=None, sweep={**docs["sweep"], "best": adaptive}, fleet=None
    )
    text = report.read_text()
    found = re.search(r"<pre>(python -m sglang.launch_server[^<]*)</pre>", text)
    assert found is not None
    command = found.group(1)
    assert command.startswith("python -m sglang.launch_server --model-path MODEL --enable-metrics")
    (written,) = tmp_path.glob("adaptive-config-*.json")
    assert f"--speculative-adaptive-config {written.resolve()}" in command
    assert json.loads(written.read_text()) == adaptive["adaptive_config"]
    assert f'href="{written.name}"' in text
    assert written.stat().st_mode & 0o777 == 0o644


def test_every_report_file_is_readable_by_others(report: Path) -> None:
    files = [p for p in report.parent.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o644, path


def test_when_speculation_pays_curve_and_its_data(report: Path, docs: dict[str, Any]) -> None:
    from specgov.simulator.planning.simplicity import PAYS_TPOT_SLOS_MS, pays_curve

    with (report.parent / "data" / "speculation_pays.csv").open(newline="") as fh:
        records = list(csv.DictReader(fh))
    configs = [c for c in docs["sweep"]["configurations"] if c["curve"]]
    assert len(records) == len(configs) * len(PAYS_TPOT_SLOS_MS)
    ttft = docs["sweep"]["slo"]["ttft_ms"]
    for row in configs:
        mine = [float(r["rps"]) for r in records if r["id"] == row["id"]]
        assert mine == pays_curve(row, ttft_ms=ttft)
        assert mine == sorted(mine)  # a looser TPOT SLO never sustains less
    text = report.read_text()
    assert "sustains more than the plain server at a TPOT SLO of" in text or (
        "never sustains more than the plain server" in text
    )
