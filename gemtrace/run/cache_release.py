"""The PyTorch cache release of `gemtrace run` (issue 14, Gemini_UM's second idea): while the
scheduler holds a process's group, its caching allocator's idle blocks are handed back
(`torch.cuda.empty_cache()`), so that in an oversubscribing group the driver need not page a held
job's idle cache out to make room for the group that runs. docs/frameworks.md has the user's side.

Owns whether a `gemtrace run` gets it and the variables that switch it on. The hook itself is
gemtrace/run/torch_hook/ (a `sitecustomize` put first on PYTHONPATH, which runs the user's own
sitecustomize too): it runs in the user's interpreter, which need not have gemtrace installed, so it
is stdlib-only and reads the region through the offsets this module hands it in ENV_LAYOUT, taken
from gemtrace/region/layout.py's ctypes mirror (one home for the layout).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path

from gemtrace import defaults
from gemtrace import region as rg
from gemtrace.config import ConfigError, load

ENV_RELEASE_CACHE = "GEMTRACE_RELEASE_CACHE"  # "1": on, "0": off; unset: on for Oversubscribe groups
ENV_LAYOUT = "GEMTRACE_CACHE_RELEASE_LAYOUT"  # the region's offsets, for the hook
HOOK_DIR = Path(__file__).resolve().parent / "torch_hook"
SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                "off": False}


class SwitchError(ValueError):
    """A GEMTRACE_RELEASE_CACHE value that is neither on nor off."""


def wanted(flag: bool | None, environ: Mapping[str, str], oversubscribes: bool) -> bool:
    """Whether the command gets the hook: the command-line flag (None: not given), else
    GEMTRACE_RELEASE_CACHE, else whether its group oversubscribes (only there is a held group's
    cache paged rather than merely kept)."""
    if flag is not None:
        return flag
    text = environ.get(ENV_RELEASE_CACHE, "").strip().lower()
    if not text:
        return oversubscribes
    if text not in SWITCH_WORDS:
        raise SwitchError(f"{ENV_RELEASE_CACHE}={environ[ENV_RELEASE_CACHE]!r} is neither on nor off; set it to 1 "
                          "(release PyTorch's cache while the group is held) or 0 (never), or unset it (on for "
                          "groups with Oversubscribe)")
    return SWITCH_WORDS[text]


def group_oversubscribes(group: str, layout: rg.RegionLayout | None, config: Path | None) -> bool:
    """Whether `group` has Oversubscribe: from the running agent, else from the resource file."""
    if layout is not None and config is None:
        for entry in layout.groups:
            if entry.defined and entry.name.decode(errors="replace") == group:
                return bool(entry.oversubscribe_limit)
    try:
        settings = load(config or defaults.CONFIG_PATH).groups.get(group)
    except ConfigError:
        return False  # the launcher has checked the group already; no file means no Oversubscribe known
    return settings is not None and settings.oversubscribe


def layout_description() -> str:
    """The offsets the hook reads, as `name=value` pairs: where an assignment's pid and group, the GPU
    count and each control word's `held` lie, and the value that means held."""
    def offset(cls: type[ctypes.Structure], field: str) -> int:
        return int(getattr(cls, field).offset)

    control = rg.RegionLayout.control.offset
    facts = {
        "n_gpus": offset(rg.RegionLayout, "header") + offset(rg.Header, "n_gpus"),
        "assigned": rg.RegionLayout.assigned.offset,
        "assignment": ctypes.sizeof(rg.Assignment),
        "assigned_pid": offset(rg.Assignment, "pid"),
        "assigned_group": offset(rg.Assignment, "group"),
        "control": control + offset(rg.Control, "held"),
        "control_gpu": ctypes.sizeof(rg.Control) * rg.MAX_GROUPS,
        "control_group": ctypes.sizeof(rg.Control),
        "max_slots": rg.MAX_SLOTS,
        "max_groups": rg.MAX_GROUPS,
        "max_gpus": rg.MAX_GPUS,
        "held": rg.HELD,
        "region_size": rg.REGION_SIZE,
    }
    return ",".join(f"{k}={v}" for k, v in facts.items()) + f",region_file={rg.REGION_FILE}"


def variables(environ: Mapping[str, str]) -> dict[str, str]:
    """What switches the hook on in the command's environment: the hook's directory first on
    PYTHONPATH (the user's entries kept after it), the switch, the layout."""
    path = [str(HOOK_DIR)] + [p for p in environ.get("PYTHONPATH", "").split(":") if p and p != str(HOOK_DIR)]
    return {"PYTHONPATH": ":".join(path), ENV_RELEASE_CACHE: "1", ENV_LAYOUT: layout_description()}
