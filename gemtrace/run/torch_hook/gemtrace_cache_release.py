"""The watcher of gemtrace's PyTorch cache release, loaded by sitecustomize.py once `torch` is
imported: a daemon thread that, once torch has initialised CUDA, reads this process's group's held
word on the GPUs it uses every 10 ms and calls `torch.cuda.empty_cache()` once each time the group
becomes held (on any of them).

Stdlib only (the user's interpreter need not have gemtrace): it maps the agent's region read-only and
reads it at the offsets in GEMTRACE_CACHE_RELEASE_LAYOUT, which `gemtrace run` took from
gemtrace/region/layout.py. Its slot is the one whose assignment names this pid (the gate claims a slot when
CUDA starts and the agent places it). The slot's own figures (which GPUs it used) are not read: they
live in the gate's chunk, which only the gate maps, so a hold on any of the region's GPUs counts.
Nothing it meets is raised into the program: it says why it stopped in one line on stderr.
"""

import mmap
import os
import struct
import sys
import threading
import time

ENV_RELEASE_CACHE = "GEMTRACE_RELEASE_CACHE"  # gemtrace/run/cache_release.py's names
ENV_LAYOUT = "GEMTRACE_CACHE_RELEASE_LAYOUT"
ENV_STATE_DIR = "GEMTRACE_STATE_DIR"  # gemtrace/contract.py's; `gemtrace run` always sets it
POLL_S = 0.01  # how late an empty_cache may come after the hold: a slice is 20 ms or more
WAIT_S = 0.1  # looks for CUDA's start, the gate's slot, the region


def say(why):
    sys.stderr.write(f"gemtrace: the PyTorch cache release is off in this process: {why}\n")
    sys.stderr.flush()


def parse(text):
    facts = dict(pair.split("=", 1) for pair in text.split(","))
    return {k: (v if k.endswith("_file") else int(v)) for k, v in facts.items()}


def cuda_started(cuda):
    try:
        return bool(cuda.is_initialized())
    except Exception:  # torch still importing
        return False


class Maps:
    """The region, mapped read-only; `stale` when the agent replaced the file."""

    def __init__(self, state_dir, lay):
        self.path = os.path.join(state_dir, lay["region_file"])
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.inode = os.fstat(fd).st_ino
            self.region = mmap.mmap(fd, lay["region_size"], mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    def stale(self):
        try:
            return os.stat(self.path).st_ino != self.inode
        except OSError:
            return True

    def close(self):
        self.region.close()


class Watcher:
    def __init__(self, cuda, lay, state_dir):
        self.cuda, self.lay, self.state_dir = cuda, lay, state_dir
        self.pid = os.getpid()
        self.maps = None
        self.slot = None
        self.was_held = False
        self.next_check = 0.0

    def word(self, buf, fmt, offset):
        return struct.unpack_from(fmt, buf, offset)[0]

    def find_slot(self):
        lay, region = self.lay, self.maps.region
        for index in range(lay["max_slots"]):
            if self.word(region, "<i", lay["assigned"] + index * lay["assignment"] + lay["assigned_pid"]) == self.pid:
                return index
        return None

    def held(self):
        """Whether this process's group is held on any of the region's GPUs (None: not placed yet)."""
        lay, region = self.lay, self.maps.region
        entry = lay["assigned"] + (self.slot or 0) * lay["assignment"]
        if self.slot is None or self.word(region, "<i", entry + lay["assigned_pid"]) != self.pid:
            self.slot = self.find_slot()
            if self.slot is None:
                return None
            entry = lay["assigned"] + self.slot * lay["assignment"]
        group = self.word(region, "<I", entry + lay["assigned_group"])
        if group >= lay["max_groups"]:
            return False
        n_gpus = min(self.word(region, "<I", lay["n_gpus"]), lay["max_gpus"])
        return any(self.word(region, "<I", lay["control"] + gpu * lay["control_gpu"] + group * lay["control_group"])
                   == lay["held"] for gpu in range(n_gpus))

    def step(self, now):
        """One look; returns the seconds until the next."""
        if self.maps is not None and now >= self.next_check:
            self.next_check = now + 1.0
            if self.maps.stale():
                self.maps.close()
                self.maps, self.slot = None, None
        if self.maps is None:
            try:
                self.maps = Maps(self.state_dir, self.lay)
            except (OSError, ValueError):
                return 1.0  # no agent (yet): `gemtrace run` said so already
        held = self.held()
        if held is None:
            return WAIT_S
        if held and not self.was_held:
            self.cuda.empty_cache()
        self.was_held = held
        return POLL_S

    def run(self):
        while True:
            time.sleep(self.step(time.monotonic()))


def watch(torch):
    try:
        lay = parse(os.environ[ENV_LAYOUT])
        watcher = Watcher(torch.cuda, lay, os.environ.get(ENV_STATE_DIR) or "/run/gemtrace")
        watcher.run()
    except Exception as e:
        say(f"{type(e).__name__}: {e}")


def start():
    """Called while `import torch` begins: the thread waits for torch to finish importing and CUDA to start."""
    def body():
        while True:
            torch = sys.modules.get("torch")
            cuda = getattr(torch, "cuda", None)
            if cuda is not None and hasattr(cuda, "empty_cache") and cuda_started(cuda):
                return watch(torch)
            time.sleep(WAIT_S)

    threading.Thread(target=body, name="gemtrace-cache-release", daemon=True).start()
