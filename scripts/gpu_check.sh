#!/usr/bin/env bash
# The GPU checks (tests/gpu) on a machine that has a CUDA GPU, Python and PyTorch but not this project's install,
# in priority order, each check in its own pytest call so that a time limit cut short loses only the check it cut.
#
#   scripts/gpu_check.sh OUT        # OUT: a folder for the log and each check's figures (JSON)
#
# Packages the machine lacks go in .whl/ beforehand, downloaded where pip can reach PyPI (Python 3.12 wheels here):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d .whl hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 etcd3gw==2.7.0 futurist==3.5.0 \
#     pbr==7.1.3 debtcollector==3.1.0 transformers==5.19.0 tokenizers==0.23.3
# They are installed into /tmp/hr_site, not over the machine's own packages.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT}
mkdir -p "$out"
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hr_site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/hr_site:$PWD
fi
export HR_GPU_TESTS=1 HR_GPU_REPORT=$out/report PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

checks=(  # quickest and newest first: the recipes' runs take minutes each
    tests/gpu/test_weight_sync.py
    tests/gpu/test_device_paths.py
    "tests/gpu/test_train.py::test_recipe_trains_and_stays_within_its_memory_plan[grpo_0.5B]"
    "tests/gpu/test_train.py::test_recipe_trains_and_stays_within_its_memory_plan[ppo_1.5B]"
    "tests/gpu/test_train.py::test_recipe_trains_and_stays_within_its_memory_plan[grpo_lora_0.5B]"
)
status=0
for check in "${checks[@]}"; do
    start=$SECONDS
    python3 -m pytest -q -p no:cacheprovider --tb=short --timeout=420 "$check" >>"$out/log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    echo "$([ $rc -eq 0 ] && echo passed || echo "FAILED ($rc)") $((SECONDS - start)) s  $check" | tee -a "$out/summary"
done
exit $status
