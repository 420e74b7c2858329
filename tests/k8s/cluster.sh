#!/usr/bin/env bash
# A one-node Kubernetes cluster on 127.0.0.1 for gemtrace's Kubernetes tests (device plugin,
# mutating webhook, per-pod metrics): a real kube-apiserver, controller-manager, scheduler and kubelet
# over a private etcd and containerd. Kubernetes 1.20 is built from Debian's (bookworm) source package;
# etcd, containerd and runc are the host's packages, but for a containerd of 2 or newer (Ubuntu 24.04's),
# which no longer serves the kubelet's CRI: then bookworm's, unpacked into the cache. The test image is
# made from the host's own packages; nothing is pulled from an image registry.
#
#   tests/k8s/cluster.sh build     build the binaries once into the cache (idempotent)
#   tests/k8s/cluster.sh up        start the cluster (builds first when needed), import the images
#   tests/k8s/cluster.sh kubectl … kubectl against it
#   tests/k8s/cluster.sh env       print the paths (KUBECONFIG, LOGS, ...) as shell assignments
#   tests/k8s/cluster.sh down      stop everything, unmount, remove the run dir (keeps cache and logs)
#
# Owns: the cache of built binaries ($GEMTRACE_K8S_CACHE), the run dir ($GEMTRACE_K8S_RUN), the logs
# ($GEMTRACE_K8S_LOGS) and the kubelet root (/var/lib/kubelet, where device plugins register), which it
# removes on `down` only when `up` made it. It never touches a system containerd, etcd or kubelet: its
# own run on their own sockets, ports and data dirs.
#
# The node is a GPU node as an operator's is once gemtrace's .deb is installed, so that deploy/ applies
# to it unchanged (`kubectl apply -k deploy/`, as the README says). What stands in for what a real
# cluster has, each a property of this cluster rather than a patch of deploy/:
#   - the pod network: Debian's CNI bridge plugin, pods on $POD_SUBNET behind the bridge $BRIDGE (the
#     node is Ready); the kubernetes Service's ClusterIP reaches the apiserver through one DNAT rule on
#     that bridge, in place of kube-proxy, which Debian's package does not build here.
#   - gemtrace's files on the node (/etc/gemtrace, /run/gemtrace, /var/lib/gemtrace, /usr/lib/gemtrace)
#     are, for the kubelet and containerd, the directories under $NODE_ROOT: they run in a mount
#     namespace of their own where those are bound there. The test's agent runs on the host with
#     those directories as its own (a host runs many tests' agents; a node has one), and neither the
#     host's own /etc/gemtrace nor anything else of it is touched.
#   - the GPU driver: containerd's runc is tests/k8s/simgpu-runc, which gives a container that names
#     NVIDIA_VISIBLE_DEVICES the simulated GPU that $GPU_DRIVER describes, as NVIDIA's container
#     runtime gives it the real driver.
set -euo pipefail

CACHE=${GEMTRACE_K8S_CACHE:-/var/cache/gemtrace-k8s}
RUN=${GEMTRACE_K8S_RUN:-/run/gemtrace-k8s}
LOGS=${GEMTRACE_K8S_LOGS:-/var/log/gemtrace-k8s}
KUBELET_ROOT=/var/lib/kubelet   # device plugins find the kubelet at $KUBELET_ROOT/device-plugins/kubelet.sock
NODE=${GEMTRACE_K8S_NODE:-gemtrace-node}
TEST_IMAGE=gemtrace.local/test:1
PAUSE_IMAGE=gemtrace.local/pause:1
# The node's InternalIP, where the apiserver reaches the kubelet (logs, exec) and the only address not
# on loopback that the cluster listens on: the kubelet refuses a loopback node IP ("nodeIP can't be
# loopback address") and then reports no address at all. The host's own source address for its
# default route; the kubelet asks every client for a certificate from the cluster's CA.
node_ip() {
    local ip=${GEMTRACE_K8S_NODE_IP:-}
    [ -n "$ip" ] || ip=$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')
    [ -n "$ip" ] || ip=$(ip -4 -o addr show scope global | awk '{sub("/.*", "", $4); print $4; exit}')
    [ -n "$ip" ] || die "no IPv4 address outside loopback on this host, and the kubelet refuses 127.0.0.1 as its node IP: set GEMTRACE_K8S_NODE_IP to a local address"
    echo "$ip"
}
# Ports off the usual ones (2379, 6443, 10250, 10257, 10259) so that a real cluster on the same host
# does not clash with this one.
ETCD_PORT=${GEMTRACE_K8S_ETCD_PORT:-23790}
ETCD_PEER_PORT=$((ETCD_PORT + 1))
APISERVER_PORT=${GEMTRACE_K8S_APISERVER_PORT:-16443}
KUBELET_PORT=${GEMTRACE_K8S_KUBELET_PORT:-20250}
KUBELET_HEALTHZ_PORT=$((KUBELET_PORT - 2))
CONTROLLER_MANAGER_PORT=${GEMTRACE_K8S_CONTROLLER_MANAGER_PORT:-20257}
SCHEDULER_PORT=${GEMTRACE_K8S_SCHEDULER_PORT:-20259}
SCHEDULER_INSECURE_PORT=$((SCHEDULER_PORT - 8))  # its healthz and metrics (10251 by default), on loopback
SERVICE_CIDR=10.96.0.0/16
KUBERNETES_SERVICE_IP=10.96.0.1  # the first of SERVICE_CIDR: the apiserver's own Service
# The pod network: one bridge on the host, its first address the pods' gateway.
POD_SUBNET_PREFIX=${GEMTRACE_K8S_POD_SUBNET_PREFIX:-10.244.0}
POD_SUBNET=$POD_SUBNET_PREFIX.0/24
BRIDGE_IP=$POD_SUBNET_PREFIX.1
BRIDGE=gemtrace-cni0
CNI_BIN=/usr/lib/cni  # containernetworking-plugins, on Debian as on Ubuntu
NODE_ROOT=$RUN/node
NODE_DIRS=(/etc/gemtrace /run/gemtrace /var/lib/gemtrace /usr/lib/gemtrace)
# The simulated GPU of the node, as KEY=VALUE lines (the tests write it): tests/k8s/simgpu-runc.
GPU_DRIVER=$NODE_ROOT/simgpu.env
RUNTIME=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/simgpu-runc
# kube-scheduler's configuration as deploy/ gives it to an operator: its `extenders:` (gemtrace's
# scheduler extender, which deploy/'s DaemonSet serves on this host's loopback) are this cluster's.
SCHEDULER_CONFIG_SOURCE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/deploy/kube-scheduler/config.yaml
# Debian's kubernetes 1.20 vendors reflect2 1.0.1, whose map iteration relies on Go runtime internals
# that changed in Go 1.18: built with bookworm's Go 1.19, the apiserver crashes when it applies a
# mutating webhook's JSON patch. reflect2 1.0.2 (Debian's package) follows the change; it is copied
# over the vendored one.
REFLECT2_PKG=golang-github-modern-go-reflect2-dev
K8S_COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)

log() { printf 'cluster.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it starts a kubelet and containerd)"; }

# --- build ---------------------------------------------------------------------------------------

# The Debian mirror the host already uses, for the deb-src line when there is none (on Ubuntu, none
# is Debian's: deb.debian.org).
debian_mirror() {
    local uri
    uri=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
            /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -v security | grep -m1 -oE 'https?://[^ ]*/debian/?' || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

# Debian's archive key, for bookworm's deb-src on Ubuntu as on Debian: Debian ships it in every
# install, Ubuntu in the debian-archive-keyring package (universe; tests/prereqs.sh installs it).
DEBIAN_KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
# Where no source list of the host offers the kubernetes source package, this script fetches it with
# an apt of its own: its source list, package lists and caches under $CACHE/apt, none of the host's
# apt files read or written. A failed fetch thus leaves the host's `apt-get update` as it was.
APT_DIR=$CACHE/apt
APT_OPTS=()
# The options of an apt of this script's own in DIR (one a line): its source list, package lists and
# caches there; and its directories (apt downloads as _apt where it can write: else it warns, and
# downloads as root). The kubernetes source comes by one in $APT_DIR, bookworm's containerd by another.
apt_dir_opts() {
    printf '%s\n' -o "Dir::Etc::SourceList=$1/sources.list" -o "Dir::Etc::SourceParts=$1/sources.list.d" \
        -o "Dir::State::Lists=$1/lists" -o "Dir::Cache=$1/cache" -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
}
make_apt_dir() {
    mkdir -p "$1/sources.list.d" "$1/lists/partial" "$1/cache/archives/partial"
    chown _apt "$1/lists/partial" 2>/dev/null || true
}
private_apt_opts() { mapfile -t APT_OPTS < <(apt_dir_opts "$APT_DIR"); }

showsrc_version() {
    apt-cache "${APT_OPTS[@]}" showsrc --only-source kubernetes 2>/dev/null | sed -n 's/^Version: //p' | sort -V | tail -n 1
}

# Set APT_OPTS to the apt that offers the kubernetes source package: the host's, else this script's
# own; false when neither does yet.
choose_apt() {
    APT_OPTS=()
    [ -n "$(showsrc_version)" ] && return 0
    private_apt_opts
    [ -n "$(showsrc_version)" ]
}

k8s_source_version() {
    choose_apt || true
    showsrc_version
}

# Bookworm's lines of TYPE (deb, deb-src): type, keyring, mirror (pure).
bookworm_lines() {
    printf '%s [signed-by=%s] %s %s main\n' "$1" "$2" "$3" bookworm "$1" "$2" "$3" bookworm-updates
}

# The deb-src lines for bookworm's kubernetes: keyring, mirror (pure).
deb_src_lines() { bookworm_lines deb-src "$@"; }

ensure_deb_src() {
    # A file of this name is what this script wrote into the host's apt before it kept an apt of its
    # own; on Ubuntu it named a keyring that is not there and failed every `apt-get update`.
    rm -f /etc/apt/sources.list.d/gemtrace-k8s-src.sources
    choose_apt && return
    [ -r "$DEBIAN_KEYRING" ] || die "$DEBIAN_KEYRING is missing, needed to fetch Debian's kubernetes source: apt-get install debian-archive-keyring"
    log "no source list of this host offers the kubernetes source package: fetching bookworm's with an apt of its own in $APT_DIR"
    make_apt_dir "$APT_DIR"
    deb_src_lines "$DEBIAN_KEYRING" "$(debian_mirror)" >"$APT_DIR/sources.list"
    apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update of $APT_DIR/sources.list failed (above); the host's apt is untouched"
    [ -n "$(showsrc_version)" ] || die "apt-get source kubernetes is not possible: no deb-src for bookworm in $APT_DIR/sources.list"
}

# The cache dir of one build: keyed by what goes into the binaries.
bin_dir() {
    local kver rver
    kver=$(k8s_source_version)
    rver=$(dpkg-query -W -f '${Version}' "$REFLECT2_PKG" 2>/dev/null) \
        || die "$REFLECT2_PKG is not installed: apt-get install -y $REFLECT2_PKG"
    echo "$CACHE/kubernetes_${kver}+reflect2_${rver}+$(go env GOVERSION)/bin"
}

# Kubernetes 1.20's kubelet speaks the CRI's v1alpha2, which containerd 2 no longer serves (Ubuntu 24.04's
# updates carry containerd 2.2: the kubelet exits with "unknown service runtime.v1alpha2.RuntimeService").
# Where the host's containerd is 2 or newer, the cluster runs bookworm's (1.6), unpacked into the cache from
# Debian's archive by an apt of its own, as the kubernetes source is fetched; the host's containerd, its
# apt and its files are not touched. Elsewhere the host's own, as before.
CONTAINERD_CACHE=$CACHE/containerd-bookworm
host_containerd_serves_v1alpha2() {
    local version
    version=$(containerd --version 2>/dev/null | awk '{print $3}')
    version=${version#v}
    [ -n "$version" ] && [ "${version%%.*}" -lt 2 ] 2>/dev/null
}

# The directory of the containerd, ctr and runc shim the cluster runs (pure: fetches nothing).
containerd_dir() {
    if host_containerd_serves_v1alpha2; then echo /usr/bin; else echo "$CONTAINERD_CACHE/usr/bin"; fi
}

# The cluster's ctr (a ctr of containerd 2 cannot import into containerd 1.6: no transfer service).
CONTAINERD_BIN=
ctr_() { "${CONTAINERD_BIN:=$(containerd_dir)}/ctr" "$@"; }

ensure_containerd() {
    host_containerd_serves_v1alpha2 && return 0
    [ -x "$CONTAINERD_CACHE/usr/bin/containerd" ] && return 0
    [ -r "$DEBIAN_KEYRING" ] || die "$DEBIAN_KEYRING is missing, needed to fetch Debian's containerd: apt-get install debian-archive-keyring"
    local apt_dir=$CACHE/apt-bin work=$CACHE/containerd.tmp opts
    log "this host's containerd serves no CRI v1alpha2 (Kubernetes 1.20's): fetching bookworm's into $CONTAINERD_CACHE"
    rm -rf "$work"
    mkdir -p "$work"
    make_apt_dir "$apt_dir"
    bookworm_lines deb "$DEBIAN_KEYRING" "$(debian_mirror)" >"$apt_dir/sources.list"
    mapfile -t opts < <(apt_dir_opts "$apt_dir")
    apt-get "${opts[@]}" update -qq || die "apt-get update of $apt_dir/sources.list failed (above); the host's apt is untouched"
    # By its version: the candidate would be the host's newer one, which this apt has no source for.
    local version
    version=$(apt-cache "${opts[@]}" madison containerd | awk -F' *[|] *' '{print $2; exit}')
    [ -n "$version" ] || die "no containerd in bookworm per $apt_dir/sources.list"
    (cd "$work" && apt-get "${opts[@]}" download -qq "containerd=$version") 2>&1 | { grep -v '^W: Download is performed unsandboxed' || true; } >&2
    local deb
    deb=$(find "$work" -maxdepth 1 -name 'containerd_*.deb' | head -n 1)
    [ -n "$deb" ] || die "apt-get download containerd gave no package in $work"
    dpkg-deb -x "$deb" "$work/root"
    [ -x "$work/root/usr/bin/containerd" ] || die "$deb has no usr/bin/containerd"
    rm -rf "$CONTAINERD_CACHE"
    mv "$work/root" "$CONTAINERD_CACHE"
    rm -rf "$work"
    log "containerd $("$CONTAINERD_CACHE/usr/bin/containerd" --version | awk '{print $3}') in $CONTAINERD_CACHE"
}

built() {
    local bin=$1 c
    for c in "${K8S_COMPONENTS[@]}" pause; do [ -x "$bin/$c" ] || return 1; done
}

cmd_build() {
    need_root
    command -v go >/dev/null || die "go is missing: apt-get install -y golang-go"
    ensure_deb_src
    ensure_containerd
    local bin
    bin=$(bin_dir)
    if built "$bin"; then
        log "binaries cached in $bin"
        return
    fi
    local work=$CACHE/build.tmp
    rm -rf "$work"
    mkdir -p "$work"
    log "fetching Debian's kubernetes $(k8s_source_version) source into $work"
    # As root, apt warns that it downloads unsandboxed: true, and no news.
    (cd "$work" && apt-get "${APT_OPTS[@]}" source -qq kubernetes) 2>&1 | { grep -v '^W: Download is performed unsandboxed' || true; } >&2
    local src
    src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n 1)
    if [ -z "$src" ] || [ ! -d "$src/vendor" ]; then
        die "apt-get source kubernetes gave no source tree with vendor/ in $work"
    fi

    local reflect2=/usr/share/gocode/src/github.com/modern-go/reflect2
    find "$src/vendor/github.com/modern-go/reflect2" -type f \( -name '*.go' -o -name '*.s' \) -delete
    find "$reflect2" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' \
        -exec cp {} "$src/vendor/github.com/modern-go/reflect2/" \;
    # go_above_118.go is what 1.0.2 adds: without it the build would succeed and webhooks crash.
    [ -f "$src/vendor/github.com/modern-go/reflect2/go_above_118.go" ] \
        || die "$REFLECT2_PKG gave no go_above_118.go in $reflect2: its reflect2 is older than 1.0.2"

    log "building ${K8S_COMPONENTS[*]} (several minutes)"
    local start=$SECONDS
    # As debian/rules builds it: its own GOPATH, no cgo. GOCACHE in the work dir so it goes with it.
    (
        cd "$src"
        export GOPATH=$src/.go GOCACHE=$work/gocache CGO_ENABLED=0 HOME=$work
        mkdir -p .go/src/k8s.io
        ln -sfn ../../.. .go/src/k8s.io/kubernetes
        make WHAT="${K8S_COMPONENTS[*]/#/cmd/}" >"$work/make.log" 2>&1 \
            || { tail -n 40 "$work/make.log" >&2; exit 1; }
    ) || die "the kubernetes build failed; its log: $work/make.log"
    # The sandbox ("pause") container's program, from the same source; static, so the image needs
    # nothing else.
    gcc -Os -static -Wall -o "$src/_output/bin/pause" "$src/build/pause/linux/pause.c" \
        -DVERSION="$(k8s_source_version)" \
        || die "compiling pause.c failed: apt-get install -y build-essential"
    mkdir -p "$bin.tmp"
    for c in "${K8S_COMPONENTS[@]}" pause; do cp "$src/_output/bin/$c" "$bin.tmp/"; done
    rm -rf "$bin"
    mv "$bin.tmp" "$bin"
    rm -rf "$work"
    log "built in $((SECONDS - start)) s into $bin"
}

# --- images --------------------------------------------------------------------------------------

# Copy a host path into the rootfs $1 at its canonical place (bookworm is usrmerged: /bin is a link
# to usr/bin, which the rootfs has too), following a chain of symlinks link by link.
copy_path() {
    local root=$1 path=$2 dir dest target
    dir=$(realpath "$(dirname "$path")")
    dest=$root$dir/$(basename "$path")
    if [ -e "$dest" ] || [ -L "$dest" ]; then return; fi
    mkdir -p "$root$dir"
    if [ -L "$path" ]; then
        target=$(readlink "$path")
        ln -s "$target" "$dest"
        case "$target" in /*) copy_path "$root" "$target" ;; *) copy_path "$root" "$dir/$target" ;; esac
    elif [ -f "$path" ]; then
        cp --preserve=mode "$path" "$dest"
    fi
}

# A rootfs with the files of the given installed Debian packages and the shared libraries their
# programs load (found with ldd), so that the test image runs what the host runs, glibc included.
make_rootfs() {
    local root=$1 f
    shift
    mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib,usr/lib64,etc,tmp,proc,sys,dev,root}
    chmod 1777 "$root/tmp"
    ln -s usr/bin "$root/bin"; ln -s usr/sbin "$root/sbin"
    ln -s usr/lib "$root/lib"; ln -s usr/lib64 "$root/lib64"
    # dpkg -L also prints lines such as "diverted by ...": only paths are files.
    dpkg -L "$@" | grep '^/' | while read -r f; do
        case "$f" in /usr/share/doc/*|/usr/share/man/*|/usr/share/info/*|/usr/share/locale/*) continue ;; esac
        if [ -d "$f" ] && [ ! -L "$f" ]; then continue; fi
        copy_path "$root" "$f"
    done
    # ldd fails on scripts (and so exits non-zero): the libraries of the others still count.
    { find "$root/usr/bin" "$root/usr/sbin" -type f -perm -u+x -exec ldd {} + 2>/dev/null || true; } \
        | grep -oE '(^|\s)/[^ ]+' | sort -u | while read -r f; do copy_path "$root" "$f"; done
    echo 'root:x:0:0:root:/root:/bin/sh' >"$root/etc/passwd"
    echo 'root:x:0:' >"$root/etc/group"
}

# A one-layer image in `docker save` form, which `ctr images import` reads.
make_image() {
    local root=$1 ref=$2 config=$3 out=$4 dir diff_id cfg_id
    dir=$(mktemp -d)
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$root" -cf "$dir/layer.tar" .
    diff_id=$(sha256sum "$dir/layer.tar" | cut -d' ' -f1)
    printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
        "$config" "$diff_id" >"$dir/config.json"
    cfg_id=$(sha256sum "$dir/config.json" | cut -d' ' -f1)
    mv "$dir/config.json" "$dir/$cfg_id.json"
    printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "$cfg_id" "$ref" >"$dir/manifest.json"
    tar -C "$dir" -cf "$out" manifest.json "$cfg_id.json" layer.tar
    rm -rf "$dir"
}

# The test image: a shell and coreutils from the host's own packages. The sandbox (pause) image:
# Kubernetes' pause program, built with the binaries.
TEST_IMAGE_PACKAGES=(dash bash coreutils)
build_images() {
    local bin=$1 out=$2 work
    work=$(mktemp -d)
    make_rootfs "$work/test" "${TEST_IMAGE_PACKAGES[@]}"
    make_image "$work/test" "$TEST_IMAGE" \
        '{"Env":["PATH=/usr/local/bin:/usr/bin:/usr/sbin:/bin:/sbin"],"Cmd":["/bin/sh"],"WorkingDir":"/"}' \
        "$out/test-image.tar"
    mkdir -p "$work/pause"
    cp "$bin/pause" "$work/pause/pause"
    make_image "$work/pause" "$PAUSE_IMAGE" '{"Entrypoint":["/pause"],"User":"65535:65535"}' "$out/pause-image.tar"
    rm -rf "$work"
}

# --- certificates and kubeconfigs -----------------------------------------------------------------

PKI=$RUN/pki
# cert NAME SUBJECT [SUBJECT_ALT_NAMES]: a key and a certificate signed by the cluster's CA.
cert() {
    local name=$1 subj=$2 san=${3:-} ext
    openssl genrsa -out "$PKI/$name.key" 2048 2>/dev/null
    openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
    ext=$PKI/$name.ext
    {
        echo "basicConstraints=CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=serverAuth,clientAuth"
        if [ -n "$san" ]; then echo "subjectAltName=$san"; fi
    } >"$ext"
    openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
        -days 30 -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
    rm -f "$PKI/$name.csr" "$ext"
}

make_pki() {
    mkdir -p "$PKI"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 30 \
        -subj "/CN=gemtrace-k8s-ca" 2>/dev/null
    cert apiserver "/CN=kube-apiserver" \
        "IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    # The apiserver's client certificate towards the kubelet (logs, exec): system:masters passes the
    # kubelet's authorization webhook.
    cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
    cert admin "/O=system:masters/CN=gemtrace-admin"
    cert controller-manager "/CN=system:kube-controller-manager"
    cert scheduler "/CN=system:kube-scheduler"
    # system:node:<name> in system:nodes: what the Node authorizer and NodeRestriction expect.
    cert kubelet-client "/O=system:nodes/CN=system:node:$NODE"
    cert kubelet "/CN=$NODE" "IP:$NODE_IP,IP:127.0.0.1,DNS:$NODE,DNS:localhost"
    openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
    openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
}

# kubeconfig NAME CERT: a kubeconfig for the client certificate CERT.
kubeconfig() {
    cat >"$RUN/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: gemtrace
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: $2
  user:
    client-certificate: $PKI/$2.crt
    client-key: $PKI/$2.key
contexts:
- name: gemtrace
  context: {cluster: gemtrace, user: $2}
current-context: gemtrace
EOF
}

# --- processes -------------------------------------------------------------------------------------

CONTAINERD_SOCK=$RUN/containerd/containerd.sock
KUBECTL_CONFIG=$RUN/admin.kubeconfig

# start NAME COMMAND...: in its own session, output to $LOGS/NAME.log, pid in $RUN/pids/NAME.
start() {
    local name=$1
    shift
    mkdir -p "$RUN/pids"
    setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
    echo $! >"$RUN/pids/$name"
}

# A killed daemon stays a zombie until PID 1 reaps it, which a container's or sandbox's init may do late.
pid_alive() {
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

alive() { [ -f "$RUN/pids/$1" ] && pid_alive "$(cat "$RUN/pids/$1")"; }

# A cluster of this script's that another run dir started: its kubelet and apiserver share the host's
# /var/lib/kubelet and /kubepods cgroups with ours (one kubelet killed the other's pods, one device plugin
# rewrote the other's grants), so a second one is refused. Prints each such process, a line each: pid
# and name; fails where there is none.
foreign_cluster() {
    local name pid found=1
    for name in kubelet kube-apiserver; do
        for pid in $(pgrep -x "$name" 2>/dev/null || true); do
            if ! [ -f "$RUN/pids/$name" ] || [ "$(cat "$RUN/pids/$name")" != "$pid" ]; then
                echo "$pid $name"
                found=0
            fi
        done
    done
    return $found
}

# wait_for WHAT SECONDS NAME COMMAND...: until COMMAND succeeds, while NAME's process lives.
wait_for() {
    local what=$1 secs=$2 name=$3 deadline
    shift 3
    deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        alive "$name" || die "$name exited while waiting for $what; the end of $LOGS/$name.log:
$(tail -n 15 "$LOGS/$name.log")"
        [ $SECONDS -lt $deadline ] || die "no $what after ${secs}s; read $LOGS/$name.log"
        sleep 0.5
    done
}

kubectl_() { "$(bin_dir)/kubectl" --kubeconfig "$KUBECTL_CONFIG" "$@"; }

write_containerd_config() {
    mkdir -p "$RUN/containerd" "$RUN/cni/net.d"
    cat >"$RUN/containerd/config.toml" <<EOF
version = 2
root = "$RUN/containerd/root"
state = "$RUN/containerd/state"
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$RUN/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # Without it the sandbox fails to start when the runtime itself runs with a raised oom_score_adj
  # (as under a CI runner or this machine's process manager): runc may not lower it below its own.
  restrict_oom_score_adj = true
  # The pods' network namespaces under its state dir, not in the host's /run/netns.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # cgroupfs, as the kubelet's cgroupDriver: there is no systemd as PID 1 to ask.
        SystemdCgroup = false
        # runc's state, which would otherwise go to /run/containerd/runc, beside a system containerd's.
        Root = "$RUN/containerd/runc"
        # runc, with the simulated GPU's driver given as NVIDIA's container runtime gives the real one.
        BinaryName = "$RUNTIME"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$RUN/cni/net.d"
EOF
    # The pods talk to the host (apiserver, agent) and to each other, not beyond it: no masquerading,
    # and not isGateway, which would turn on the host's IP forwarding; their route to the host is the
    # bridge's address, which make_node gives it.
    cat >"$RUN/cni/net.d/10-gemtrace.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "gemtrace-k8s", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": false, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_SUBNET", "gateway": "$BRIDGE_IP"}]],
            "routes": [{"dst": "0.0.0.0/0", "gw": "$BRIDGE_IP"}], "dataDir": "$RUN/cni/ipam"}}]}
EOF
}

# The apiserver, which listens on 127.0.0.1 only, at its Service's ClusterIP for the pods: a DNAT of
# what comes in on the bridge (route_localnet lets the bridge's packets go to 127.0.0.1, on this
# bridge alone). The rule, by its comment, is the only thing this cluster adds to the host's tables.
DNAT_RULE=(PREROUTING -i "$BRIDGE" -d "$KUBERNETES_SERVICE_IP" -p tcp --dport 443
           -m comment --comment gemtrace-k8s -j DNAT --to-destination "127.0.0.1:$APISERVER_PORT")

# The node's network and mount namespace: the bridge and its rule, then a process holding a mount
# namespace where NODE_DIRS are bound to NODE_ROOT's, in which containerd and the kubelet start
# (`in_node`). Mount points the host lacks are made, and noted so that `down` removes them.
make_node() {
    command -v iptables >/dev/null || die "iptables is missing: apt-get install -y iptables"
    [ -x "$CNI_BIN/bridge" ] || die "$CNI_BIN/bridge is missing: apt-get install -y containernetworking-plugins"
    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_IP/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    sysctl -qw "net.ipv4.conf.$BRIDGE.route_localnet=1"
    iptables -t nat -A "${DNAT_RULE[@]}"
    local d pid
    mkdir -p "$NODE_ROOT"
    for d in "${NODE_DIRS[@]}"; do
        mkdir -p "$NODE_ROOT$d"
        if ! [ -d "$d" ]; then mkdir -p "$d" && echo "$d" >>"$RUN/made-mount-points"; fi
    done
    : >"$GPU_DRIVER"
    start node-ns unshare --mount --propagation slave sleep infinity
    pid=$(cat "$RUN/pids/node-ns")
    wait_for "the node's mount namespace" 10 node-ns other_mount_ns "$pid"
    for d in "${NODE_DIRS[@]}"; do nsenter --mount="/proc/$pid/ns/mnt" mount --bind "$NODE_ROOT$d" "$d"; done
}

other_mount_ns() { [ "$(readlink /proc/self/ns/mnt)" != "$(readlink "/proc/$1/ns/mnt")" ]; }

# in_node: the words that, before a command given to `start`, run it in the node's mount namespace
# (nsenter execs it: the pid stays the command's).
in_node() { echo nsenter --mount="/proc/$(cat "$RUN/pids/node-ns")/ns/mnt" --; }

# The node's network undone (its mount namespace goes with its last process); mount points it made removed.
unmake_node() {
    while iptables -t nat -D "${DNAT_RULE[@]}" 2>/dev/null; do :; done
    ip link del "$BRIDGE" 2>/dev/null || true
    local d
    if [ -f "$RUN/made-mount-points" ]; then
        while read -r d; do rmdir "$d" 2>/dev/null || true; done <"$RUN/made-mount-points"
    fi
}

write_kubelet_config() {
    cat >"$RUN/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
tlsCertFile: $PKI/kubelet.crt
tlsPrivateKeyFile: $PKI/kubelet.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
failSwapOn: false
clusterDomain: cluster.local
# A CI disk may be fuller than the defaults allow (10 % free): no evictions, and no image garbage
# collection, which would delete the imported images (they cannot be pulled again).
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# Tests wait on status changes: report them quickly.
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
EOF
}

# kube-scheduler's --config: this cluster's connection, one scheduler (no leader election), its
# unauthenticated healthz and metrics on loopback off the usual port, and the extenders of
# deploy/kube-scheduler/config.yaml as they are. With --config the 1.20 scheduler ignores its
# --kubeconfig, --leader-elect and --port flags (--port 0 no longer turns those off, and a port of 0
# in the file is refused): the file says them.
write_scheduler_config() {
    grep -q '^extenders:' "$SCHEDULER_CONFIG_SOURCE" || die "$SCHEDULER_CONFIG_SOURCE has no extenders: section"
    {
        cat <<EOF
apiVersion: kubescheduler.config.k8s.io/v1beta1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: $RUN/scheduler.kubeconfig
leaderElection:
  leaderElect: false
healthzBindAddress: 127.0.0.1:$SCHEDULER_INSECURE_PORT
metricsBindAddress: 127.0.0.1:$SCHEDULER_INSECURE_PORT
EOF
        sed -n '/^extenders:/,$p' "$SCHEDULER_CONFIG_SOURCE"
    } >"$RUN/scheduler-config.yaml"
}

node_ready() {
    [ "$(kubectl_ get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}

cgroup_mode() {
    if [ "$(stat -fc %T /sys/fs/cgroup)" = cgroup2fs ]; then echo v2; else echo v1; fi
}

cmd_up() {
    need_root
    if alive kube-apiserver || alive kubelet || alive containerd || alive etcd; then
        die "a cluster is already up (pids in $RUN/pids); run: $0 down"
    fi
    local other
    if other=$(foreign_cluster); then
        other=${other%%$'\n'*}  # (the first)
        die "another cluster runs on this host (${other#* } pid ${other%% *}, not of $RUN): only one can, as they" \
            "share /var/lib/kubelet and the kubepods cgroups; stop it first (GEMTRACE_K8S_RUN=its run dir $0 down)"
    fi
    local start_s=$SECONDS bin
    cmd_build
    bin=$(bin_dir)
    NODE_IP=$(node_ip)
    teardown quiet
    mkdir -p "$RUN" "$LOGS"
    rm -f "$LOGS"/*.log
    log "starting (logs in $LOGS, node IP $NODE_IP, cgroup $(cgroup_mode), cgroupfs driver)"

    make_pki
    kubeconfig admin admin
    kubeconfig controller-manager controller-manager
    kubeconfig scheduler scheduler
    kubeconfig kubelet kubelet-client

    start etcd etcd --name gemtrace --data-dir "$RUN/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "gemtrace=http://127.0.0.1:$ETCD_PEER_PORT"
    write_containerd_config
    make_node
    # shellcheck disable=SC2046  # in_node's words
    CONTAINERD_BIN=$(containerd_dir)
    start containerd env PATH="$CONTAINERD_BIN:$PATH" GEMTRACE_K8S_GPU_DRIVER="$GPU_DRIVER" $(in_node) \
        "$CONTAINERD_BIN/containerd" --config "$RUN/containerd/config.toml"
    wait_for "etcd health" 30 etcd curl -fsS "http://127.0.0.1:$ETCD_PORT/health"

    # --enable-aggregator-routing: the apiserver calls a webhook's Service at its endpoints (the pod's
    # address) instead of its ClusterIP, which nothing routes here (no kube-proxy): deploy/'s webhook.
    start kube-apiserver "$bin/kube-apiserver" \
        --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" --insecure-port 0 \
        --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
        --client-ca-file "$PKI/ca.crt" \
        --kubelet-certificate-authority "$PKI/ca.crt" \
        --kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" \
        --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
        --kubelet-preferred-address-types InternalIP \
        --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-cluster-ip-range "$SERVICE_CIDR" \
        --authorization-mode Node,RBAC \
        --enable-admission-plugins NodeRestriction,MutatingAdmissionWebhook,ValidatingAdmissionWebhook \
        --enable-aggregator-routing=true \
        --allow-privileged=true
    wait_for "containerd socket" 30 containerd ctr_ -a "$CONTAINERD_SOCK" version
    local images=$RUN/images
    mkdir -p "$images"
    build_images "$bin" "$images"
    ctr_ -a "$CONTAINERD_SOCK" -n k8s.io images import "$images/test-image.tar" >/dev/null
    ctr_ -a "$CONTAINERD_SOCK" -n k8s.io images import "$images/pause-image.tar" >/dev/null

    write_kubelet_config
    mkdir -p "$KUBELET_ROOT/device-plugins"
    touch "$KUBELET_ROOT/.gemtrace-k8s"
    wait_for "apiserver readiness" 90 kube-apiserver kubectl_ get --raw /readyz
    # Only once the apiserver is ready: before its RBAC roles exist, they are refused what they read at
    # start (the extension-apiserver-authentication configmap) and exit.
    start kube-controller-manager "$bin/kube-controller-manager" \
        --kubeconfig "$RUN/controller-manager.kubeconfig" \
        --authentication-kubeconfig "$RUN/controller-manager.kubeconfig" \
        --authorization-kubeconfig "$RUN/controller-manager.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port "$CONTROLLER_MANAGER_PORT" --port 0 \
        --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
        --use-service-account-credentials=true --leader-elect=false
    write_scheduler_config
    start kube-scheduler "$bin/kube-scheduler" --config "$RUN/scheduler-config.yaml" \
        --authentication-kubeconfig "$RUN/scheduler.kubeconfig" \
        --authorization-kubeconfig "$RUN/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT"

    # shellcheck disable=SC2046  # in_node's words
    start kubelet $(in_node) "$bin/kubelet" --config "$RUN/kubelet-config.yaml" \
        --kubeconfig "$RUN/kubelet.kubeconfig" --root-dir "$KUBELET_ROOT" \
        --container-runtime remote --container-runtime-endpoint "unix://$CONTAINERD_SOCK" \
        --pod-infra-container-image "$PAUSE_IMAGE" \
        --hostname-override "$NODE" --node-ip "$NODE_IP" --v 2
    wait_for "node $NODE" 90 kubelet kubectl_ get node "$NODE"
    wait_for "node $NODE Ready" 90 kubelet node_ready
    # Pods are refused until the token controller has made the namespace's service account.
    wait_for "default service account" 60 kube-controller-manager kubectl_ get serviceaccount default
    log "up in $((SECONDS - start_s)) s; KUBECONFIG=$KUBECTL_CONFIG"
}

# --- down ------------------------------------------------------------------------------------------

# stop NAME...: SIGTERM to all at once (each takes a second or two to shut down), SIGKILL after 10 s.
stop() {
    local name pids=() pid left
    for name in "$@"; do
        if alive "$name"; then pids+=("$(cat "$RUN/pids/$name")"); fi
        rm -f "$RUN/pids/$name"
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 50); do
        left=0
        for pid in "${pids[@]}"; do
            if pid_alive "$pid"; then left=1; fi
        done
        [ $left = 1 ] || break
        sleep 0.2
    done
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

# The runc shims of this containerd: they outlive it on purpose, so they are found by its socket.
our_shims() {
    local p
    for p in /proc/[0-9]*; do
        if { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null \
                | grep -q "^[^ ]*/containerd-shim-runc-v2 .*-address $CONTAINERD_SOCK "; then
            basename "$p"
        fi
    done
}

unmount_under() {
    local dir=$1 m
    [ -d "$dir" ] || return 0
    # Deepest first, the dir itself last (the kubelet bind-mounts its root on itself, to make it shared).
    awk -v d="$dir" '$5 == d || index($5, d "/") == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" || true
    done
}

teardown() {
    local quiet=${1:-} pid task cg
    stop kubelet
    if alive containerd; then
        # Containers first, while containerd can still stop them cleanly.
        for task in $(ctr_ -a "$CONTAINERD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr_ -a "$CONTAINERD_SOCK" -n k8s.io tasks kill -s SIGKILL "$task" >/dev/null 2>&1 || true
        done
        for task in $(ctr_ -a "$CONTAINERD_SOCK" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr_ -a "$CONTAINERD_SOCK" -n k8s.io tasks delete -f "$task" >/dev/null 2>&1 || true
        done
    fi
    stop kube-scheduler kube-controller-manager kube-apiserver containerd
    stop etcd
    for pid in $(our_shims); do kill -9 "$pid" 2>/dev/null || true; done
    stop node-ns
    unmake_node
    unmount_under "$RUN"
    if [ -f "$KUBELET_ROOT/.gemtrace-k8s" ]; then
        unmount_under "$KUBELET_ROOT"
        rm -rf "$KUBELET_ROOT"
    fi
    rm -rf "$RUN"
    # The kubelet's cgroups (cgroupfs driver), deepest first.
    for cg in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
        if [ -d "$cg" ]; then find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true; fi
    done
    [ -n "$quiet" ] || log "down (logs kept in $LOGS)"
}

cmd_down() { need_root; teardown; }

cmd_env() {
    local kubectl
    # Also when the build is missing or broken: the logs' place is what a failed `up` needs.
    kubectl=$(bin_dir 2>/dev/null)/kubectl || kubectl="(not built: run $0 build)"
    cat <<EOF
KUBECONFIG=$KUBECTL_CONFIG
KUBECTL=$kubectl
GEMTRACE_K8S_LOGS=$LOGS
GEMTRACE_K8S_NODE=$NODE
GEMTRACE_K8S_TEST_IMAGE=$TEST_IMAGE
GEMTRACE_K8S_CONTAINERD_SOCK=$CONTAINERD_SOCK
GEMTRACE_K8S_CTR=$(containerd_dir)/ctr
GEMTRACE_K8S_DEVICE_PLUGINS=$KUBELET_ROOT/device-plugins
GEMTRACE_K8S_CA_CERT=$PKI/ca.crt
GEMTRACE_K8S_CA_KEY=$PKI/ca.key
GEMTRACE_K8S_NODE_ROOT=$NODE_ROOT
GEMTRACE_K8S_NODE_DIRS=${NODE_DIRS[*]}
GEMTRACE_K8S_NODE_NS_PIDFILE=$RUN/pids/node-ns
GEMTRACE_K8S_GPU_DRIVER=$GPU_DRIVER
EOF
}

main() {
    local cmd=${1:-}
    shift || true
    case "$cmd" in
        build) cmd_build "$@" ;;
        up) cmd_up "$@" ;;
        down) cmd_down "$@" ;;
        kubectl) kubectl_ "$@" ;;
        env) cmd_env "$@" ;;
        *) die "usage: $0 build|up|down|kubectl ARGS|env" ;;
    esac
}

# Sourced (tests/test_cluster_script.py), it defines its functions and runs nothing.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main "$@"; fi
