"""The agent's state dir: checked to be the agent's own before anything is written there.

The region, the attach socket, the lock and the MPS pipes live in the state dir, and the agent (root)
writes there by name. A directory another user can write lets that user plant a symbolic link where
the agent will create a file (an `agent.lock` pointing at /etc/shadow is truncated by root), or swap
a directory on the path for one of theirs. So the agent refuses a state dir, or any directory on the
way to it, that a user other than root or itself owns or can write (a sticky parent such as /tmp is
fine: nobody can rename what is not theirs there), and refuses to start over entries it did not make
(symbolic links, other users' files) left in it. The path is resolved once; everything after works on
the resolved one, so a symbolic link on the way cannot be retargeted under the agent. The lock, the
one file this module creates, is opened under the checked directory's descriptor with O_NOFOLLOW.

A full, read-only or over-quota filesystem is a sentence (`storage_error`), never a traceback.
It must never follow a link or trust an entry it has not checked; it decides nothing else.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

DIR_MODE = 0o755  # every user's gates reach the socket and read the region here; only the agent writes

# The errors that mean the filesystem refuses a write, whatever the write.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)


class StateDirError(Exception):
    """The state dir cannot be the agent's: one line saying what is wrong and what to do."""


def storage_error(path: Path, e: OSError) -> StateDirError | None:
    """One line for a write the state dir's filesystem refused (full, read-only, over quota), or None
    for another error."""
    if e.errno == errno.ENOSPC:
        return StateDirError(f"{path}: no space left on the state dir's filesystem; free space there (or point "
                             "--state-dir elsewhere) and start the agent again")
    if e.errno == errno.EROFS:
        return StateDirError(f"{path}: the state dir is on a read-only filesystem; the agent needs a writable "
                             "--state-dir (the unit's RuntimeDirectory, /run/gemtrace)")
    if e.errno == errno.EDQUOT:
        return StateDirError(f"{path}: disk quota exceeded on the state dir's filesystem; raise the quota or point "
                             "--state-dir elsewhere")
    return None


def trusted_owner(uid: int, agent_uid: int) -> bool:
    return uid in (0, agent_uid)


def unsafe_directory(st: os.stat_result, agent_uid: int, is_state_dir: bool) -> str | None:
    """Why a directory with this stat lets another user change what the agent finds in it, or None
    (pure). A sticky parent is safe: others may add names there but not rename or remove ours; in the
    state dir itself a name they add could be one the agent creates next, so no one else writes there."""
    mode = stat.S_IMODE(st.st_mode)
    if not trusted_owner(st.st_uid, agent_uid):
        return f"owned by uid {st.st_uid}"
    if mode & 0o022 and (is_state_dir or not mode & stat.S_ISVTX):
        return f"writable by other users (mode {mode:04o})"
    return None


def unsafe_entry(st: os.stat_result, agent_uid: int) -> str | None:
    """Why an entry of the state dir was not made by the agent, or None (pure)."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not trusted_owner(st.st_uid, agent_uid):
        return f"owned by uid {st.st_uid}"
    return None


def _refuse_directory(path: Path, why: str, is_state_dir: bool) -> StateDirError:
    what = "the state dir" if is_state_dir else "a directory above the state dir"
    return StateDirError(f"{path} ({what}) is {why}: another user could plant files where the agent writes as "
                         f"root; make it root's and not writable by others (chown root {path}; chmod go-w "
                         f"{path}), or point --state-dir elsewhere")


def open_state_dir(state_dir: Path, agent_uid: int | None = None) -> tuple[Path, int]:
    """Resolve `state_dir`, make what is missing of it (mode DIR_MODE), check every directory from `/`
    down and every entry in it; returns the resolved path and a descriptor of the directory (the
    caller closes it). Raises StateDirError."""
    uid = os.geteuid() if agent_uid is None else agent_uid
    path = Path(os.path.realpath(state_dir))
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    walked = Path("/")
    try:
        parts = path.parts[1:]
        for depth, name in enumerate((None, *parts)):
            if name is not None:
                walked = walked / name
                flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    child = os.open(name, flags, dir_fd=fd)
                except FileNotFoundError:
                    try:
                        os.mkdir(name, DIR_MODE, dir_fd=fd)
                    except FileExistsError:
                        pass  # made by someone else meanwhile: checked below like any other
                    child = os.open(name, flags, dir_fd=fd)
                os.close(fd)
                fd = child
            is_state_dir = depth == len(parts)
            why = unsafe_directory(os.fstat(fd), uid, is_state_dir)
            if why is not None:
                raise _refuse_directory(walked, why, is_state_dir)
        for entry in os.scandir(fd):
            why = unsafe_entry(entry.stat(follow_symlinks=False), uid)
            if why is not None:
                raise StateDirError(f"{path / entry.name} is {why}, in the state dir only the agent writes: "
                                    "remove it and start the agent again")
    except OSError as e:
        os.close(fd)
        raise _walk_error(walked, e) from None
    except BaseException:
        os.close(fd)
        raise
    return path, fd


def _walk_error(path: Path, e: OSError) -> StateDirError:
    found = storage_error(path, e)
    if found is not None:
        return found
    if e.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced by a link or a file since it was resolved
        return StateDirError(f"{path} changed while the agent checked it (now not a directory); look at who "
                             "changes it, then start the agent again")
    return StateDirError(f"{path}: {e.strerror or e}")


def open_lock_file(dir_fd: int, state_dir: Path, name: str) -> int:
    """Open (creating it if missing) the regular file `name` of the checked directory for reading and
    writing, never through a link, and refuse one another user owns or that is linked elsewhere too."""
    path = state_dir / name
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                     dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StateDirError(f"{path} is a symbolic link, in the state dir only the agent writes: remove it and "
                                "start the agent again") from None
        raise storage_error(path, e) or StateDirError(f"{path}: {e.strerror or e}") from None
    st = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(st.st_mode)
           else "a hard link to another file" if st.st_nlink != 1
           else unsafe_entry(st, os.geteuid()))
    if why is not None:
        os.close(fd)
        raise StateDirError(f"{path} is {why}, in the state dir only the agent writes: remove it and start the "
                            "agent again")
    return fd
