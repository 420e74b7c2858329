"""tests/prereqs.sh leaves the daemons that test packages bring (prometheus, etcd, containerd) neither
started nor enabled at boot, whether the install succeeds or fails, and leaves no policy-rc.d behind.
Run against a fake apt-get, dpkg-query and systemctl, in a mount namespace of its own whose /usr/sbin
and /lib/modules are empty directories of the test's: nothing of the host's is installed or changed."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from simgpu_env import REPO

pytestmark = pytest.mark.e2e

SCRIPT = REPO / "tests" / "prereqs.sh"
DAEMON_PACKAGES = {"prometheus": "prometheus", "etcd-server": "etcd", "containerd": "containerd"}


def fakes(tmp: Path, install_status: int) -> Path:
    """A bin dir whose dpkg-query says the daemons' packages are missing, whose apt-get records what
    policy-rc.d answers for each daemon and another service during the install, and whose systemctl
    records its calls."""
    bin_dir, calls = tmp / "bin", tmp / "calls"
    bin_dir.mkdir()
    missing = " ".join(DAEMON_PACKAGES)
    scripts = {
        "dpkg-query": f'for a; do last=$a; done\ncase " {missing} " in *" $last "*) exit 1;; esac\nprintf "ii "\n',
        "apt-cache": "exit 0\n",
        "apt-get": (f'echo "apt-get $*" >>{calls}\ncase "$*" in *install*)\n'
                    f'  for s in {" ".join(DAEMON_PACKAGES.values())} ssh; do\n'
                    f'    if [ -x /usr/sbin/policy-rc.d ]; then /usr/sbin/policy-rc.d --quiet $s start; '
                    f'echo "policy $s $?" >>{calls}; fi\n'
                    f'  done\n  exit {install_status};;\nesac\n'),
        "systemctl": f'echo "systemctl $*" >>{calls}\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_prereqs(tmp: Path, install_status: int) -> tuple[subprocess.CompletedProcess[str], list[str], list[str]]:
    """prereqs.sh test in the namespace: its result, the fake tools' calls, what /usr/sbin held after."""
    bin_dir = fakes(tmp, install_status)
    sbin, modules = tmp / "sbin", tmp / "modules"
    sbin.mkdir()
    (modules / platform.release()).mkdir(parents=True)
    (modules / platform.release() / "build").symlink_to(tmp)  # the headers are there: no headers step
    inner = (f"mount --bind {shlex.quote(str(sbin))} /usr/sbin && "
             f"mount --bind {shlex.quote(str(modules))} /lib/modules && "
             f"PATH={shlex.quote(str(bin_dir))}:$PATH {shlex.quote(str(SCRIPT))} test")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", inner],
                         capture_output=True, text=True, timeout=60)
    calls = (tmp / "calls").read_text().splitlines() if (tmp / "calls").exists() else []
    return out, calls, sorted(p.name for p in sbin.iterdir())


@pytest.fixture(autouse=True)
def _root_and_unshare() -> None:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.fail("needs root and unshare (util-linux): a mount namespace of its own", pytrace=False)


def test_the_daemons_are_kept_from_starting_and_left_disabled(tmp_path: Path) -> None:
    out, calls, sbin = run_prereqs(tmp_path, install_status=0)
    assert out.returncode == 0, out.stderr
    # While it installs, policy-rc.d refuses the daemons (101) and nothing else (0).
    assert [c for c in calls if c.startswith("policy ")] == [
        "policy prometheus 101", "policy etcd 101", "policy containerd 101", "policy ssh 0"]
    assert [c for c in calls if c.startswith("systemctl ")] == [
        f"systemctl disable --quiet {d}.service" for d in DAEMON_PACKAGES.values()]
    assert sbin == []  # its policy-rc.d is gone
    assert out.stdout.splitlines()[-1] == ("prereqs.sh: prometheus etcd containerd installed for the tests, which "
                                           "run their own: not running, not enabled at boot")


def test_a_failed_install_leaves_no_policy_behind(tmp_path: Path) -> None:
    out, calls, sbin = run_prereqs(tmp_path, install_status=100)
    assert out.returncode == 1 and "apt-get install failed" in out.stderr
    assert "policy prometheus 101" in calls
    assert sbin == []
