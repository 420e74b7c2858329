"""tests/k8s/cluster.sh's apt, without a cluster: where the host's source lists do not offer
Debian's kubernetes source package (Ubuntu, or Debian without deb-src), the script fetches it with an
apt of its own under its cache, and the host's apt files are neither read for it nor written. The
functions run from the script sourced, on a local archive in place of Debian's mirror."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from simgpu_env import REPO

pytestmark = pytest.mark.unit

SCRIPT = REPO / "tests" / "k8s" / "cluster.sh"
VERSION = "1.20.5+really1.20.2-1.1"


def sourced(code: str, cache: Path) -> subprocess.CompletedProcess[str]:
    """`code` run in bash after sourcing cluster.sh with its cache in `cache`."""
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{SCRIPT}"; {code}'],
                          env=dict(os.environ, GEMTRACE_K8S_CACHE=str(cache)), capture_output=True, text=True,
                          timeout=60)


def local_archive(root: Path) -> str:
    """A bookworm archive on disk holding only the kubernetes source package; its file: URI."""
    sources = root / "dists" / "bookworm" / "main" / "source"
    sources.mkdir(parents=True)
    stanza = (f"Package: kubernetes\nBinary: kubernetes-client\nVersion: {VERSION}\nMaintainer: x <x@example.org>\n"
              "Architecture: any\nFormat: 3.0 (quilt)\nDirectory: pool/main/k/kubernetes\n\n")
    (sources / "Sources.gz").write_bytes(gzip.compress(stanza.encode()))
    (root / "dists" / "bookworm" / "Release").write_text(
        "Suite: bookworm\nCodename: bookworm\nComponents: main\nArchitectures: amd64 source\n")
    return f"file:{root}"


def test_sourcing_the_script_runs_nothing(tmp_path: Path) -> None:
    out = sourced("echo sourced", tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (0, "sourced\n", "")


def test_another_instances_kubelet_is_found_and_our_own_is_not(tmp_path: Path) -> None:
    # A process named kubelet that is not ours: `up` refuses to start beside it (they would share
    # /var/lib/kubelet and the kubepods cgroups).
    fake = tmp_path / "bin" / "kubelet"  # sleep, by the name the kernel shows (comm)
    fake.parent.mkdir()
    shutil.copy(shutil.which("sleep") or "/bin/sleep", fake)
    other = subprocess.Popen([str(fake), "30"])
    try:
        run = tmp_path / "run"
        # (A real cluster of another run may be up on this host too: its processes are listed as well.)
        mine = f"{other.pid} kubelet"
        out = sourced(f'RUN="{run}"; sleep 0.2; foreign_cluster', tmp_path)
        assert out.returncode == 0 and mine in out.stdout.splitlines(), out
        (run / "pids").mkdir(parents=True)
        (run / "pids" / "kubelet").write_text(f"{other.pid}\n")  # now it is this run dir's own
        out = sourced(f'RUN="{run}"; foreign_cluster', tmp_path)
        assert mine not in out.stdout.splitlines(), out
        assert (out.returncode == 1) == (out.stdout == ""), out
    finally:
        other.kill()
        other.wait()


def test_the_deb_src_lines_name_the_keyring_and_bookworm(tmp_path: Path) -> None:
    out = sourced("deb_src_lines /usr/share/keyrings/k.gpg http://mirror.example/debian", tmp_path)
    assert out.stdout.splitlines() == [
        "deb-src [signed-by=/usr/share/keyrings/k.gpg] http://mirror.example/debian bookworm main",
        "deb-src [signed-by=/usr/share/keyrings/k.gpg] http://mirror.example/debian bookworm-updates main",
    ]


@pytest.mark.parametrize(("says", "where"), [
    ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3", "/usr/bin"),  # Debian 12
    ("containerd github.com/containerd/containerd/v2 2.2.1 ", "cache"),  # Ubuntu 24.04's updates
    ("containerd containerd.io v2.0.0 abc", "cache"),
    (None, "cache"),  # none installed: the cache's, which `build` fetches
])
def test_the_cluster_runs_a_containerd_that_serves_kubernetes_1_20_s_cri(tmp_path: Path, says: str | None,
                                                                          where: str) -> None:
    """Kubernetes 1.20's kubelet speaks the CRI's v1alpha2, which containerd 2 dropped: where the host's is 2
    or newer, the cluster's containerd, ctr and shim come from the cache (bookworm's, fetched by `build`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if says is not None:
        fake = bin_dir / "containerd"
        fake.write_text(f"#!/bin/sh\necho '{says}'\n")
        fake.chmod(0o755)
    (bin_dir / "awk").symlink_to(shutil.which("awk") or "/usr/bin/awk")  # (nothing else of the host's)
    out = sourced(f'PATH="{bin_dir}"; containerd_dir', tmp_path)
    expected = "/usr/bin" if where == "/usr/bin" else f"{tmp_path}/containerd-bookworm/usr/bin"
    assert (out.returncode, out.stdout.strip()) == (0, expected), out


@pytest.mark.skipif(not shutil.which("apt-get"), reason="Debian and Ubuntu only")
def test_the_source_package_comes_from_an_apt_of_its_own_and_the_hosts_apt_is_untouched(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    uri = local_archive(tmp_path / "archive")
    host_apt = [Path("/etc/apt/sources.list.d"), Path("/var/lib/apt/lists")]
    before = {d: sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir()) for d in host_apt if d.is_dir()}
    # What ensure_deb_src does once it found neither apt offering the package (choose_apt left the
    # script's own apt chosen), with a local archive (trusted: it has no signature) in place of
    # Debian's mirror and keyring.
    out = sourced(f"""
        private_apt_opts
        [ -z "$(showsrc_version)" ]
        mkdir -p "$APT_DIR/sources.list.d" "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial"
        echo "deb-src [trusted=yes] {uri} bookworm main" >"$APT_DIR/sources.list"
        apt-get "${{APT_OPTS[@]}}" update -qq
        echo "version=$(showsrc_version)"
        echo "opts=${{APT_OPTS[*]}}"
    """, cache)
    assert out.returncode == 0, out.stderr
    assert f"version={VERSION}" in out.stdout.splitlines()
    assert f"Dir::State::Lists={cache}/apt/lists" in out.stdout
    after = {d: sorted((p.name, p.stat().st_mtime_ns) for p in d.iterdir()) for d in host_apt if d.is_dir()}
    assert after == before


def test_the_host_s_gemtrace_directories_have_one_owning_test_run_at_a_time(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # test_deb's purge removes the directories the cluster's node binds over: the second owner waits,
    # and past its wait says who holds them.
    import testkit

    monkeypatch.setattr(testkit, "HOST_DIRS_LOCK", tmp_path / "host-dirs.lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; import testkit, pathlib;"
         "testkit.HOST_DIRS_LOCK = pathlib.Path(sys.argv[1]);"
         "cm = testkit.owning_host_dirs('the other run'); cm.__enter__(); print('held', flush=True); time.sleep(30)",
         str(tmp_path / "host-dirs.lock")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": f"{REPO}:{Path(__file__).parent}"})
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(TimeoutError, match=r"waited 1 s .* which the other run \(pid \d+\) holds"):
            with testkit.owning_host_dirs("this run", wait_s=1):
                pass
    finally:
        holder.kill()
        holder.wait()
    with testkit.owning_host_dirs("this run", wait_s=5):  # free again once its holder is gone
        assert (tmp_path / "host-dirs.lock").read_text().startswith("this run (pid")


def test_the_scheduler_runs_with_the_extenders_deploy_gives_the_operator(tmp_path: Path) -> None:
    """kube-scheduler's --config: the cluster's own connection, no leader election, its healthz and
    metrics on loopback off the usual port, and the `extenders:` of deploy/kube-scheduler/config.yaml
    unchanged (tests/test_deploy.py checks those)."""
    out = sourced(f'RUN="{tmp_path}"; write_scheduler_config; cat "$RUN/scheduler-config.yaml"', tmp_path)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    operators = yaml.safe_load((REPO / "deploy" / "kube-scheduler" / "config.yaml").read_text())
    assert config == {**operators, "clientConnection": {"kubeconfig": f"{tmp_path}/scheduler.kubeconfig"},
                      "leaderElection": {"leaderElect": False}, "healthzBindAddress": "127.0.0.1:20251",
                      "metricsBindAddress": "127.0.0.1:20251"}
