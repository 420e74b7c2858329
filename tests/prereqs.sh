#!/usr/bin/env bash
# What a checkout needs from the distribution to run the demo and the tests, on Debian 12 or Ubuntu
# 24.04 (with universe): the one list of those packages, and the set-up bcc needs beyond them (the
# running kernel's headers where bcc looks, tracefs and debugfs mounted). `make demo` and `make test`
# run it first; `make prereqs` runs it alone. (The installed package's own dependencies are in
# packaging/deb/control.)
#
#   tests/prereqs.sh demo|deb|image|test
#
# Says nothing and changes nothing when all is there. Otherwise, as root, it installs what is
# missing (apt-get update only then) and does the set-up; not root, it stops with one line naming
# the command that does it.
set -euo pipefail

# demo: build the gate and the simulated GPU (a C compiler, make), make .venv (python3-venv); as root
# also its eBPF accounting (bcc and the kernel's headers, as for the tests), which needs root anyway.
demo_packages=(build-essential python3-venv)
ebpf_packages=(python3-bpfcc)
# deb: the demo's, and dpkg-shlibdeps for the package's library dependencies (packaging/deb/build.sh).
deb_packages=("${demo_packages[@]}" dpkg-dev)
# image: the deb's, and what packaging/image/build.sh makes the image with: a Debian 12 rootfs
# (mmdebstrap, Debian's archive key also on Ubuntu), its OCI image (umoci) and archive (skopeo).
image_tools=(mmdebstrap umoci skopeo debian-archive-keyring)
image_packages=("${deb_packages[@]}" "${image_tools[@]}")
# test: everything the test tiers run, each named by the tests that need it.
test_packages=(
    "${demo_packages[@]}"
    "${ebpf_packages[@]}" # bcc: the bpf tier's uprobes (also needs the kernel's headers: below)
    prometheus    # promtool: test_rules, test_exporter, test_grafana; the server: test_prometheus_live
    lintian       # test_deb
    dpkg-dev      # dpkg-shlibdeps: make deb (test_deb)
    systemd       # systemd-analyze verify: test_deb
    tmux          # test_top's terminal mode
    openssl       # self-signed certificates: test_metrics_access, test_exporter (and the k8s tier's)
    # The k8s tier's one-node cluster (tests/k8s/cluster.sh): Kubernetes built from Debian's source
    # with Go, Debian's reflect2 1.0.2 in place of the vendored 1.0.1, etcd, containerd and runc.
    golang-go golang-github-modern-go-reflect2-dev etcd-server containerd runc curl rsync jq
    containernetworking-plugins iptables  # its pod network: a CNI bridge, the apiserver's ClusterIP
    debian-archive-keyring  # the k8s tier fetches Debian's kubernetes source, also on Ubuntu (universe)
    python3-yaml  # the k8s tier reads deploy/'s manifests with the distribution's python3
    "${image_tools[@]}"  # the k8s tier deploys deploy/ with the image of make image
)
# Daemons that test packages bring, by package: the tests run their own (private ports and data dirs),
# but the packages start them and enable them at boot (Debian's prometheus listening on every
# interface). Installed here, they are kept from starting and left disabled.
declare -A daemon_of=([prometheus]=prometheus [etcd-server]=etcd [containerd]=containerd)

level=${1:-}
ebpf=
case "$level" in
    demo) packages=("${demo_packages[@]}")
          if [ "$(id -u)" = 0 ]; then packages+=("${ebpf_packages[@]}"); ebpf=1; fi ;;
    deb) packages=("${deb_packages[@]}") ;;
    image) packages=("${image_packages[@]}") ;;
    test) packages=("${test_packages[@]}"); ebpf=1 ;;
    *) echo "usage: $0 demo|deb|image|test" >&2; exit 2 ;;
esac

if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
    echo "prereqs.sh knows Debian and Ubuntu only: install the equivalents of ${packages[*]} yourself" >&2
    exit 0
fi

missing=()
for p in "${packages[@]}"; do
    [ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null)" = "ii " ] || missing+=("$p")
done

# bcc compiles its BPF C against /lib/modules/$(uname -r)/build. A uprobe program does not depend on
# the exact kernel version, so where the running kernel has no headers package (a cloud or VM
# kernel) the distribution's current headers serve.
kver=$(uname -r)
need_headers=
need_mounts=()
if [ -n "$ebpf" ]; then
    [ -e "/lib/modules/$kver/build" ] || need_headers=1
    # bcc finds its trace events under tracefs and debugfs; systemd mounts them on a normal boot,
    # containers and chroots often do not.
    mountpoint -q /sys/kernel/tracing || need_mounts+=(tracefs:/sys/kernel/tracing)
    mountpoint -q /sys/kernel/debug || need_mounts+=(debugfs:/sys/kernel/debug)
fi

[ ${#missing[@]} -eq 0 ] && [ -z "$need_headers" ] && [ ${#need_mounts[@]} -eq 0 ] && exit 0

if [ "$(id -u)" != 0 ]; then
    what=${missing[*]}
    [ -z "$need_headers" ] || what="${what:+$what, }headers for kernel $kver"
    [ ${#need_mounts[@]} -eq 0 ] || what="${what:+$what, }${need_mounts[*]%%:*} mounted"
    if [ "$level" != test ]; then
        echo "make $level needs $what: run 'sudo apt-get install ${missing[*]}'" >&2
    else
        echo "make test needs $what: run 'sudo make prereqs' (or 'sudo make test': its tests need root anyway, for eBPF and the .deb)" >&2
    fi
    exit 1
fi

# The flavour of the distribution's headers metapackage, and the directories it installs.
if grep -qi '^ID=ubuntu' /etc/os-release 2>/dev/null; then
    flavour=generic
else
    flavour=$(dpkg --print-architecture)
fi

# Headers already installed for another kernel version serve as well as a new package would.
headers_dir() {
    if [ -d "/usr/src/linux-headers-$kver" ]; then
        echo "/usr/src/linux-headers-$kver"
    else
        ls -d /usr/src/linux-headers-*-"$flavour" 2>/dev/null | sort -V | tail -n 1
    fi
}
if [ -n "$need_headers" ] && [ -z "$(headers_dir)" ]; then need_headers_package=1; else need_headers_package=; fi

if [ ${#missing[@]} -gt 0 ] || [ -n "$need_headers_package" ]; then
    log=$(mktemp)
    trap 'rm -f "$log"' EXIT
    apt-get update -qq >"$log" 2>&1 || { cat "$log" >&2; echo "prereqs.sh: apt-get update failed (above)" >&2; exit 1; }
    if [ -n "$need_headers_package" ]; then
        # The running kernel's own headers when the archive has them (a distribution kernel), else
        # the distribution's current ones.
        if apt-cache show "linux-headers-$kver" >/dev/null 2>&1; then
            missing+=("linux-headers-$kver")
        else
            missing+=("linux-headers-$flavour")
        fi
    fi
    unknown=()
    for p in "${missing[@]}"; do
        apt-cache show "$p" >/dev/null 2>&1 || unknown+=("$p")
    done
    if [ ${#unknown[@]} -gt 0 ]; then
        if grep '^[WE]:' "$log" >&2; then
            echo "prereqs.sh: apt-get update could not fetch the package lists (above), so ${unknown[*]} are unknown" >&2
        else
            echo "prereqs.sh: the package archive has no ${unknown[*]}: on Ubuntu, enable universe ('sudo add-apt-repository universe')" >&2
        fi
        exit 1
    fi
    daemons=()
    for p in "${missing[@]}"; do [ -z "${daemon_of[$p]:-}" ] || daemons+=("${daemon_of[$p]}"); done
    # policy-rc.d is how Debian asks maintainer scripts not to start a service (invoke-rc.d and
    # deb-systemd-invoke consult it); one the host already has is left alone.
    policy=/usr/sbin/policy-rc.d own_policy=
    if [ ${#daemons[@]} -gt 0 ] && [ ! -e "$policy" ]; then
        own_policy=1
        trap 'rm -f "$log" "$policy"' EXIT
        # Asked with the service's name among its arguments (invoke-rc.d may put --quiet first).
        # shellcheck disable=SC2016  # the $a and ${a%.service} are the written script's
        printf '#!/bin/sh\n# tests/prereqs.sh, while it installs: not these daemons\nfor a; do case "${a%%.service}" in %s) exit 101 ;; esac; done\nexit 0\n' \
            "$(IFS='|'; echo "${daemons[*]}")" >"$policy"
        chmod 0755 "$policy"
    fi
    echo "prereqs.sh: installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$log" 2>&1 ||
        { cat "$log" >&2; echo "prereqs.sh: apt-get install failed (above)" >&2; exit 1; }
    [ -z "$own_policy" ] || rm -f "$policy"
    for d in "${daemons[@]}"; do
        systemctl disable --quiet "$d.service" 2>/dev/null || true
        [ ! -d /run/systemd/system ] || systemctl stop "$d.service" 2>/dev/null || true
    done
    [ ${#daemons[@]} -eq 0 ] || echo "prereqs.sh: ${daemons[*]} installed for the tests, which run their own: not running, not enabled at boot"
fi

if [ -n "$need_headers" ] && [ ! -e "/lib/modules/$kver/build" ]; then
    hdr=$(headers_dir)
    [ -n "$hdr" ] || { echo "prereqs.sh: no kernel headers under /usr/src after installing them" >&2; exit 1; }
    mkdir -p "/lib/modules/$kver"
    ln -sfn "$hdr" "/lib/modules/$kver/build"
    # The headers' common half: Debian's linux-headers-X-common, Ubuntu's linux-headers-X.
    for src in "${hdr%-*}-common" "${hdr%-*}"; do
        if [ -d "$src" ] && [ "$src" != "$hdr" ]; then ln -sfn "$src" "/lib/modules/$kver/source"; break; fi
    done
    echo "prereqs.sh: kernel $kver has no headers; bcc compiles against $hdr"
fi

for m in "${need_mounts[@]}"; do
    fs=${m%%:*} dir=${m#*:}
    mount -t "$fs" "$fs" "$dir" ||
        echo "prereqs.sh: could not mount $fs on $dir; the bpf tests may fail" >&2
done
