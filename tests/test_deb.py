"""The Debian package, end to end: `make deb`, lintian, apt install, the installed command and agent
on the simulated GPU, purge.

Owns nothing but the machine's package state for its duration: it installs gemtrace with apt and
purges it at the end, so it refuses to run where gemtrace is already installed (it would remove an
operator's installation). Everything after the install runs the INSTALLED code (/usr/bin/gemtrace
with /usr/bin/python3, from / with a clean environment), never the checkout's.

Root and apt (make test as root). The steps share one installation and run in file order.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from simgpu_env import LIBCUDA, RT_CLIENT, simgpu_env
from testkit import GiB, free_port, owning_host_dirs, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
GEMTRACE = Path("/usr/bin/gemtrace")
UNIT = Path("/lib/systemd/system/gemtrace.service")
CONF = Path("/etc/gemtrace/resource.conf")


def _version() -> str:
    text = (REPO / "gemtrace" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    assert match, "gemtrace/__init__.py has no __version__"
    return match.group(1)


def _sh(*args: str | Path, timeout: float = 600, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}", pytrace=False
        )
    return proc  # type: ignore[no-any-return]


def _installed() -> bool:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", "gemtrace"], capture_output=True, text=True)
    return proc.returncode == 0 and "installed" in proc.stdout and "not-installed" not in proc.stdout


def _clean_env(**extra: str) -> dict[str, str]:
    """What a person's shell gives the installed command: no venv, no PYTHONPATH, no checkout."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
    env.update(extra)
    return env


def _installed_gemtrace(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return _sh("/usr/bin/python3", GEMTRACE, *args, env=env or _clean_env(), cwd="/", timeout=timeout, check=check)


@pytest.fixture(scope="module")
def deb() -> Path:
    if os.geteuid() != 0:
        pytest.fail("test_deb needs root (it installs the package with apt)", pytrace=False)
    if _installed():
        pytest.fail("gemtrace is installed on this machine: test_deb would purge it; remove it first", pytrace=False)
    _sh("make", "-C", REPO, "deb", timeout=1200)
    path = BUILD / f"gemtrace_{_version()}_{_sh('dpkg', '--print-architecture').stdout.strip()}.deb"
    assert path.is_file(), f"`make deb` did not build {path}"
    return path


@pytest.fixture(scope="module")
def installed(deb: Path) -> Iterator[Path]:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Its purge removes the directories a test cluster's node binds over: one owner at a time.
    with owning_host_dirs("tests/test_deb.py"):
        _sh("apt-get", "install", "-y", deb, env=env, timeout=900)
        try:
            yield deb
        finally:
            if _installed():  # a step failed before test_purge: leave the machine clean anyway
                subprocess.run(["apt-get", "purge", "-y", "gemtrace"], env=env, capture_output=True, timeout=600)


def test_lintian_reports_no_errors(deb: Path) -> None:
    if shutil.which("lintian") is None:
        pytest.fail("lintian is missing: apt-get install lintian", pytrace=False)
    proc = _sh("lintian", "--no-tag-display-limit", deb, check=False)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("E:")]
    assert errors == [], proc.stdout
    assert proc.returncode in (0, 1), proc.stderr  # 1 means tags were emitted; 2 a lintian failure


def test_files_are_in_place(installed: Path) -> None:
    expected = [
        GEMTRACE,
        Path("/usr/lib/gemtrace/libgemgate.so"),
        Path("/usr/lib/gemtrace/python/gemtrace/__init__.py"),
        Path("/usr/lib/gemtrace/python/pynvml.py"),
        CONF,
        Path("/etc/default/gemtrace"),
        UNIT,
        Path("/usr/share/man/man1/gemtrace.1.gz"),
        Path("/usr/share/doc/gemtrace/copyright"),
        Path("/usr/share/gemtrace/prometheus/prometheus.example.yml"),
        Path("/usr/share/gemtrace/grafana/provisioning/dashboards/gemtrace.yml"),
        Path("/usr/share/gemtrace/grafana/provisioning/datasources/gemtrace.yml"),
    ]
    expected += [Path("/usr/share/gemtrace/bpf") / p.name for p in sorted((REPO / "bpf").glob("*.[ch]"))]
    expected += [
        Path("/usr/share/gemtrace/grafana/provisioning/dashboards/gemtrace") / p.name
        for p in sorted((REPO / "grafana/provisioning/dashboards/gemtrace").glob("*.json"))
    ]
    expected += [
        Path("/usr/share/gemtrace/prometheus/rules") / p.name for p in sorted((REPO / "grafana/rules").glob("*.yml"))
    ]
    missing = [str(p) for p in expected if not p.is_file()]
    assert missing == []
    # The README and docs/, compressed over 4 kB as Debian policy wants, but the alerts' runbook.
    doc = Path("/usr/share/doc/gemtrace")
    for source in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        plain, packed = doc / source.name, doc / f"{source.name}.gz"
        text = plain.read_text() if plain.is_file() else gzip.decompress(packed.read_bytes()).decode()
        assert text == source.read_text(), source.name
    assert (doc / "alerts.md").is_file()
    # Every alert's runbook_url opens the installed runbook, at a heading of it.
    rules = Path("/usr/share/gemtrace/prometheus/rules/gemtrace.rules.yml").read_text()
    urls = re.findall(r"runbook_url: (\S+)", rules)
    assert urls and {u.split("#")[0] for u in urls} == {"file:///usr/share/doc/gemtrace/alerts.md"}
    headings = re.findall(r"^## (\w+)$", (doc / "alerts.md").read_text(), re.M)
    assert {u.split("#")[1] for u in urls} <= {h.lower() for h in headings}
    assert list((REPO / "bpf").glob("*.c")), "bpf/ holds no BPF program to package"
    assert os.access(GEMTRACE, os.X_OK)
    # The gate installed is the one built, stripped: same dynamic symbols.
    built = _sh("nm", "-D", "--defined-only", BUILD / "libgemgate.so").stdout.split("\n")
    packed = _sh("nm", "-D", "--defined-only", "/usr/lib/gemtrace/libgemgate.so").stdout.split("\n")
    assert sorted(packed) == sorted(built)
    # Conffiles: an operator's edits survive upgrades.
    conffiles = _sh("dpkg-query", "-W", "-f=${Conffiles}", "gemtrace").stdout
    assert str(CONF) in conffiles and "/etc/default/gemtrace" in conffiles
    # Enabled on install, also where systemd does not run (CI containers).
    assert Path("/etc/systemd/system/multi-user.target.wants/gemtrace.service").is_symlink()
    # Bytecode compiled by postinst for the system python3.
    assert list(Path("/usr/lib/gemtrace/python/gemtrace/__pycache__").glob("__init__.*.pyc"))


def test_unit_verifies(installed: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: apt-get install systemd", pytrace=False)
    proc = _sh("systemd-analyze", "verify", UNIT, check=False)
    # Complaints about other units on the machine are not ours; any line naming ours is.
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "gemtrace" in line]
    assert proc.returncode == 0 and ours == [], proc.stdout + proc.stderr
    unit = UNIT.read_text()
    assert "ExecStart=/usr/bin/gemtrace agent $GEMTRACE_OPTS" in unit
    assert "EnvironmentFile=-/etc/default/gemtrace" in unit and "Restart=on-failure" in unit
    # No driver (exit 78) is not restarted for ever; a pidfd per gated process fits.
    assert re.findall(r"^RestartPreventExitStatus=(.*)$", unit, re.M) == ["78"]
    # ... and leaves the unit inactive, not failed: the host does not show as degraded.
    assert re.findall(r"^SuccessExitStatus=(.*)$", unit, re.M) == ["78"]
    assert re.findall(r"^LimitNOFILE=(.*)$", unit, re.M) == ["65536"]
    caps = re.search(r"^CapabilityBoundingSet=(.*)$", unit, re.M)
    assert caps and set(caps.group(1).split()) == {
        "CAP_BPF",
        "CAP_PERFMON",
        "CAP_SYS_ADMIN",
        "CAP_SYS_RESOURCE",
        "CAP_KILL",
        "CAP_SYS_PTRACE",
        "CAP_DAC_READ_SEARCH",
        "CAP_SYS_NICE",
        "CAP_CHOWN",
    }


def test_installed_code_is_used(installed: Path) -> None:
    proc = _sh(
        "/usr/bin/python3",
        "-c",
        "import gemtrace, pynvml, bcc, structlog, psutil, prometheus_client;"
        " print(gemtrace.__file__); print(pynvml.__file__); print(gemtrace.__version__)",
        env=_clean_env(PYTHONPATH="/usr/lib/gemtrace/python"),  # where /usr/bin/gemtrace looks first
        cwd="/",
    )
    gemtrace_file, pynvml_file, version = proc.stdout.split()
    assert gemtrace_file == "/usr/lib/gemtrace/python/gemtrace/__init__.py"
    assert pynvml_file == "/usr/lib/gemtrace/python/pynvml.py"
    assert version == _version()


def test_installed_run_puts_the_shipped_torch_hook_first_on_pythonpath(installed: Path) -> None:
    """The cache release's hook is a folder of gemtrace/run/ that is no package: the .deb must ship it where
    the installed `gemtrace run` looks for it, or PyTorch programs would start without it and no error."""
    proc = _sh(
        "/usr/bin/python3",
        "-c",
        "from gemtrace.run import cache_release; print(cache_release.variables({})['PYTHONPATH'])",
        env=_clean_env(PYTHONPATH="/usr/lib/gemtrace/python"),
        cwd="/",
    )
    hook = Path(proc.stdout.strip())
    assert hook == Path("/usr/lib/gemtrace/python/gemtrace/run/torch_hook")
    assert sorted(p.name for p in hook.glob("*.py")) == ["gemtrace_cache_release.py", "sitecustomize.py"]


def test_help_and_man_page_name_every_command_and_option(installed: Path) -> None:
    """`man gemtrace` documents every flag that the installed command's --help shows."""
    out = _installed_gemtrace("--help").stdout
    commands = {"agent", "run", "check-config", "status", "top"}
    missing = [c for c in sorted(commands) if c not in out]
    assert missing == [], out
    man = gzip.decompress(Path("/usr/share/man/man1/gemtrace.1.gz").read_bytes()).decode()
    flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", out))
    for command in sorted(commands):
        assert f'.SS "{command.replace("-", chr(92) + "-")}"' in man, command
        help_text = _installed_gemtrace(command, "--help").stdout  # every command has its --help
        flags |= set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", help_text))
    assert {"--no-ebpf", "--probe-mode", "--log-level", "--json", "--once", "--interval", "--require-agent"} <= flags
    undocumented = [f for f in sorted(flags) if "\\fB" + f.replace("-", "\\-") + "\\fR" not in man]
    assert undocumented == []
    # man renders the installed page without a warning.
    proc = _sh("man", "--warnings", "-l", "/usr/share/man/man1/gemtrace.1.gz", env=_clean_env(MANWIDTH="80"))
    assert proc.stderr == "" and "--require-agent" in proc.stdout


def test_check_config_accepts_the_shipped_file(installed: Path) -> None:
    out = _installed_gemtrace("check-config", str(CONF)).stdout
    assert "default" in out
    # With no argument, the same file: the agent's.
    assert _installed_gemtrace("check-config").stdout == out and out.startswith(f"{CONF}: OK")


def test_installed_agent_without_the_nvidia_driver_exits_78(installed: Path, tmp_path: Path) -> None:
    """As on a host without the driver: the simulated NVML reports the driver not loaded."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    env = simgpu_env(blocker / "simgpu", base=_clean_env())
    proc = _installed_gemtrace("agent", "--config", str(CONF), "--state-dir", str(tmp_path / "state"),
                               "--listen", "127.0.0.1:0", "--no-ebpf", env=env, check=False)
    assert proc.returncode == 78, proc.stderr
    assert "NVIDIA driver" in proc.stderr and "libnvidia-ml.so.1" in proc.stderr


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


def _unit_capabilities() -> list[str]:
    caps = re.search(r"^CapabilityBoundingSet=(.*)$", UNIT.read_text(), re.M)
    assert caps, f"{UNIT} has no CapabilityBoundingSet"
    return caps.group(1).split()


def _samples(text: str, name: str, **labels: str) -> list[float]:
    """The values of the samples of `name` whose labels include `labels`."""
    values = []
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            values.append(float(match.group(2)))
    return values


def _wait_metrics(
    port: int, agent: subprocess.Popen[bytes], log: Path, ready: Callable[[str], bool], what: str, timeout: float = 60
) -> str:
    def shown() -> str:
        text = _metrics(port)
        return text if ready(text) else ""

    try:
        text: str = wait_until(f"/metrics to show {what}", shown, timeout, step=0.2, proc=agent, retry_on=(OSError,))
    except AssertionError as e:
        pytest.fail(f"{e}\n{log.read_text()}", pytrace=False)
    return text


def test_installed_agent_and_run_on_the_simulated_gpu(installed: Path, tmp_path: Path) -> None:
    """The installed agent, with no capability beyond the unit's, and the installed gate via `gemtrace run`."""
    if not LIBCUDA.exists() or not RT_CLIENT.exists():
        pytest.fail("build/simgpu is missing: run `make simgpu`", pytrace=False)
    # A first group, as the README tells an operator: an edit of the installed conffile.
    CONF.write_text(CONF.read_text() + "\n[G]\nMaxUtil=0.5\nMemoryLimit=1GiB\n")
    state = tmp_path / "state"
    state.mkdir()
    port = free_port()
    env = simgpu_env(tmp_path / "simgpu", memory="16GiB", base=_clean_env(GEMTRACE_STATE_DIR=str(state)))
    # The unit's capability bounding set and NoNewPrivileges, as systemd would apply them: bcc's
    # probes must attach with no more (ProtectSystem and the rest need systemd as PID 1).
    bounding = "-all," + ",".join("+" + c.removeprefix("CAP_").lower() for c in _unit_capabilities())
    log = tmp_path / "agent.log"
    with log.open("w") as log_file:
        agent = subprocess.Popen(
            ["setpriv", "--no-new-privs", f"--bounding-set={bounding}", "/usr/bin/python3", str(GEMTRACE), "agent",
             "--config", str(CONF), "--state-dir", str(state), "--listen", f"127.0.0.1:{port}"],
            env=env, cwd="/", stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    holder = None
    try:
        limit = "gemtrace_group_memory_limit_bytes"
        text = _wait_metrics(port, agent, log, lambda t: bool(_samples(t, limit, group="G")), "group G")
        assert _samples(text, limit, group="G") == [GiB], text

        proc = _installed_gemtrace("run", "--group", "G", "--", str(RT_CLIENT), "meminfo", env=env)
        meminfo = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        assert meminfo["total"] == GiB, proc.stdout  # the installed gate reports the group's limit
        assert 0 < meminfo["free"] <= GiB

        # A process of the group holding 256 MiB: accounted by the agent's eBPF probes.
        holder = subprocess.Popen(
            ["/usr/bin/python3", str(GEMTRACE), "run", "--group", "G", "--",
             str(RT_CLIENT), "alloc", "--api", "v2", "--hold", "60", "256MiB"],
            env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        # `gemtrace run` may exec the command or wait for it: find the process by its group and comm.
        text = _wait_metrics(
            port, agent, log,
            lambda t: 256 << 20 in _samples(t, "gemtrace_process_memory_bytes", group="G", comm=RT_CLIENT.name),
            "256 MiB for the holder of group G", timeout=30,
        )  # fmt: skip
        assert _samples(text, "gemtrace_probes_attached")[0] > 0, text
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        agent.terminate()
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    assert agent.returncode == 0, log.read_text()


def test_reinstall_keeps_the_operators_conffile_edit(installed: Path) -> None:
    marker = "\n# edited by test_deb\n"
    CONF.write_text(CONF.read_text() + marker)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _sh("apt-get", "install", "-y", "--reinstall", "--no-install-recommends", installed, env=env, timeout=600)
    assert marker in CONF.read_text()
    assert Path("/etc/systemd/system/multi-user.target.wants/gemtrace.service").is_symlink()


def test_purge_leaves_nothing(installed: Path) -> None:
    Path("/run/gemtrace").mkdir(exist_ok=True)  # as the unit's RuntimeDirectory leaves it (preserved)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _sh("apt-get", "purge", "-y", "gemtrace", env=env, timeout=600)
    assert not _installed()
    left = [
        p
        for p in (
            GEMTRACE,
            UNIT,
            Path("/etc/gemtrace"),
            Path("/etc/default/gemtrace"),
            Path("/usr/lib/gemtrace"),
            Path("/usr/share/gemtrace"),
            Path("/run/gemtrace"),
            Path("/var/lib/gemtrace"),
            Path("/etc/systemd/system/multi-user.target.wants/gemtrace.service"),
        )
        if p.exists() or p.is_symlink()
    ]
    assert left == []
