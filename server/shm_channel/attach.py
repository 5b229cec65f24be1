"""Attaching to the same-host channel: the socket's path, the peer's groups, the client's segment."""
from __future__ import annotations

import fcntl
import mmap
import os
import socket
import stat


class Client:
    """One attached client: its socket, its mapped segment and the slots with a call in flight."""

    def __init__(self, sock: socket.socket, segment: mmap.mmap, slots: int, slot_bytes: int, pid: int):
        self.sock, self.segment, self.slots, self.slot_bytes, self.pid = sock, segment, slots, slot_bytes, pid
        self.busy: set[int] = set()
        self.gone = False


def send_segment(sock: socket.socket, welcome: bytes, size: int) -> mmap.mmap:
    """Create a sealed memfd of ``size`` bytes (it can be neither shrunk nor grown: no access to it
    faults; it has no name to open), send it with ``welcome`` over ``sock`` and return its mapping."""
    fd = os.memfd_create("expertd-shm-channel", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        segment = mmap.mmap(fd, size)
        try:
            socket.send_fds(sock, [welcome], [fd])
        except OSError:
            segment.close()
            raise
        return segment
    finally:
        os.close(fd)


def listen(path: str, group_id: int | None) -> socket.socket:
    """A non-blocking SEQPACKET socket listening at ``path`` (a stale socket there replaced), 0600,
    or 0660 owned by ``group_id``."""
    remove_stale(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        previous = os.umask(0o177 if group_id is None else 0o117)
        try:
            listener.bind(path)
        finally:
            os.umask(previous)
        if group_id is not None:
            os.chown(path, -1, group_id)
        listener.listen(64)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


def in_group(pid: int, gid: int, group_id: int) -> bool:
    """Whether the peer (process ``pid``, primary group ``gid``) is in group ``group_id``."""
    return gid == group_id or group_id in _groups_of(pid)


def remove_stale(path: str) -> None:
    """Remove a socket at ``path`` nobody listens on (a stopped server's); OSError where one does, or
    where something else is there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(f"{path}: another server listens there")


def _groups_of(pid: int) -> set[int]:
    """The supplementary groups of process ``pid`` (from /proc; empty where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()
