"""The PyTorch cache release of `gemtrace run` (gemtrace/run/cache_release.py, gemtrace/run/torch_hook/).

This machine has no torch: the programs import a stand-in `torch` (put on PYTHONPATH here) whose
`cuda.is_initialized()` is true once the program has started the simulated libcuda through the gate
and whose `cuda.empty_cache()` appends a line to a file. The group is held by the real agent: it is
capped (MaxUtil) beside a busy group, and the program keeps launching kernels.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from agent_host import Host, gemtrace, host  # noqa: F401 (host is a fixture)
from simgpu_env import LIBCUDA, RT_CLIENT, require_build

from gemtrace.run import cache_release
from gemtrace.run.torch_hook import gemtrace_cache_release as hook  # type: ignore[import-not-found]

CONFIG = "[busy]\nMinUtil = 0.5\n\n[capped]\nMaxUtil = 0.3\nMemoryLimit = 1GiB\nOversubscribe = true\n\n[plain]\n"

STANDIN_TORCH = """
import os, time
class cuda:
    started = False
    @staticmethod
    def is_initialized():
        return cuda.started
    @staticmethod
    def empty_cache():
        with open(os.environ["STANDIN_TORCH_LOG"], "a") as f:
            f.write(f"{time.monotonic()}\\n")
"""

USER_SITECUSTOMIZE = """
import os
open(os.environ["USER_SITE_MARK"], "w").write("ran")
"""

# Imports torch, starts CUDA through the gate, launches 2 ms kernels for argv[1] seconds.
TRAIN = f"""
import ctypes, sys, time
import torch
cuda = ctypes.CDLL({str(LIBCUDA)!r})
ctx, module, func = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
assert not (cuda.cuInit(0) or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) or cuda.cuCtxSetCurrent(ctx)
            or cuda.cuModuleLoadData(ctypes.byref(module), b"simgpu")
            or cuda.cuModuleGetFunction(ctypes.byref(func), module, b"spin"))
torch.cuda.started = True
ns = ctypes.c_uint64(2_000_000)
params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(ns), ctypes.c_void_p))
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(4):
        assert cuda.cuLaunchKernel(func, 1, 1, 1, 1, 1, 1, 0, None, params, None) == 0
    assert cuda.cuCtxSynchronize() == 0
print("done", flush=True)
"""

NO_TORCH = """
import sys, threading
print(threading.active_count(), "gemtrace_cache_release" in sys.modules, flush=True)
"""


@pytest.mark.unit
def test_the_flag_then_the_variable_then_the_groups_oversubscribe_decide() -> None:
    env = cache_release.ENV_RELEASE_CACHE
    assert cache_release.wanted(None, {}, True) and not cache_release.wanted(None, {}, False)
    assert not cache_release.wanted(None, {env: "0"}, True) and cache_release.wanted(None, {env: "1"}, False)
    assert cache_release.wanted(True, {env: "0"}, False) and not cache_release.wanted(False, {env: "1"}, True)
    with pytest.raises(cache_release.SwitchError, match="neither on nor off"):
        cache_release.wanted(None, {env: "maybe"}, True)


@pytest.mark.unit
def test_the_hook_reads_the_names_and_offsets_gemtrace_hands_it() -> None:
    assert (hook.ENV_RELEASE_CACHE, hook.ENV_LAYOUT) == (cache_release.ENV_RELEASE_CACHE, cache_release.ENV_LAYOUT)
    lay = hook.parse(cache_release.layout_description())
    assert lay["region_file"] == "region" and lay["held"] == 1 and lay["max_slots"] == 2048
    variables = cache_release.variables({"PYTHONPATH": "/mine:/other"})
    assert variables["PYTHONPATH"] == f"{cache_release.HOOK_DIR}:/mine:/other"


def _setup(host: Host, tmp: Path) -> tuple[dict[str, str], Path, Path]:  # noqa: F811
    host.config.write_text(CONFIG)
    (tmp / "standin" / "torch").mkdir(parents=True)
    (tmp / "standin" / "torch" / "__init__.py").write_text(STANDIN_TORCH)
    (tmp / "usersite").mkdir()
    (tmp / "usersite" / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    (tmp / "train.py").write_text(TRAIN)
    (tmp / "notorch.py").write_text(NO_TORCH)
    env = host.env()
    env["PYTHONPATH"] = f"{tmp / 'standin'}:{tmp / 'usersite'}:{env['PYTHONPATH']}"
    env.pop(cache_release.ENV_RELEASE_CACHE, None)
    return env, tmp / "site-mark", tmp / "empty-cache"


def _run(host: Host, env: dict[str, str], group: str, name: str, *args: str,  # noqa: F811
         **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(gemtrace("run", "--group", group, "--config", str(host.config), "--state-dir",
                                     str(host.state_dir), *args, "--", extra.pop("python", sys.executable),
                                     *extra.pop("argv")),
                            env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.e2e
def test_a_held_oversubscribing_group_empties_its_cache_once_per_hold(host: Host, tmp_path: Path) -> None:  # noqa: F811
    require_build()
    env, mark, log = _setup(host, tmp_path)
    agent = host.start_agent()
    busy = subprocess.Popen(gemtrace("run", "--group", "busy", "--config", str(host.config), "--state-dir",
                                     str(host.state_dir), "--", str(RT_CLIENT), "launch-loop", "--kernel-ns",
                                     "2000000", "--launches-per-iter", "4", "--seconds", "600"),
                            env=host.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = "4"
    try:
        on = _run(host, env, "capped", "on", argv=[str(tmp_path / "train.py"), seconds],
                  STANDIN_TORCH_LOG=str(log), USER_SITE_MARK=str(mark))
        off_flag = _run(host, env, "capped", "off", "--no-release-cache", argv=[str(tmp_path / "train.py"), seconds],
                        STANDIN_TORCH_LOG=str(log) + ".flag", USER_SITE_MARK=str(mark) + ".flag")
        off_env = _run(host, env, "capped", "off", argv=[str(tmp_path / "train.py"), seconds],
                       STANDIN_TORCH_LOG=str(log) + ".env", USER_SITE_MARK=str(mark) + ".env",
                       GEMTRACE_RELEASE_CACHE="0")
        outputs = [p.communicate(timeout=60) for p in (on, off_flag, off_env)]
    finally:
        busy.kill()
        busy.wait()
        agent.proc.terminate()
        agent.proc.wait(20)
    for (out, err), p in zip(outputs, (on, off_flag, off_env), strict=True):
        assert p.returncode == 0 and out == "done\n", err
        assert "cache release is off" not in err, err
    calls = [float(t) for t in log.read_text().split()]
    # Held most of the time (MaxUtil 0.3 beside a busy group): many holds in 4 s, each emptied once,
    # never once per 10 ms look.
    print(f"{len(calls)} empty_cache calls in {seconds} s")
    assert 3 <= len(calls) < float(seconds) / 0.03, calls
    assert not Path(str(log) + ".flag").exists() and not Path(str(log) + ".env").exists()
    for suffix in ("", ".flag", ".env"):
        assert Path(str(mark) + suffix).read_text() == "ran"


@pytest.mark.e2e
def test_a_program_that_never_imports_torch_gets_no_thread(host: Host, tmp_path: Path) -> None:  # noqa: F811
    require_build()
    env, mark, _ = _setup(host, tmp_path)
    proc = _run(host, env, "capped", "notorch", argv=[str(tmp_path / "notorch.py")], USER_SITE_MARK=str(mark))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == "1 False\n" and mark.read_text() == "ran"


@pytest.mark.e2e
def test_a_group_without_oversubscribe_gets_no_hook_unless_asked(host: Host, tmp_path: Path) -> None:  # noqa: F811
    require_build()
    env, mark, _ = _setup(host, tmp_path)
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(f"{tmp_path / 'usersite'}:", "")  # no sitecustomize of the user's
    probe = ("import os, sys\ntry:\n import sitecustomize\n site = sitecustomize.__file__\nexcept ImportError:\n"
             " site = None\nprint(os.environ.get('GEMTRACE_RELEASE_CACHE'), os.environ['PYTHONPATH'].split(':')[0], "
             "site != None and 'torch_hook' not in site)")
    # The venv's interpreter may have a distribution's sitecustomize, python3 none: either is kept as it was.
    for python in dict.fromkeys((sys.executable, shutil.which("python3") or sys.executable)):
        had = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True).stdout.split()[2]
        got = []
        for args in ((), ("--release-cache",)):
            proc = _run(host, env, "plain", "probe", *args, argv=["-c", probe], python=python)
            out, err = proc.communicate(timeout=60)
            # "Error in sitecustomize": site.py's word for a sitecustomize that raised
            assert proc.returncode == 0 and "Error in sitecustomize" not in err, err
            got.append(out.split())
        assert got[0] == ["None", str(tmp_path / "standin"), had]
        assert got[1] == ["1", str(cache_release.HOOK_DIR), had]
