#!/usr/bin/env bash
# Builds BUILD/gemtrace_<version>_<arch>.deb from the checkout with dpkg-deb, no debhelper: the
# package is a handful of files, and every one of them is placed here where a reader can see it.
#
#   packaging/deb/build.sh BUILD     (what `make deb` runs; BUILD is the top Makefile's build/)
#
# Needs the gate already built (BUILD/libgemgate.so and gemtrace/contract.py: `make gate`), the venv (`make venv`: the man
# page is generated from gemtrace's argument parser), dpkg-dev (dpkg-shlibdeps) and pip with network
# access once, to fetch the pinned nvidia-ml-py wheel (vendor.txt) that the package
# carries because Debian does not package it. Nothing is fetched at install time.
# Never writes outside BUILD.
set -euo pipefail
umask 022

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
build=${1:?usage: $0 BUILD_DIR}
mkdir -p "$build"
build=$(cd "$build" && pwd)

# The single version source is gemtrace/__init__.py.
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$top/gemtrace/__init__.py")
[ -n "$version" ] || { echo "build.sh: no __version__ in gemtrace/__init__.py" >&2; exit 1; }
arch=$(dpkg --print-architecture)

gate="$build/libgemgate.so"
[ -f "$gate" ] || { echo "build.sh: $gate is missing: run 'make gate' first (or 'make deb')" >&2; exit 1; }
# Generated with the gate from the C headers, not in git: the package's Python needs it.
[ -f "$top/gemtrace/contract.py" ] || { echo "build.sh: gemtrace/contract.py is missing: run 'make gate' first (or 'make deb')" >&2; exit 1; }

# Reproducible: timestamps come from the last commit when there is one.
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$top" log -1 --format=%ct 2>/dev/null || date +%s)}
export SOURCE_DATE_EPOCH
# Maintainer: Debian's DEBFULLNAME/DEBEMAIL when set, else the author of the last commit.
name=${DEBFULLNAME:-$(git -C "$top" log -1 --format=%an 2>/dev/null || true)}
email=${DEBEMAIL:-$(git -C "$top" log -1 --format=%ae 2>/dev/null || true)}
[ -n "$name" ] && [ -n "$email" ] || { echo "build.sh: set DEBFULLNAME and DEBEMAIL (no git history)" >&2; exit 1; }
maintainer="$name <$email>"

stage="$build/deb"
root="$stage/root"
rm -rf "$root"
mkdir -p "$root/DEBIAN" "$stage/wheels"

# --- pynvml, carried: fetched once per pin (hash-checked), unpacked beside gemtrace's code.
pylib="$root/usr/lib/gemtrace/python"
install -d "$pylib"
wheel=$(ls "$stage"/wheels/nvidia_ml_py-*.whl 2>/dev/null | head -n 1 || true)
pinned=$(sed -n 's/^nvidia-ml-py==\([^ ]*\).*/\1/p' "$here/vendor.txt")
if [ -z "$wheel" ] || [ "$(basename "$wheel")" != "nvidia_ml_py-$pinned-py3-none-any.whl" ]; then
    rm -f "$stage"/wheels/*.whl
    pip=${PIP:-}
    if [ -z "$pip" ]; then
        if [ -x "$top/.venv/bin/pip" ]; then pip="$top/.venv/bin/pip"; else pip="python3 -m pip"; fi
    fi
    $pip download --quiet --no-deps --only-binary=:all: --require-hashes \
        -r "$here/vendor.txt" -d "$stage/wheels"
    wheel=$(ls "$stage"/wheels/nvidia_ml_py-*.whl | head -n 1)
fi
python3 - "$wheel" "$pylib" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    with open(sys.argv[2] + "/pynvml.py", "wb") as out:
        out.write(wheel.read("pynvml.py"))
PY

# --- gemtrace's Python code, for the system python3 (bytecode is compiled by postinst).
(cd "$top" && find gemtrace -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0) |
    while IFS= read -r -d '' f; do install -D -m 0644 "$top/$f" "$pylib/$f"; done
install -D -m 0755 "$here/gemtrace.py" "$root/usr/bin/gemtrace"

# --- the gate, the BPF sources, Grafana and Prometheus files.
install -D -m 0644 "$gate" "$root/usr/lib/gemtrace/libgemgate.so"
strip --strip-unneeded --remove-section=.comment --remove-section=.note "$root/usr/lib/gemtrace/libgemgate.so"
install -d "$root/usr/share/gemtrace/bpf"
find "$top/bpf" -maxdepth 1 -type f \( -name '*.c' -o -name '*.h' \) -exec install -m 0644 -t "$root/usr/share/gemtrace/bpf" {} +
install -d "$root/usr/share/gemtrace/grafana"
cp -r "$top/grafana/provisioning" "$root/usr/share/gemtrace/grafana/"
install -D -m 0644 "$top/grafana/prometheus.example.yml" "$root/usr/share/gemtrace/prometheus/prometheus.example.yml"
install -d "$root/usr/share/gemtrace/prometheus/rules"
find "$top/grafana/rules" -maxdepth 1 -type f -name '*.yml' -exec install -m 0644 -t "$root/usr/share/gemtrace/prometheus/rules" {} +

# --- configuration (conffiles), the unit, docs.
install -D -m 0644 "$here/resource.conf" "$root/etc/gemtrace/resource.conf"
install -D -m 0644 "$here/default" "$root/etc/default/gemtrace"
install -D -m 0644 "$here/gemtrace.service" "$root/lib/systemd/system/gemtrace.service"
# The man page: gemtrace.1.in's prose with the synopsis and options from the argument parser
# (manpage.py), so it says what `gemtrace --help` says. The venv's Python has gemtrace's imports.
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$top/.venv/bin/python" ]; then python="$top/.venv/bin/python"; else python=python3; fi
fi
install -d "$root/usr/share/man/man1"
"$python" "$here/manpage.py" "$here/gemtrace.1.in" "$version" "$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%d)" \
    > "$root/usr/share/man/man1/gemtrace.1"
gzip -9n "$root/usr/share/man/man1/gemtrace.1"
# Docs, as Debian policy 12.3 wants them (over 4 kB compressed), but alerts.md: the alert rules'
# runbook_url points at file:///usr/share/doc/gemtrace/alerts.md, which must open as it is.
doc="$root/usr/share/doc/gemtrace"
install -D -m 0644 "$here/copyright" "$doc/copyright"
install -m 0644 "$top/README.md" "$top"/docs/*.md "$doc/"
find "$doc" -maxdepth 1 -name '*.md' ! -name alerts.md -size +4k -exec gzip -9n {} +
changed=$(date -u -R -d "@$SOURCE_DATE_EPOCH")
printf 'gemtrace (%s) unstable; urgency=medium\n\n  * Release %s (see the git history for the changes).\n\n -- %s  %s\n' \
    "$version" "$version" "$maintainer" "$changed" | gzip -9n > "$doc/changelog.gz"
chmod 0644 "$doc/changelog.gz"

# --- control: the gate's shared-library dependencies computed, the rest from the distribution.
shl="$stage/shlibs"
rm -rf "$shl" && mkdir -p "$shl/debian"
printf 'Source: gemtrace\n\nPackage: gemtrace\nArchitecture: any\n' > "$shl/debian/control"
shlibs=$(cd "$shl" && dpkg-shlibdeps -O "$root/usr/lib/gemtrace/libgemgate.so" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
[ -n "$shlibs" ] || { echo "build.sh: dpkg-shlibdeps found no dependencies for the gate" >&2; exit 1; }
for script in postinst prerm postrm; do install -m 0755 "$here/$script" "$root/DEBIAN/$script"; done
printf '/etc/default/gemtrace\n/etc/gemtrace/resource.conf\n' > "$root/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s/@VERSION@/$version/" -e "s/@ARCH@/$arch/" -e "s/@SHLIBS@/$shlibs/" -e "s/@SIZE@/$size/" -e "s|@MAINTAINER@|$maintainer|" \
    "$here/control" > "$root/DEBIAN/control"
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z | xargs -0 md5sum) \
    > "$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/md5sums" "$root/DEBIAN/conffiles" "$root/DEBIAN/control"

find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
out="$build/gemtrace_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$out" >/dev/null
echo "$out"
