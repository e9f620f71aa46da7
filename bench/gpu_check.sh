#!/usr/bin/env bash
# The GPU kit (bench/gpu_check.py): installs the wheels carried in $GPU_CHECK_WHEELS (default
# .whl/: the packages a GPU
# image lacks, built for its Python) into a private folder, then runs every GPU check in one go.
#
#   bench/gpu_check.sh --out DIR          # on a GPU machine, about 8 minutes
#   bench/gpu_check.sh --dry --out DIR    # on CPU: tiny sizes, checks the kit itself
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/pdserve-gpu-site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/pdserve-gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m bench.gpu_check "$@"
