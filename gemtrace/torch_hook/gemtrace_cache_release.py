"""The watcher of gemtrace's PyTorch cache release, loaded by sitecustomize.py once `torch` is
imported: a daemon thread that, once torch has initialised CUDA, reads this process's group's held
word on the GPUs it uses every 10 ms and calls `torch.cuda.empty_cache()` once each time the group
becomes held (on any of them).

Stdlib only (the user's interpreter need not have gemtrace): it maps the agent's region and slots
read-only and reads them at the offsets in GEMTRACE_CACHE_RELEASE_LAYOUT, which `gemtrace run` took
from gemtrace/region.py. Its slot is the one whose pid is this process's (the gate claims it when
CUDA starts) and whose assignment names this pid. Nothing it meets is raised into the program: it
says why it stopped in one line on stderr.
"""

import mmap
import os
import struct
import sys
import threading
import time

ENV_RELEASE_CACHE = "GEMTRACE_RELEASE_CACHE"  # gemtrace/cache_release.py's names
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
    """The region and the slots, mapped read-only; `stale` when the agent replaced the files."""

    def __init__(self, state_dir, lay):
        self.paths = [os.path.join(state_dir, lay["region_file"]), os.path.join(state_dir, lay["slots_file"])]
        self.inodes, self.maps = [], []
        # Not zip(strict=): the user's interpreter may be older than 3.10.
        for path, size in ((self.paths[0], lay["region_size"]), (self.paths[1], lay["slots_size"])):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.inodes.append(os.fstat(fd).st_ino)
                self.maps.append(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ))
            finally:
                os.close(fd)
        self.region, self.slots = self.maps

    def stale(self):
        try:
            return [os.stat(p).st_ino for p in self.paths] != self.inodes
        except OSError:
            return True

    def close(self):
        for m in self.maps:
            m.close()


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
        lay, slots = self.lay, self.maps.slots
        for index in range(lay["max_slots"]):
            if self.word(slots, "<i", lay["slots"] + index * lay["slot"] + lay["slot_pid"]) == self.pid:
                return index
        return None

    def held(self):
        """Whether this process's group is held on any GPU it has used (None: no slot of ours yet)."""
        lay, region, slots = self.lay, self.maps.region, self.maps.slots
        if self.slot is None or self.word(slots, "<i", lay["slots"] + self.slot * lay["slot"]
                                          + lay["slot_pid"]) != self.pid:
            self.slot = self.find_slot()
            if self.slot is None:
                return None
        entry = lay["assigned"] + self.slot * lay["assignment"]
        group = self.word(region, "<I", entry + lay["assigned_group"])
        if self.word(region, "<i", entry + lay["assigned_pid"]) != self.pid or group >= lay["max_groups"]:
            return False
        mask = self.word(slots, "<I", lay["slots"] + self.slot * lay["slot"] + lay["slot_gpu_mask"])
        n_gpus = min(self.word(region, "<I", lay["n_gpus"]), lay["max_gpus"])
        return any(self.word(region, "<I", lay["control"] + gpu * lay["control_gpu"] + group * lay["control_group"])
                   == lay["held"] for gpu in range(n_gpus) if mask & (1 << gpu) or not mask)

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
