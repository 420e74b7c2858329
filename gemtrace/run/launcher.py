"""`gemtrace run --group NAME -- CMD`: start CMD with the gate preloaded, in a group.

Owns finding the gate and building CMD's environment; it then execs CMD, so the exit status is
CMD's own and no gemtrace process stays around. It never talks to the agent: the gate does. It only
reads a snapshot of the agent's region, for the groups in force and to tell an operator when no agent
is there (the gate then lets CMD run without its group's quotas, which a first run should not hide).

It refuses at once a group the caller is not admitted to (Users=/UnixGroups=), reading the resource
file itself: the agent would run CMD in another group (gemtrace/agent/membership.py decides, and that is
what counts), and a person should hear so before CMD runs, not find it in the agent's log. The file,
not the region: admission lists are as long as an operator makes them and the gates have no use for
them, so they stay out of the file every gate maps; the agent reloads the file within a second of a
change, so the two agree but for that second and a file the agent refused (then both refuse it).
"""

from __future__ import annotations

import os
import pwd
import shlex
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from gemtrace import defaults, mps
from gemtrace.config import ConfigError, GroupConfig, load
from gemtrace.contract import HEARTBEAT_STALE_NS
from gemtrace.region import REGION_FILE, Region, RegionError, RegionLayout, SlotTableLayout
from gemtrace.run import allotment, cache_release
from gemtrace.run.placement import DEFAULT_POLICY

START_AGENT = "sudo systemctl start gemtrace"

CHECKOUT_GATE = Path(__file__).resolve().parents[2] / "build" / "libgemgate.so"


class LaunchError(Exception):
    """Why CMD was not run; `status` is the exit status, as a shell gives it (127: no such command,
    126: not executable, 2: a usage or configuration error)."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def find_gate(environ: Mapping[str, str] = os.environ) -> Path:
    """The gate beside the installed package, or the checkout's build (GEMTRACE_GATE overrides)."""
    candidates = [Path(environ["GEMTRACE_GATE"])] if environ.get("GEMTRACE_GATE") else []
    candidates += [defaults.GATE_INSTALLED, CHECKOUT_GATE]
    for path in candidates:
        if path.is_file():
            return path
    raise LaunchError(
        "the gate library was not found (looked at " + ", ".join(map(str, candidates)) + "); "
        "install the gemtrace package, or run `make` in the checkout"
    )


def child_environment(group: str, state_dir: Path, gate: Path, environ: Mapping[str, str]) -> dict[str, str]:
    env = dict(environ)
    # The gate goes first; an LD_PRELOAD the user already has is kept after it.
    preload = [str(gate)] + [p for p in environ.get("LD_PRELOAD", "").replace(":", " ").split() if p != str(gate)]
    env["LD_PRELOAD"] = " ".join(preload)
    env[defaults.ENV_GROUP] = group
    env[defaults.ENV_STATE_DIR] = str(state_dir)
    # What it starts is one job (a torchrun's ranks, say): the agent gives a group's job that spans GPUs
    # its turns there together, and each other job its own. One started inside keeps its job.
    env.setdefault(defaults.ENV_JOB, uuid.uuid4().hex)
    return env


def read_region(state_dir: Path) -> tuple[RegionLayout | None, SlotTableLayout | None, str]:
    """Snapshots of the agent's region and slots in `state_dir` (readable by any user), or None and why not."""
    try:
        region = Region.open(state_dir, writable=False)
    except FileNotFoundError:
        return None, None, f"no region in {state_dir}"
    except (OSError, RegionError) as e:
        return None, None, str(e)
    try:
        return region.layout, region.slots_layout, ""
    finally:
        region.close()


def agent_absence(layout: RegionLayout | None, why_none: str, path: Path, now_ns: int) -> str | None:
    """Why no agent serves the region at `path`, as the gate judges it (None: an agent is running).
    `now_ns` is CLOCK_MONOTONIC, the heartbeat's clock."""
    if layout is None:
        return why_none
    beat = layout.header.heartbeat_ns
    if beat == 0:
        return f"it stopped and left {path}"
    if now_ns - beat >= HEARTBEAT_STALE_NS:
        return f"the heartbeat in {path} is {(now_ns - beat) / 1e9:.0f} s old"
    return None


def defined_groups(layout: RegionLayout | None, state_dir: Path, config: Path | None) -> tuple[set[str], str]:
    """The groups a program may join, and where that was read: the resource file given with --config,
    else the agent's region (the file in force, readable by any user), else the default file."""
    if config is None:
        if layout is not None:
            names = {g.name.decode() for g in layout.groups if g.name and g.defined}
            return names, f"the running agent's resource file (region in {state_dir})"
        config = defaults.CONFIG_PATH
    try:
        return set(load(config).groups), str(config)
    except ConfigError as e:
        raise LaunchError(f"{e} (no agent's region in {state_dir} either: is `gemtrace agent` running?)") from None


def check_group(group: str, known: set[str], source: str) -> None:
    if group not in known:
        raise LaunchError(f"group {group!r} is not defined in {source} (defined: {', '.join(sorted(known))}); "
                          f"add a [{group}] section or pick one of those")


def check_admission(group: str, config: Path | None, uid: int, gids: list[int]) -> None:
    """Refuse (status 1) a group whose Users=/UnixGroups= leave the caller out. `config` None: the
    default file, if there is one to read (an agent started with another file decides alone)."""
    try:
        settings: GroupConfig | None = load(config or defaults.CONFIG_PATH).groups.get(group)
    except ConfigError:
        if config is not None:
            raise
        return
    if settings is None or settings.admits(uid, gids):
        return
    try:
        who = f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        who = f"uid {uid}"
    raise LaunchError(f"{who} is not admitted to group {group!r} (its Users=/UnixGroups= in "
                      f"{config or defaults.CONFIG_PATH}); ask the host's administrator to admit you, or pick "
                      "another group", 1)


def run(group: str, command: list[str], config: Path | None, state_dir: Path, require_agent: bool = False,
        gpus: int | None = None, policy: str = DEFAULT_POLICY, release_cache: bool | None = None) -> None:
    """Replace this process with `command` in `group` (returns only by raising). Without a running
    agent it says so in one line and runs `command` anyway, or with `require_agent` refuses (status 1).
    With `gpus` it picks that many GPUs by `policy` (gemtrace/run/allotment.py). `release_cache` switches
    the PyTorch cache release on or off (None: GEMTRACE_RELEASE_CACHE, else the group's Oversubscribe;
    gemtrace/run/cache_release.py)."""
    if not command:
        raise LaunchError("no command given: gemtrace run --group NAME -- CMD [ARGS]")
    layout, table, why_none = read_region(state_dir)
    check_group(group, *defined_groups(layout, state_dir, config))
    try:
        check_admission(group, config, os.getuid(), [os.getgid(), *os.getgroups()])
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    absent = agent_absence(layout, why_none, state_dir / REGION_FILE, time.monotonic_ns())
    if absent is not None:
        if require_agent:
            raise LaunchError(f"the gemtrace agent is not running ({absent}); not starting {shlex.join(command)} "
                              f"(--require-agent). Start the agent: {START_AGENT}", 1)
        free = " and every GPU counts as free for --gpus" if gpus is not None else ""
        print(f"gemtrace: warning: the gemtrace agent is not running ({absent}), so {shlex.join(command)} runs "
              f"without the quotas of group {group!r}{free}. Start the agent: {START_AGENT}", file=sys.stderr,
              flush=True)
    env = child_environment(group, state_dir, find_gate(), os.environ)
    running = absent is None
    try:
        env.update(allotment.environment(group, gpus, policy, layout if running else None, config, env,
                                         table if running else None))
    except allotment.AllotmentError as e:
        raise LaunchError(str(e), e.status) from None
    if running and layout is not None:  # an mps group's clients reach the daemon of their GPU (gemtrace/mps.py)
        physical = [g.uuid.decode() for g in layout.gpus[: layout.header.n_gpus]]
        env.update(mps.client_environment(state_dir, group, physical, env))
    try:
        if cache_release.wanted(release_cache, env,
                                cache_release.group_oversubscribes(group, layout if running else None, config)):
            env.update(cache_release.variables(env))
    except cache_release.SwitchError as e:
        raise LaunchError(str(e)) from None
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        raise LaunchError(f"{command[0]}: command not found", 127) from None
    except PermissionError:
        raise LaunchError(f"{command[0]}: permission denied", 126) from None
    except OSError as e:  # e.g. ENOEXEC: not a program this system can run
        raise LaunchError(f"{command[0]}: {e.strerror}", 126) from None


