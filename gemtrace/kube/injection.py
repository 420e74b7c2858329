"""What a container gets so that its processes are gated, with no help from its image or its user.

Three things from the host, mounted at the paths the gate and the agent's packaging use:

    the gate library        GATE_INSTALLED (/usr/lib/gemtrace/libgemgate.so), read-only
    the agent's state dir   STATE_DIR (/run/gemtrace), read-write: the gate maps the region there
    a preload list          /etc/ld.so.preload, read-only, naming the gate

/etc/ld.so.preload rather than LD_PRELOAD: the dynamic loader reads the file for every program it
starts, whatever its environment, so a program that clears its environment (env -i, a sudo, a
supervisor that starts children with a fixed environment) is still gated; LD_PRELOAD would be lost
there (HAMi mounts its library the same way). The price: the container's own /etc/ld.so.preload, if
its image has one, is hidden. Plus GEMTRACE_STATE_DIR and, where known, GEMTRACE_GROUP.

The device plugin's Allocate (mounts and envs) and the webhook (hostPath volumes) both build from
here, so the two paths inject the same thing. Never touches the host: `write_preload_file` is the
plugin's one write, at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gemtrace import defaults

CONTAINER_GATE = defaults.GATE_INSTALLED
CONTAINER_STATE_DIR = defaults.STATE_DIR
CONTAINER_PRELOAD = Path("/etc/ld.so.preload")
# The preload list's home on the host: outside the state dir, which containers may write.
HOST_PRELOAD = Path("/var/lib/gemtrace/kube/ld.so.preload")


@dataclass(frozen=True)
class Mount:
    container_path: Path
    host_path: Path
    read_only: bool
    name: str  # the webhook's volume name


@dataclass(frozen=True)
class Injection:
    """The host's side: where the gate, the state dir and the preload list are on this node."""

    gate: Path = defaults.GATE_INSTALLED
    state_dir: Path = defaults.STATE_DIR
    preload_file: Path = HOST_PRELOAD

    def mounts(self) -> list[Mount]:
        return [
            Mount(CONTAINER_GATE, self.gate, True, "gemtrace-gate"),
            Mount(CONTAINER_STATE_DIR, self.state_dir, False, "gemtrace-state"),
            Mount(CONTAINER_PRELOAD, self.preload_file, True, "gemtrace-preload"),
        ]

    def env(self, group: str | None = None) -> dict[str, str]:
        env = {defaults.ENV_STATE_DIR: str(CONTAINER_STATE_DIR)}
        if group:
            env[defaults.ENV_GROUP] = group
        return env

    def write_preload_file(self) -> None:
        """The preload list the containers mount: one line, the gate's path inside the container."""
        self.preload_file.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.preload_file.with_name(self.preload_file.name + ".tmp")
        temporary.write_text(f"{CONTAINER_GATE}\n")
        temporary.chmod(0o644)
        temporary.replace(self.preload_file)
