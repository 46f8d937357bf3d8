#!/usr/bin/env bash
# The GPU check of `--device cuda` (issue: the same engine on an NVIDIA GPU), one script that
# fits the few minutes a lent GPU machine gives (torch with CUDA, transformers and Triton there,
# no package registry, the repository's files only):
#   1. random-weight models of SmolLM2-135M's and Llama 3.2 1B's exact shapes (bench/gpu_models.py)
#   2. tests/gpu/ on the SmolLM2-shaped one (parity with transformers, paged attention vs dense,
#      batch invariance, CUDA graphs vs eager, Q4 blocks)
#   3. bench/gpu.py on both, side by side with transformers; the table goes to $OUT (or
#      bench/results) as gpu-<date>.md
# Usage: bash bench/gpu_check.sh [--quick]
# Pure-Python modules Argosy needs that such a machine may lack travel in bench/.gpu-deps
# (ignored by git; the device tool's `carry`), made beforehand on a machine with the registry:
#   pip install --no-deps --target bench/.gpu-deps gguf pyyaml pytest pluggy iniconfig
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD:$PWD/bench/.gpu-deps${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-bench/results}"
mkdir -p "$out"
models="${TMPDIR:-/tmp}/argosy-gpu"
table="$out/gpu-$(date +%Y%m%d-%H%M).md"
python - <<'EOF' || { echo "gpu_check: a module Argosy needs is missing here (above)"; exit 2; }
import importlib, sys
missing = [m for m in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "gguf", "yaml", "pytest") if importlib.util.find_spec(m) is None]
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
sys.exit(f"missing: {missing}" if missing else 0)
EOF
status=0
python bench/gpu_models.py "$models/smollm2" --shapes smollm2 || exit 1
ARGOSY_GPU_MODEL="$models/smollm2" python -m pytest -q -p no:cacheprovider tests/gpu -x 2>&1 | tee "$out/gpu-tests.log" || status=1
python bench/gpu.py "$models/smollm2" "$@" --out "$table" || status=1
if [ "${1:-}" != "--quick" ]; then
  python bench/gpu_models.py "$models/1b" --shapes 1b && python bench/gpu.py "$models/1b" --quick --out "$table" || status=1
fi
echo "gpu_check: table in $table; tests log in $out/gpu-tests.log; status $status"
exit $status
