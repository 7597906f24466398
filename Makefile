# specgov developer entry points. `make demo` and `make test` are the README's
# quick start; both build everything they need from a bare Python 3.11.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
SGLANG_VERSION := 0.5.23
# The released SGLang wheel, unpacked (never imported as a package: contract
# tests load single files from it). Downloaded once from the package index.
SGLANG_SRC ?= .cache/sglang-$(SGLANG_VERSION)/x
SHARED_DATA ?= ../shared/data

.PHONY: setup demo test test-fast extras lint typecheck importlint bench clean sglang-src wheel dashboard

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

sglang-src: $(SGLANG_SRC)/sglang/srt/speculative/adaptive_spec_params.py

$(SGLANG_SRC)/sglang/srt/speculative/adaptive_spec_params.py: | setup
	rm -rf $(dir $(SGLANG_SRC))
	mkdir -p $(dir $(SGLANG_SRC))
	$(BIN)/pip download -q --no-deps sglang==$(SGLANG_VERSION) -d $(dir $(SGLANG_SRC))
	$(BIN)/python -m zipfile -e $(dir $(SGLANG_SRC))/sglang-$(SGLANG_VERSION)-*.whl $(SGLANG_SRC)

demo: setup
	$(BIN)/specgov demo

# The heavy test extras, not part of `make test` (measured: .venv grows from 655 MB
# to 2.0 GB, 3 minutes with a warm pip cache): CPU torch for the TP-broadcast test (two gloo processes) and transformers
# for the step-cost measurement's CPU run, ray for the Ray executor test. `make
# extras` installs them (.ci/run does); without them those tests skip with the
# reason, except where SPECGOV_REQUIRE_TORCH / SPECGOV_REQUIRE_RAY is set (CI). On
# this project's machines a CPU wheel of the torch pin is on disk (pip find-links);
# elsewhere pip may fetch a CUDA build.
extras: $(VENV)/.torch $(VENV)/.ray

TORCH_PIN := torch==2.13.0

$(VENV)/.torch: | setup
	$(BIN)/pip install -q $(TORCH_PIN) || echo "warning: $(TORCH_PIN) not installed; the TP broadcast test will skip"
	$(BIN)/pip install -q "transformers>=4.45" || echo "warning: transformers not installed; the step-cost measurement test will skip"
	touch $@

# Ray for `plan sweep --executor ray` and its test (the optional extra specgov[ray]).
# If it cannot be installed the test skips with the reason, except in CI, which sets
# SPECGOV_REQUIRE_RAY.
$(VENV)/.ray: pyproject.toml | setup
	# The marker only on success: a failed install is retried by the next `make extras`.
	$(BIN)/pip install -q -e '.[ray]' && touch $@ || echo "warning: ray not installed; the Ray test will skip"

test: setup sglang-src
	SPECGOV_SGLANG_SRC=$(SGLANG_SRC) SPECGOV_SHARED_DATA=$(SHARED_DATA) $(BIN)/pytest -q

# The inner loop: unit tests only (no end-to-end processes, wheel build, property tests or
# replay-heavy modules; tests/conftest.py marks those `integration`). CI runs `make test`.
test-fast: setup sglang-src
	SPECGOV_SGLANG_SRC=$(SGLANG_SRC) SPECGOV_SHARED_DATA=$(SHARED_DATA) $(BIN)/pytest -q -m "not slow and not integration"

lint: setup importlint typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy cannot see through setuptools' editable finder (DESIGN.md); a tree of
# symlinks named like the installed packages lets it type-check the sources.
typecheck: setup
	mkdir -p build/typecheck/specgov
	for d in policies adapters controller simulator; do ln -sfn ../../../$$d build/typecheck/specgov/$$d; done
	MYPYPATH=build/typecheck $(BIN)/mypy -p specgov.policies -p specgov.simulator -p specgov.adapters -p specgov.controller

importlint: setup
	$(BIN)/lint-imports

# The release artefacts: sdist and wheel in dist/ (what tests/test_wheel.py builds and
# installs; deploy/docker/sglang-plugin.Dockerfile copies the wheel from dist/).
wheel: setup
	$(BIN)/python -m build --outdir dist .

# deploy/grafana/specgov-dashboard.json is generated; tests fail when it is stale.
dashboard: setup
	$(BIN)/python deploy/grafana/make_dashboard.py

bench: setup
	SPECGOV_SHARED_DATA=$(SHARED_DATA) $(BIN)/python benchmarks/bench_replay.py

clean:
	rm -rf $(VENV) build .cache
