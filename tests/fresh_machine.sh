#!/usr/bin/env bash
# The README's commands on a fresh machine: a new Debian 12 (or Ubuntu 24.04) root made with
# debootstrap, a fresh clone of this repository in it, and inside, as a newcomer would, as root:
# `make demo`, then `make test`. Proves that those two commands do all the set-up themselves
# (tests/prereqs.sh); prints the demo's first lines and the test totals.
#
#   sudo tests/fresh_machine.sh [bookworm|noble]      (default bookworm; needs debootstrap, network)
#   sudo GEMTRACE_FRESH_ONLY=demo tests/fresh_machine.sh noble      (the first command only)
#
# The pristine root is made once and kept as a tarball outside the repository
# ($GEMTRACE_FRESH_CACHE, default /var/cache/gemtrace-fresh/<suite>.tar; delete it to remake it);
# each run unpacks it afresh under $GEMTRACE_FRESH_WORK (default /var/tmp/gemtrace-fresh/<suite>)
# and leaves it there with the logs (demo.log, test.log) for a look afterwards.
#
# The root is not a container: it shares this machine's kernel (the eBPF tests load their probes
# into it), process ids (bcc reports them as this machine sees them) and network; it has its own
# mount namespace and no CUDA toolkit. Everything mounted for it (/proc, /sys, /dev, and the
# tracefs/debugfs that tests/prereqs.sh mounts inside, as on a new machine) lives in that private
# namespace and goes away with this script.
set -euo pipefail

suite=${1:-bookworm}
top=$(cd "$(dirname "$0")/.." && pwd)
cache=${GEMTRACE_FRESH_CACHE:-/var/cache/gemtrace-fresh}
work=${GEMTRACE_FRESH_WORK:-/var/tmp/gemtrace-fresh}
root="$work/$suite/root"

if [ "$(id -u)" != 0 ]; then
    echo "fresh_machine.sh needs root (debootstrap, chroot, mounts): run it with sudo" >&2
    exit 1
fi

# The mirror this machine's apt uses for Debian (a Debian host's sources, one-line or deb822), so
# the root gets the packages this machine would; Ubuntu's own archive for Ubuntu.
host_debian_mirror() {
    sed -n -e 's/^deb \(\[[^]]*\] \)\?\(https\?:[^ ]*\/debian\/\?\) .*/\2/p' \
        -e 's/^URIs: *\(https\?:[^ ]*\/debian\/\?\)$/\1/p' \
        /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        head -n 1 || true
}
case "$suite" in
    bookworm)
        mirror=${GEMTRACE_FRESH_MIRROR:-$(host_debian_mirror)}
        mirror=${mirror:-http://deb.debian.org/debian}
        mirror=${mirror%/}
        components=main
        sources="deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $mirror-security bookworm-security main"
        script=bookworm
        keyring=/usr/share/keyrings/debian-archive-keyring.gpg
        ;;
    noble)
        mirror=${GEMTRACE_FRESH_MIRROR:-http://archive.ubuntu.com/ubuntu}
        # bcc and prometheus are in universe: the README asks for it on Ubuntu.
        components=main,universe
        sources="deb $mirror noble main universe
deb $mirror noble-updates main universe
deb $mirror noble-security main universe"
        # Every Ubuntu release uses debootstrap's gutsy script; older debootstraps lack the noble link.
        script=/usr/share/debootstrap/scripts/gutsy
        keyring=${GEMTRACE_UBUNTU_KEYRING:-/usr/share/keyrings/ubuntu-archive-keyring.gpg}
        ;;
    *)
        echo "fresh_machine.sh: unknown suite '$suite': bookworm (Debian 12) or noble (Ubuntu 24.04)" >&2
        exit 1
        ;;
esac

# --- The pristine root, made once: what a new machine has before anyone types a gemtrace command,
# plus the README's one manual step (git and make: a fresh Debian or Ubuntu has neither).
tarball="$cache/$suite.tar"
if [ ! -f "$tarball" ]; then
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    [ -f "$keyring" ] || { echo "fresh_machine.sh: $keyring is missing (the $suite archive key); set GEMTRACE_UBUNTU_KEYRING to a copy" >&2; exit 1; }
    mkdir -p "$cache"
    stage=$(mktemp -d "$cache/$suite.XXXXXX")
    chmod 755 "$stage" # the root's own mode: mktemp's 0700 would lock everyone but root out
    echo "fresh_machine.sh: debootstrap $suite from $mirror into $stage (once; cached as $tarball)"
    debootstrap --keyring="$keyring" --components="$components" --include=git,make,ca-certificates \
        "$suite" "$stage" "$mirror" "$script" >"$cache/$suite.debootstrap.log" 2>&1 ||
        { tail -n 20 "$cache/$suite.debootstrap.log" >&2; exit 1; }
    printf '%s\n' "$sources" >"$stage/etc/apt/sources.list"
    rm -rf "$stage"/var/lib/apt/lists/* "$stage"/var/cache/apt/archives/*.deb
    tar -C "$stage" -cf "$tarball.part" .
    mv "$tarball.part" "$tarball"
    rm -rf "$stage"
fi

# --- Everything below runs in a private mount namespace: no mount outlives the script or shows
# on this machine, and removing an old root can never reach through a bind mount.
if [ -z "${GEMTRACE_FRESH_NS:-}" ]; then
    exec unshare --mount --propagation private env GEMTRACE_FRESH_NS=1 "$0" "$@"
fi

t0=$(date +%s)
if grep -q " $work/$suite/" /proc/mounts; then
    echo "fresh_machine.sh: something is still mounted under $work/$suite; unmount it first" >&2
    exit 1
fi
rm -rf "$work/$suite"
mkdir -p "$root"
tar -C "$root" -xf "$tarball"
# Ubuntu's resolv.conf is a link into /run, which gets a tmpfs below: a file of its own instead.
cp --remove-destination /etc/resolv.conf "$root/etc/resolv.conf"
# The root trusts the certificates this machine trusts: where a TLS-inspecting proxy stands between
# this machine and PyPI, its authority is in this machine's bundle and nowhere else.
install -D -m 644 /etc/ssl/certs/ca-certificates.crt "$root/usr/local/share/ca-certificates/this-machine.crt"
chroot "$root" update-ca-certificates >/dev/null 2>&1
# The root has no init to own daemons: packages must not start theirs (prometheus would listen
# on this machine's network). On a real machine systemd would start them.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"

# A fresh clone: only what is committed goes in, as for a newcomer. The project's shared notes
# beside the checkout go along when there are some.
git clone --quiet --no-hardlinks "$top" "$root/root/gemtrace"
if [ -d "$top/../shared" ]; then cp -rL "$top/../shared" "$root/root/shared"; fi

# The root a mount of its own, to become the namespace's root below. /sys without its submounts but
# the cgroups: tracefs and debugfs are for tests/prereqs.sh to mount, as it would on a new machine. /dev/shm
# private: the simulated GPU keeps its state there.
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --bind /sys "$root/sys"
# The cgroup hierarchies a booted machine has mounted (the kubelet of the k8s tier needs them).
mount --rbind /sys/fs/cgroup "$root/sys/fs/cgroup"
mount --bind /dev "$root/dev"
mount --bind /dev/pts "$root/dev/pts"
mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
mount -t tmpfs -o mode=755 tmpfs "$root/run"
printf 'fresh_machine.sh: %s root ready in %ss: %s\n' "$suite" "$(($(date +%s) - t0))" "$root"

# Inside: the root made the mount namespace's root with pivot_root, not chroot: a process that
# enters a mount namespace of its own (a container, as test_bpf_accounting starts one) must see
# the root as its /, else /proc/PID/maps names its files by this machine's paths. A clean
# environment (nothing from this machine's shell, pip or CUDA settings), root, no terminal:
# DEBIAN_FRONTEND as CI sets it.
inside() {
    unshare --mount --propagation private /bin/sh -c '
        cd "$1" && mkdir -p .host && pivot_root . .host && umount -l /.host && rmdir /.host &&
        exec env -i HOME=/root LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive \
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            /bin/bash -c "cd /root/gemtrace && $2"' sh "$root" "$1"
}

rc=0
t=$(date +%s)
inside 'make demo' >"$work/$suite/demo.log" 2>&1 || rc=$?
echo "=== make demo: exit $rc, $(($(date +%s) - t)) s; what prereqs.sh said, and the demo's first lines:"
grep '^prereqs.sh' "$work/$suite/demo.log" || true
if grep -q '^gemtrace demo: the agent is up' "$work/$suite/demo.log"; then
    awk '/^gemtrace demo: the agent is up/ { on = 1 } on && n++ < 14' "$work/$suite/demo.log"
else
    tail -n 25 "$work/$suite/demo.log"
fi
echo "... (whole log: $work/$suite/demo.log)"

if [ "${GEMTRACE_FRESH_ONLY:-}" = demo ]; then
    echo "(make test not run: GEMTRACE_FRESH_ONLY=demo; total $(($(date +%s) - t0)) s)"
    exit "$rc"
fi
t=$(date +%s)
trc=0
inside 'make test' >"$work/$suite/test.log" 2>&1 || trc=$?
echo "=== make test: exit $trc, $(($(date +%s) - t)) s"
# pytest's short summary (every failure and error, one line each) and its totals.
sed -n '/short test summary info/,$p' "$work/$suite/test.log" | tail -n 80
grep -q "short test summary info" "$work/$suite/test.log" || tail -n 30 "$work/$suite/test.log"
echo "(whole log: $work/$suite/test.log; total $(($(date +%s) - t0)) s)"
[ "$rc" = 0 ] && [ "$trc" = 0 ]
