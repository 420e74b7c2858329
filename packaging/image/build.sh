#!/usr/bin/env bash
# Builds the container image that deploy/ runs (`gemtrace kube-plugin`, `kube-webhook`, `kube-extender`) from
# Debian packages and the project's own .deb, with no image registry involved:
#
#   packaging/image/build.sh BUILD    (what `make image` runs; BUILD is the top Makefile's build/)
#
# writes BUILD/image/gemtrace-image.tar, a `docker save` archive of gemtrace/gemtrace:<version> that
# `ctr -n k8s.io images import` (containerd) and `docker load` read. The rootfs is Debian 12
# (bookworm) made by mmdebstrap, with BUILD/gemtrace_<version>_amd64.deb (`make deb`) installed by apt,
# openssl (the webhook makes its certificate with it) and the Kubernetes extra's Python packages at
# the versions constraints.txt pins (grpcio and its typing_extensions, protobuf, PyYAML; Debian's are
# older than the generated gRPC modules need). umoci makes the OCI image of it, skopeo the archive.
#
# Cached: the archive is rebuilt only when its inputs change: the .deb's files, the pins, this script
# (Debian's packages are not inputs: GEMTRACE_IMAGE_REBUILD=1 forces a build, to take their updates). Needs root (mmdebstrap installs packages as root), network access to the Debian
# mirror and, once per pin, to PyPI. Never writes outside BUILD.
set -euo pipefail
umask 022

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
build=${1:?usage: $0 BUILD_DIR}
build=$(cd "$build" && pwd)

die() { echo "image/build.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap installs the image's packages as root): sudo make image"
for tool in mmdebstrap umoci skopeo; do
    command -v "$tool" >/dev/null || die "$tool is missing: run 'sudo make prereqs' (or apt-get install mmdebstrap umoci skopeo)"
done

version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$top/gemtrace/__init__.py")
[ -n "$version" ] || die "no __version__ in gemtrace/__init__.py"
ref="gemtrace/gemtrace:$version"
deb="$build/gemtrace_${version}_amd64.deb"
[ -f "$deb" ] || die "$deb is missing: run 'make deb' first (or 'make image')"

out="$build/image"
mkdir -p "$out"
archive="$out/gemtrace-image.tar"

# The Python packages the image adds to Debian's: the kube extra's, at the lock's versions, as wheels
# for the image's Python (3.11, whatever the host's is).
pins=$(grep -iE '^(grpcio|protobuf|pyyaml|typing_extensions)==' "$top/constraints.txt" | LC_ALL=C sort)
[ "$(echo "$pins" | wc -l)" = 4 ] ||
    die "constraints.txt lacks a pin of grpcio, typing_extensions, protobuf or PyYAML: run 'make lock'"
wheel_opts=(--only-binary=:all: --no-deps --implementation cp --python-version 3.11 --abi cp311
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

# The .deb by its files' names, modes and contents: its changelog and man page carry the last
# commit's date, which alone must not cost a rebuild.
deb_files() {
    dpkg-deb -f "$deb"
    # shellcheck disable=SC2016  # expanded by tar's shell, per file
    dpkg-deb --fsys-tarfile "$deb" | tar -x --to-command='case "$TAR_FILENAME" in
        */changelog.gz|*/man1/*) ;; *) echo "$TAR_FILENAME $TAR_MODE"; sha256sum ;; esac'
}
key=$({ deb_files; echo "$pins"; sha256sum "$0" | cut -d' ' -f1; } | sha256sum | cut -d' ' -f1)
if [ -f "$archive" ] && [ "$(cat "$out/key" 2>/dev/null)" = "$key" ] && [ "${GEMTRACE_IMAGE_REBUILD:-0}" != 1 ]; then
    echo "$archive"
    exit 0
fi

pip=${PIP:-}
if [ -z "$pip" ]; then
    if [ -x "$top/.venv/bin/pip" ]; then pip="$top/.venv/bin/pip"; else pip="python3 -m pip"; fi
fi
wheels="$out/wheels"
if [ "$(cat "$wheels/pins" 2>/dev/null)" != "$pins" ]; then
    rm -rf "$wheels" && mkdir -p "$wheels"
    # shellcheck disable=SC2086  # $pip may be "python3 -m pip"
    echo "$pins" | $pip download --quiet "${wheel_opts[@]}" -r /dev/stdin -d "$wheels"
    echo "$pins" >"$wheels/pins"
fi

work=$(mktemp -d "$out/work.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp "$deb" "$work/gemtrace.deb"

mirror=${GEMTRACE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
# --variant=apt: the essential packages and apt, which installs the .deb with its dependencies. The
# docs, man pages and apt's lists are left out: nobody reads them in the container.
# The pip install runs on the host, into the rootfs: the image has no pip, and --python-version
# makes it pick the image's wheels.
mmdebstrap --quiet --variant=apt --include=openssl,ca-certificates \
    --keyring="$keyring" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook="copy-in $work/gemtrace.deb /tmp" \
    --customize-hook='chroot "$1" apt-get install -y -q --no-install-recommends /tmp/gemtrace.deb' \
    --customize-hook='rm -f "$1/tmp/gemtrace.deb"' \
    --customize-hook="$pip install --quiet --no-index --find-links $wheels ${wheel_opts[*]} --target \"\$1/usr/local/lib/python3.11/dist-packages\" -r $wheels/pins" \
    --customize-hook='chroot "$1" gemtrace --help >/dev/null' \
    --customize-hook='chroot "$1" python3 -c "import sys; sys.path.insert(0, \"/usr/lib/gemtrace/python\"); from gemtrace.kube import deviceplugin, extender, webhook"' \
    --customize-hook='chroot "$1" apt-get clean' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/log/* "$1"/var/cache/ldconfig/aux-cache' \
    bookworm "$work/rootfs.tar" "deb $mirror bookworm main" >"$work/mmdebstrap.log" 2>&1 \
    || { cat "$work/mmdebstrap.log" >&2; die "mmdebstrap failed (above)"; }

layout="$work/oci"
umoci init --layout "$layout"
umoci new --image "$layout:$version"
umoci raw add-layer --image "$layout:$version" "$work/rootfs.tar"
# A user with no home and no privilege for the webhook; the plugin's DaemonSet runs as root.
umoci config --image "$layout:$version" --config.entrypoint gemtrace \
    --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --config.env PYTHONDONTWRITEBYTECODE=1 --config.workingdir / \
    --config.label org.opencontainers.image.title=gemtrace \
    --config.label "org.opencontainers.image.version=$version" \
    --author gemtrace --created "$(date -u -d "@$(git -C "$top" log -1 --format=%ct 2>/dev/null || date +%s)" +%Y-%m-%dT%H:%M:%SZ)"
rm -f "$archive"
skopeo copy --quiet "oci:$layout:$version" "docker-archive:$archive:$ref"
echo "$key" >"$out/key"
echo "$ref" >"$out/ref"
echo "$archive"
