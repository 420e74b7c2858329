"""Runs `gemtrace agent` (the CLI, as users start it) with a bench-only observer thread: the bench's
way to tell what each of the agent's threads costs and where.

    python bench/agent_sampler.py OUT [--hz HZ] -- agent --config ... (the CLI's arguments)

Every second it writes OUT.threads.json ({native thread id: thread name}), so that the bench can read
each thread's CPU from /proc/PID/task/TID/stat at no cost to the agent. With --hz > 0 it also samples
every thread's stack that often (sys._current_frames) and, at exit, writes OUT.stacks.json: per
thread name, the innermost gemtrace frames and how many samples saw them. Sampling costs the agent
CPU itself: the bench measures with --hz 0 and profiles in a separate run.
"""

from __future__ import annotations

import atexit
import collections
import json
import runpy
import sys
import threading
import time
from pathlib import Path

DEPTH = 4  # gemtrace frames kept per sample, innermost first


def main() -> None:
    out = Path(sys.argv[1])
    rest = sys.argv[2:]
    hz = 0.0
    if rest[:1] == ["--hz"]:
        hz, rest = float(rest[1]), rest[2:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    stacks: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    me = threading.get_ident()

    def names() -> None:
        tmp = out.with_name(out.name + ".threads.tmp")
        tmp.write_text(json.dumps({t.native_id: t.name for t in threading.enumerate()}))
        tmp.replace(out.with_name(out.name + ".threads.json"))

    def sample_once(by_ident: dict[int, str]) -> None:
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            where: list[str] = []
            f = frame
            while f is not None and len(where) < DEPTH:
                code = f.f_code
                if "gemtrace" in code.co_filename or "bench" in code.co_filename:
                    where.append(f"{Path(code.co_filename).stem}.{code.co_name}:{f.f_lineno}")
                f = f.f_back
            stacks[by_ident.get(ident, "?")][" < ".join(where) or "(outside gemtrace)"] += 1

    def observe() -> None:
        next_names = 0.0
        by_ident: dict[int, str] = {}
        while True:
            now = time.monotonic()
            if now >= next_names:
                names()
                by_ident = {t.ident or 0: t.name for t in threading.enumerate()}
                next_names = now + 1.0
            if hz > 0:
                sample_once(by_ident)
                time.sleep(1 / hz)
            else:
                time.sleep(1.0)

    def dump() -> None:
        if hz > 0:
            out.with_name(out.name + ".stacks.json").write_text(
                json.dumps({name: dict(c.most_common(40)) for name, c in stacks.items()}))

    atexit.register(dump)
    threading.Thread(target=observe, name="bench-sampler", daemon=True).start()
    sys.argv = ["gemtrace", *rest]
    runpy.run_module("gemtrace.cli", run_name="__main__")


if __name__ == "__main__":
    main()
