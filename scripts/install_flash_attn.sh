#!/usr/bin/env bash
# Installs flash-attn (varlen attention for packed sequences) on a CUDA machine, or says exactly why not.
#
#   scripts/install_flash_attn.sh PYTHON            (`make install` runs it on CUDA machines; FLASH_ATTN=skip: not)
#
# flash-attn publishes prebuilt wheels per (flash-attn, CUDA major, torch major.minor, C++ ABI, Python); its own
# `pip install` falls back to compiling when none matches, which needs nvcc and about an hour. So this script
# decides first, and says which way it went:
#   1. flash_attn already imports: nothing to do;
#   2. the matching prebuilt wheel exists on flash-attn's release page: install that wheel (no build);
#   3. otherwise, with nvcc on PATH: compile it (MAX_JOBS bounds the compiler's memory), with its build
#      dependencies (wheel, packaging, ninja, psutil) installed first: --no-build-isolation needs them in the venv;
#   4. otherwise: skip, naming the wheel that does not exist and what to install.
# Never fails the install: without flash-attn, packed micro-batches use per-sequence SDPA (see COST below).
# Uses `curl` and PYTHON only (tests/integration/test_install_scripts.py runs it with stand-ins for both and for nvcc).
set -u
python=${1:?usage: install_flash_attn.sh PYTHON}
version=${FLASH_ATTN_VERSION:-2.8.3}
COST="Packed micro-batches then run PyTorch SDPA once per sequence per layer (hybrid_rl/model/attention.py) instead of one
  varlen kernel per layer: the same results and attention FLOPs, plus one kernel launch per sequence per layer (a
  micro-batch of 64 sequences on a 28-layer model: 1792 attention calls per forward instead of 28), and the memory
  planner counts SDPA's activations. Install it later with: make install-flash-attn"

skip() { printf 'flash-attn: not installed: %s\n  %s\n' "$1" "$COST" >&2; exit 0; }

if [ "${FLASH_ATTN:-auto}" = skip ]; then skip "FLASH_ATTN=skip."; fi
if have=$("$python" -c 'import flash_attn; print(flash_attn.__version__)' 2>/dev/null); then
  echo "flash-attn $have already installed"; exit 0
fi
# torch's versions decide the wheel: 2.13.0+cu129 -> torch2.13, cu12; ABI TRUE/FALSE; cp311.
read -r torch_v cuda_v abi py_tag < <("$python" -c 'import sys, torch
print(torch.__version__.split("+")[0], torch.version.cuda or "none", str(torch._C._GLIBCXX_USE_CXX11_ABI).upper(),
      f"cp{sys.version_info.major}{sys.version_info.minor}")' 2>/dev/null) || true
[ -n "${torch_v:-}" ] || skip "PYTHON ($python) cannot import torch."
[ "$cuda_v" != none ] || skip "this torch ($torch_v) is not a CUDA build."
torch_mm=${torch_v%.*}
wheel="flash_attn-${version}+cu${cuda_v%%.*}torch${torch_mm}cxx11abi${abi}-${py_tag}-${py_tag}-linux_x86_64.whl"
url="https://github.com/Dao-AILab/flash-attention/releases/download/v${version}/${wheel}"

if curl -sfIL --max-time 30 "$url" >/dev/null 2>&1; then
  echo "flash-attn: installing the prebuilt wheel $wheel"
  "$python" -m pip install -q "$url" && exit 0
  skip "pip could not install the prebuilt wheel $url (its output is above)."
fi
if ! command -v nvcc >/dev/null 2>&1; then
  skip "flash-attn ${version} has no prebuilt wheel for this venv ($wheel is not on its release page: wheels
  exist only for the torch versions released before it), and compiling it needs the CUDA toolkit's nvcc, which is
  not on PATH. Install the CUDA toolkit ${cuda_v} (the one this torch was built with) and ninja, or download a
  matching wheel and pip install it into the venv."
fi
echo "flash-attn: no prebuilt wheel $wheel; compiling ${version} with $(command -v nvcc) (about an hour on 32 cores;"
echo "  MAX_JOBS=${MAX_JOBS:-8} parallel compilers, ~4 GiB of memory each)"
"$python" -m pip install -q wheel packaging ninja psutil || skip "pip could not install flash-attn's build dependencies."
MAX_JOBS=${MAX_JOBS:-8} FLASH_ATTENTION_FORCE_BUILD=TRUE "$python" -m pip install -q --no-build-isolation \
  "flash-attn==${version}" && exit 0
skip "compiling flash-attn ${version} failed (the compiler's output is above)."
