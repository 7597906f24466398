"""Catalog: built-in figures match REFERENCE.md §3, lookups, user files, schema errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgov.simulator.catalog import Catalog, CatalogError, DrafterSpec, GpuSpec, ModelSpec


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.load()


# REFERENCE.md §3: memory (GB), HBM TB/s, dense BF16 TFLOPs.
GPU_FIGURES = {
    "a100-80g": (80, 2.04, 312),
    "h100": (80, 3.35, 989),
    "h200": (141, 4.8, 989),
    "b200": (180, 8.0, 2250),
    "l40s": (48, 0.86, 362),
    "mi300x": (192, 5.3, 1307),
}


@pytest.mark.parametrize("name", sorted(GPU_FIGURES))
def test_gpu_figures_match_reference(catalog: Catalog, name: str) -> None:
    gpu = catalog.gpu(name)
    assert (gpu.memory_gib, gpu.hbm_bandwidth_tb_s, gpu.bf16_tflops) == GPU_FIGURES[name]
    # REFERENCE: achieved ~0.8 of bandwidth, ~0.7-0.75 of compute.
    assert gpu.bandwidth_efficiency == pytest.approx(0.8)
    assert 0.7 <= gpu.compute_efficiency <= 0.75
    assert gpu.achieved_bandwidth_bytes_s == pytest.approx(GPU_FIGURES[name][1] * 0.8e12)


# (layers, kv heads, head dim) from the models' configs; REFERENCE gives the KiB totals.
KV_SHAPES = {
    "llama-3.1-8b": (32, 8, 128, 128),
    "llama-3.1-70b": (80, 8, 128, 320),
    "llama-3.2-1b": (16, 8, 64, 32),
    "qwen3-8b": (36, 8, 128, 144),
}


@pytest.mark.parametrize("name", sorted(KV_SHAPES))
def test_model_kv_bytes_per_token(catalog: Catalog, name: str) -> None:
    layers, kv_heads, head_dim, kib = KV_SHAPES[name]
    model = catalog.model(name)
    assert model.kv_bytes_per_token == 2 * layers * kv_heads * head_dim * 2 == kib * 1024
    assert model.num_layers == layers


def test_model_auto_spec_shapes(catalog: Catalog) -> None:
    # SGLang _auto_choose_speculative_params: Llama (5, 4, 8), others (3, 1, 4).
    for name in ("llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b"):
        m = catalog.model(name)
        assert (m.default_spec_steps, m.default_spec_topk, m.default_spec_draft_tokens) == (5, 4, 8)
    q = catalog.model("qwen3-8b")
    assert (q.default_spec_steps, q.default_spec_topk, q.default_spec_draft_tokens) == (3, 1, 4)


def test_drafters(catalog: Catalog) -> None:
    eagle = catalog.drafter("eagle3")
    assert eagle.algorithm == "EAGLE3"
    assert eagle.params_b_for("llama-3.1-8b") == pytest.approx(0.42)  # ~0.4 B head
    assert eagle.params_b_for("LLAMA-3.1-70B") > 1.0  # per-target override
    assert eagle.kv_bytes_per_token == 4096  # 1 layer x 8 x 128 x 2 x 2
    assert eagle.static_reserve_gib == pytest.approx(2.0)
    assert eagle.supports("llama-3.1-8b") and not eagle.supports("llama-3.2-1b")
    ngram = catalog.drafter("ngram")
    assert ngram.weight_bytes_for("llama-3.1-8b") == 0 and ngram.kv_bytes_per_token == 0
    assert not ngram.has_model and ngram.supports("anything")
    assert ngram.per_request_us > 0  # a CPU lookup per request
    standalone = catalog.drafter("standalone")  # alias
    assert standalone.algorithm == "STANDALONE"
    assert standalone.kv_bytes_per_token == catalog.model("llama-3.2-1b").kv_bytes_per_token
    assert standalone.params_b == catalog.model("llama-3.2-1b").params_b
    assert standalone.static_reserve_gib == pytest.approx(6.0)


def test_lookup_is_case_insensitive_and_knows_aliases(catalog: Catalog) -> None:
    assert catalog.gpu("H100") is catalog.gpu("h100-SXM")
    assert catalog.model(" Llama-3.1-8B ").name == "llama-3.1-8b"
    assert catalog.drafter("EAGLE-3").name == "eagle3"
    assert catalog.gpu_names() == tuple(sorted(GPU_FIGURES))


@pytest.mark.parametrize(
    ("kind", "name", "expected"),
    [
        ("gpu", "h1000", "unknown GPU 'h1000'; valid: a100-80g, b200, h100, h200, l40s, mi300x"),
        ("model", "gpt-5", "unknown model 'gpt-5'; valid: llama-3.1-70b, llama-3.1-8b"),
        ("drafter", "medusa", "unknown drafter 'medusa'; valid: eagle3, ngram"),
    ],
)
def test_unknown_names(catalog: Catalog, kind: str, name: str, expected: str) -> None:
    with pytest.raises(CatalogError) as info:
        getattr(catalog, kind)(name)
    assert str(info.value).startswith(expected)
    assert isinstance(info.value, ValueError)


def test_user_file_overrides_and_adds(tmp_path: Path) -> None:
    first = tmp_path / "a.yaml"
    first.write_text(
        "gpus:\n"
        "  H100: {memory_gib: 94, hbm_bandwidth_tb_s: 3.9, bf16_tflops: 989,"
        " bandwidth_efficiency: 0.7}\n"
        "  rtx-pro-6000: {memory_gib: 96, hbm_bandwidth_tb_s: 1.8, bf16_tflops: 500}\n"
        "drafters:\n"
        "  my-eagle: {algorithm: eagle3, params_b: {default: 0.5, qwen3-8b: 0.3},"
        " kv_bytes_per_token: 4096, static_reserve_gib: 2, acceptance_profile: ngram,"
        " targets: [qwen3-8b]}\n"
    )
    second = tmp_path / "b.yaml"
    second.write_text(
        "gpus:\n  rtx-pro-6000: {memory_gib: 97, hbm_bandwidth_tb_s: 1.8, bf16_tflops: 500}\n"
    )
    cat = Catalog.load([first, second])
    h100 = cat.gpu("h100")
    assert (h100.memory_gib, h100.bandwidth_efficiency, h100.compute_efficiency) == (94, 0.7, 0.72)
    assert cat.gpu("rtx-pro-6000").memory_gib == 97  # later file wins
    assert cat.gpu("a100-80g").memory_gib == 80  # untouched built-in
    mine = cat.drafter("MY-EAGLE")
    assert mine.algorithm == "EAGLE3"
    assert mine.params_b_for("qwen3-8b") == 0.3 and mine.params_b_for("x") == 0.5
    # The user H100 entry replaced the built-in one, aliases included.
    with pytest.raises(CatalogError, match="unknown GPU 'h100-sxm'"):
        cat.gpu("h100-sxm")


def _load_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "user.yaml"
    path.write_text(text)
    with pytest.raises(CatalogError) as info:
        Catalog.load([path])
    message = str(info.value)
    assert message.startswith(str(path)), message  # every schema error names the file
    return message


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "gpus:\n  x: {memory_gib: lots, hbm_bandwidth_tb_s: 1, bf16_tflops: 1}\n",
            ["gpus.x.memory_gib", "expected a number > 0", "'lots'"],
        ),
        (
            "gpus:\n  x: {memory_gib: 8, hbm_bandwidth_tb_s: 1, bf16_tflops: 1,"
            " compute_efficiency: 1.5}\n",
            ["gpus.x.compute_efficiency", "a fraction in (0, 1]"],
        ),
        (
            "gpus:\n  x: {memory_gib: 8, bf16_tflops: 1}\n",
            ["gpus.x", "missing required key(s) hbm_bandwidth_tb_s"],
        ),
        (
            "gpus:\n  x: {memory_gib: 8, hbm_bandwidth_tb_s: 1, bf16_tflops: 1, tdp_w: 300}\n",
            ["gpus.x.tdp_w", "unknown key", "valid keys: memory_gib"],
        ),
        (
            "models:\n  m: {params_b: 1, bytes_per_param: 2, kv_bytes_per_token: 1.5,"
            " num_layers: 1, hidden_size: 1, default_spec_steps: 1, default_spec_topk: 1,"
            " default_spec_draft_tokens: 2}\n",
            ["models.m.kv_bytes_per_token", "an integer >= 1", "1.5"],
        ),
        (
            "drafters:\n  d: {algorithm: medusa, params_b: 0, kv_bytes_per_token: 0,"
            " static_reserve_gib: 0, acceptance_profile: ngram}\n",
            ["drafters.d.algorithm", "one of EAGLE, EAGLE3", "'medusa'"],
        ),
        (
            "drafters:\n  d: {algorithm: ngram, params_b: {qwen3-8b: 1}, kv_bytes_per_token: 0,"
            " static_reserve_gib: 0, acceptance_profile: ngram}\n",
            ["drafters.d.params_b", "{default: N, <target model>: N}"],
        ),
        ("gpu:\n  x: {}\n", ["gpu: unknown section", "valid sections: gpus, models, drafters"]),
        ("- just\n- a list\n", ["(top level)", "a mapping with any of the sections"]),
        ("gpus: [1, 2]\n", ["gpus", "a mapping of name -> entry"]),
        ("gpus:\n  x: {memory_gib: [\n", ["not valid YAML"]),
        ("gpus:\n  x: {memory_gib: true, hbm_bandwidth_tb_s: 1, bf16_tflops: 1}\n", ["True"]),
    ],
)
def test_schema_errors_name_file_path_and_form(
    tmp_path: Path, text: str, fragments: list[str]
) -> None:
    message = _load_error(tmp_path, text)
    for fragment in fragments:
        assert fragment in message, message


def test_drafter_with_unknown_target_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(
        "drafters:\n  d: {algorithm: EAGLE3, params_b: 0.4, kv_bytes_per_token: 4096,"
        " static_reserve_gib: 2, acceptance_profile: ngram, targets: [llama-9]}\n"
    )
    with pytest.raises(CatalogError, match="drafter 'd' refers to unknown target model 'llama-9'"):
        Catalog.load([path])


def test_missing_file_is_a_catalog_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(CatalogError, match=r"nope\.yaml: cannot read catalog file"):
        Catalog.load([missing])


def test_empty_user_file_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    assert Catalog.load([path]).gpu_names() == Catalog.load().gpu_names()


def test_specs_are_frozen(catalog: Catalog) -> None:
    for spec in (catalog.gpu("h100"), catalog.model("qwen3-8b"), catalog.drafter("ngram")):
        assert isinstance(spec, GpuSpec | ModelSpec | DrafterSpec)
        with pytest.raises(AttributeError):
            spec.name = "x"  # type: ignore[misc]


# ------------------------------------------------------------ provenance (issue 11 §5)

_BUILTIN = Path(__file__).resolve().parents[1] / "simulator" / "data"
_NOT_FIGURES = {"aliases", "provenance", "algorithm", "acceptance_profile", "targets"}


@pytest.mark.parametrize("fname", ["gpus.yaml", "models.yaml", "drafters.yaml"])
def test_every_builtin_figure_has_a_provenance(fname: str) -> None:
    import yaml

    doc = yaml.safe_load((_BUILTIN / fname).read_text(encoding="utf-8"))
    (section,) = doc
    catalog = Catalog.load()
    lookup = {"gpus": catalog.gpu, "models": catalog.model, "drafters": catalog.drafter}
    for name, entry in doc[section].items():
        figures = {k for k in entry if k not in _NOT_FIGURES}
        spec = lookup[section](name)
        recorded = {field: kind for field, kind, _ in spec.provenance}
        assert set(recorded) == figures, (fname, name, figures ^ set(recorded))
        assert set(recorded.values()) <= {"measured", "fitted", "assumed"}


def test_fitted_figures_name_what_they_were_fitted_to(catalog: Catalog) -> None:
    prov = {f: (k, src) for f, k, src in catalog.drafter("eagle3").provenance}
    assert prov["step_overhead_ms"][0] == "fitted" and "20780" in prov["step_overhead_ms"][1]
    assert "53420" in prov["extend_overhead_ms"][1]
    assert prov["verify_token_overhead_us"][0] == "fitted"
    assert prov["verify_overhead_ms"][0] == "assumed"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("provenance: {memory_gib: 'guessed: me'}", r"gpus.g.provenance.memory_gib: expected"),
        ("provenance: {memory_gib: 'measured:'}", "measured|fitted|assumed: <source>"),
        ("provenance: {vram: 'measured: x'}", "provenance.vram: names no figure of this entry"),
        ("provenance: [1]", "expected a mapping of field"),
    ],
)
def test_provenance_is_validated(tmp_path: Path, body: str, match: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "gpus:\n  g: {memory_gib: 1, hbm_bandwidth_tb_s: 1, bf16_tflops: 1, " + body + "}\n"
    )
    with pytest.raises(CatalogError, match=match):
        Catalog.load([f])


def test_tier_switch_cost_from_the_catalog_reaches_the_engine(tmp_path: Path) -> None:
    from specgov.simulator.replay.runner import (
        PolicySpecError,
        ServerSpec,
        parse_policy,
        prepare_run,
    )

    path = tmp_path / "switch.yaml"
    path.write_text(
        "drafters:\n"
        "  slow-switch: {algorithm: eagle3, params_b: 0.42, kv_bytes_per_token: 4096,"
        " static_reserve_gib: 2, acceptance_profile: eagle3-llama3.1-8b, tier_switch_ms: 2.5}\n"
    )
    assert Catalog.load().drafter("eagle3").tier_switch_ms == 0.0  # built in: free
    server = ServerSpec(drafter="slow-switch", catalog_files=(path,))

    def switch_s(spec: ServerSpec, policy: str) -> float:
        return prepare_run(spec, parse_policy(policy), seed=0).engine.config.tier_switch_s

    assert switch_s(server, "sglang-ema") == pytest.approx(2.5e-3)
    assert switch_s(ServerSpec(tier_switch_ms=1.0), "sglang-ema") == pytest.approx(1e-3)
    assert switch_s(server, "none") == 0.0  # no speculation: no tiers to switch
    with pytest.raises(PolicySpecError, match="tier_switch_ms: expected a number >= 0"):
        ServerSpec(tier_switch_ms=-1.0)
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("2.5", "-1"))
    with pytest.raises(CatalogError, match=r"drafters\.slow-switch\.tier_switch_ms: expected"):
        Catalog.load([bad])
