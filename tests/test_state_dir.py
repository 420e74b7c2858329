"""Issue 25: the state dir is the agent's own. A real unprivileged user (test_trust's `gemtrace-adv`)
owns, writes or plants links in the state dir or a directory above it; the real `gemtrace agent`, as
root, refuses to start in one line and never writes through the planted link. The pure checks are
tested on stat results first."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_host import Host, gemtrace, stop
from test_trust import Adversary, adversary  # noqa: F401  (the fixture, shared with that module)

from gemtrace.agent import state_dir as sd
from gemtrace.agent.agent import LOCK_FILE

PRECIOUS = "root's own file, which the agent must never write\n"


def fake_stat(mode: int, uid: int = 0, nlink: int = 1) -> os.stat_result:
    return os.stat_result((mode, 0, 0, nlink, uid, 0, 0, 0, 0, 0))


@pytest.mark.unit
@pytest.mark.parametrize(("mode", "uid", "is_state_dir", "why"), [
    (0o40755, 0, True, None),
    (0o40700, 1000, True, "owned by uid 1000"),
    (0o40755, 1000, False, "owned by uid 1000"),
    (0o40755, 4242, True, None),  # the agent's own uid (a demo without root)
    (0o40777, 0, True, "writable by other users (mode 0777)"),
    (0o41777, 0, True, "writable by other users (mode 1777)"),  # others could add the names the agent makes
    (0o40775, 0, True, "writable by other users (mode 0775)"),
    (0o41777, 0, False, None),  # /tmp above the state dir: nobody renames what is not theirs there
    (0o40777, 0, False, "writable by other users (mode 0777)"),
    (0o40770, 0, False, "writable by other users (mode 0770)"),
])
def test_a_directory_is_safe_when_only_root_or_the_agent_can_change_it(mode: int, uid: int, is_state_dir: bool,
                                                                       why: str | None) -> None:
    assert sd.unsafe_directory(fake_stat(mode, uid), 4242, is_state_dir) == why


@pytest.mark.unit
def test_an_entry_is_the_agents_when_it_is_no_link_and_root_or_the_agent_owns_it() -> None:
    assert sd.unsafe_entry(fake_stat(0o100644, 0), 4242) is None
    assert sd.unsafe_entry(fake_stat(0o140666, 4242), 4242) is None  # the attach socket
    assert sd.unsafe_entry(fake_stat(0o120777, 0), 4242) == "a symbolic link"
    assert sd.unsafe_entry(fake_stat(0o100644, 1000), 4242) == "owned by uid 1000"


@pytest.mark.unit
def test_the_lock_is_never_opened_through_a_link_nor_a_second_name(tmp_path: Path) -> None:
    """open_lock_file on its own, past the directory's scan (a link made between the scan and the open)."""
    victim = tmp_path / "victim"
    victim.write_text(PRECIOUS)
    state = tmp_path / "state"
    state.mkdir()
    (state / LOCK_FILE).symlink_to(victim)
    fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(sd.StateDirError, match=f"^{state / LOCK_FILE} is a symbolic link, in the state dir"):
            sd.open_lock_file(fd, state, LOCK_FILE)
        (state / LOCK_FILE).unlink()
        os.link(victim, state / LOCK_FILE)
        with pytest.raises(sd.StateDirError, match="is a hard link to another file"):
            sd.open_lock_file(fd, state, LOCK_FILE)
        (state / LOCK_FILE).unlink()
        os.mkfifo(state / LOCK_FILE)
        with pytest.raises(sd.StateDirError, match="is not a regular file"):
            sd.open_lock_file(fd, state, LOCK_FILE)  # O_NONBLOCK: a planted FIFO does not hang the agent
    finally:
        os.close(fd)
    assert victim.read_text() == PRECIOUS


@pytest.mark.unit
def test_the_path_is_resolved_and_what_is_missing_made_mode_0755(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    old = os.umask(0)
    try:
        path, fd = sd.open_state_dir(tmp_path / "link" / "a" / "b")
    finally:
        os.umask(old)
    os.close(fd)
    assert path == (tmp_path / "real" / "a" / "b").resolve()
    assert [stat.S_IMODE((tmp_path / "real" / d).stat().st_mode) for d in ("a", "a/b")] == [0o755, 0o755]


@pytest.fixture
def base(adversary: Adversary) -> Iterator[Path]:  # noqa: F811
    """A directory like /tmp (the user makes its own there; above a state dir it is fine), with a
    root-owned file to protect."""
    path = Path(tempfile.mkdtemp(prefix="gemtrace-statedir-"))
    path.chmod(0o1777)
    (path / "victim").write_text(PRECIOUS)
    (path / "victim").chmod(0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_adversary(adversary: Adversary, *argv: str) -> None:  # noqa: F811
    subprocess.run(adversary.command(*argv), check=True, timeout=30)


def start_agent(host: Host, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(gemtrace("agent", "--config", str(host.config), "--state-dir", str(state), "--listen",
                                   "127.0.0.1:0", "--no-ebpf"), env=host.env(), capture_output=True, text=True,
                          timeout=60)


def refusal(path: Path, what: str, why: str) -> str:
    return (f"gemtrace: {path} ({what}) is {why}: another user could plant files where the agent writes as root; "
            f"make it root's and not writable by others (chown root {path}; chmod go-w {path}), or point "
            "--state-dir elsewhere\n")


@pytest.mark.e2e
def test_a_state_dir_another_user_owns_is_refused_and_its_planted_lock_link_not_followed(
        host: Host, adversary: Adversary, base: Path) -> None:  # noqa: F811
    state = base / "theirs"
    as_adversary(adversary, "mkdir", "-m", "0755", str(state))
    as_adversary(adversary, "ln", "-s", str(base / "victim"), str(state / LOCK_FILE))
    out = start_agent(host, state)
    assert (out.returncode, out.stderr) == (1, refusal(state, "the state dir", f"owned by uid {adversary.uid}"))
    assert (base / "victim").read_text() == PRECIOUS


@pytest.mark.e2e
@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_state_dir_others_can_write_is_refused(host: Host, adversary: Adversary, base: Path,  # noqa: F811
                                                 mode: int) -> None:
    state = base / "open"
    state.mkdir()
    state.chmod(mode)
    if mode & 0o002:
        as_adversary(adversary, "ln", "-s", str(base / "victim"), str(state / LOCK_FILE))
    out = start_agent(host, state)
    assert (out.returncode, out.stderr) == (1, refusal(state, "the state dir",
                                                       f"writable by other users (mode {mode:04o})"))
    assert (base / "victim").read_text() == PRECIOUS


@pytest.mark.e2e
def test_a_link_left_from_when_the_state_dir_was_open_is_refused(host: Host, adversary: Adversary,  # noqa: F811
                                                                 base: Path) -> None:
    state = base / "state"
    state.mkdir()
    state.chmod(0o777)
    as_adversary(adversary, "ln", "-s", str(base / "victim"), str(state / LOCK_FILE))
    state.chmod(0o755)  # the operator closed the directory, and left what was planted in it
    out = start_agent(host, state)
    assert (out.returncode, out.stderr) == (1, f"gemtrace: {state / LOCK_FILE} is a symbolic link, in the state dir "
                                               "only the agent writes: remove it and start the agent again\n")
    assert (base / "victim").read_text() == PRECIOUS
    (state / LOCK_FILE).unlink()
    host.state_dir = state
    assert stop(host.start_agent()) == 0  # the one line's advice is enough


@pytest.mark.e2e
def test_a_directory_above_the_state_dir_another_user_owns_is_refused(host: Host, adversary: Adversary,  # noqa: F811
                                                                      base: Path) -> None:
    above = base / "theirs"
    as_adversary(adversary, "mkdir", "-m", "0755", str(above))
    state = above / "state"
    subprocess.run(["mkdir", "-m", "0755", str(state)], check=True)  # root's, under the user's directory
    out = start_agent(host, state)
    assert (out.returncode, out.stderr) == (1, refusal(above, "a directory above the state dir",
                                                       f"owned by uid {adversary.uid}"))
    assert not (state / LOCK_FILE).exists()
