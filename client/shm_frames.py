"""The same-host channel's wire format (``shm://NAME``), shared by its client and its server.

A connection is a Unix ``SOCK_SEQPACKET`` socket to the channel's path (``socket_path``) plus one
shared-memory segment the server creates for it (a sealed memfd: it cannot be shrunk or grown, so no
read of it can fault, and it has no name another process could open) and passes over the socket.

1. Hello. The client sends ``HELLO`` (magic, version, its bearer token's length, the token). The
   server checks the peer's credentials (``SO_PEERCRED``: its own uid, or the channel's group) and
   the token where one is set, then answers ``WELCOME`` (magic, version, slots, slot bytes) with the
   segment's descriptor, or ``REFUSED`` (magic, version, gRPC code, message) and closes.
2. Calls. The segment holds ``slots`` slots of ``slot_bytes`` each. A slot holds one frame:
   ``FRAME`` (magic, version, method, call id, timeout in microseconds (0: none), payload length,
   gRPC code) then the payload. A request's payload is the gRPC request message serialized as gRPC
   sends it; an answer's is the response message (code 0) or a ``google.rpc.Status`` (any other
   code: message and rich details, what gRPC carries in ``grpc-status-details-bin``). The client
   writes a frame into a slot it owns and sends ``DOORBELL`` (kind CALL, slot, call id); the server
   answers in the same slot and sends ``DOORBELL`` (kind ANSWER, slot, call id). A slot is the
   client's again once its answer doorbell came: every call is answered, after its deadline too.
   Several calls may be in flight, one per slot.

Frames are self-contained (method, id, deadline, length, code, payload), so a network transport
(RDMA, UCX, NIXL) can carry the same frames with its own doorbells (docs/attention.md).
All integers little-endian.
"""
from __future__ import annotations

import os
import platform
import struct

MAGIC = 0x44505845  # b"EXPD"
VERSION = 1

HELLO = struct.Struct("<IHHI")  # magic, version, reserved, token length; the token follows
WELCOME = struct.Struct("<IHHII")  # magic, version, reserved, slots, slot bytes (+ the memfd)
REFUSED = struct.Struct("<IHHI")  # magic, version, reserved, gRPC code; the UTF-8 message follows
FRAME = struct.Struct("<IHHQQII")  # magic, version, method, call id, timeout us, payload length, gRPC code
DOORBELL = struct.Struct("<IIQ")  # kind, slot, call id
CALL, ANSWER = 1, 2
ANSWERED = 0x8000
"""Set in an answer's method field, written after the rest of its frame: a waiting client may spin
on it (``answered``) rather than sleep on the doorbell, which still follows. x86-64 sees stores
in order; elsewhere a client waits for the doorbell (``SPIN_SAFE``)."""
METHOD_FIELD = struct.Struct("<H")
METHOD_OFFSET = 6
SPIN_SAFE = platform.machine() in ("x86_64", "AMD64")

MAX_TOKEN_BYTES = 4096
MAX_HELLO_BYTES = HELLO.size + MAX_TOKEN_BYTES
MAX_REFUSAL_BYTES = 4096

# Method ids, in the frame: the unary methods the channel carries. Streams stay on gRPC.
METHODS = (
    "/expertd.v1.ExpertService/Forward",
    "/expertd.v1.ExpertService/Route",
    "/expertd.v1.ExpertService/GetModelInfo",
    "/expertd.v1.ExpertService/GetExpertLoad",
    "/grpc.health.v1.Health/Check",
    "/expertd.v1.ExpertService/RegisterSharedMemory",
    "/expertd.v1.ExpertService/UnregisterSharedMemory",
    "/expertd.v1.ExpertService/GetSharedMemoryStatus",
)
METHOD_IDS = {path: index + 1 for index, path in enumerate(METHODS)}

SCHEME = "shm://"
DEFAULT_DIRECTORY = "/dev/shm"


def socket_path(name: str) -> str:
    """The channel's socket path for ``name`` (what follows ``shm://``): a name without ``/`` is
    ``/dev/shm/expertd-<name>.sock``; a path is taken as it is."""
    if not name:
        raise ValueError("shm channel name: expected a name or a path, got ''")
    if "/" in name:
        return name
    if name in (".", "..") or "\0" in name:
        raise ValueError(f"shm channel name: expected a plain name or a path, got {name!r}")
    return os.path.join(DEFAULT_DIRECTORY, f"expertd-{name}.sock")


def name_of(target: str) -> str | None:
    """The channel name of an ``shm://NAME`` target, or None for any other target."""
    return target[len(SCHEME):] if target.startswith(SCHEME) else None


def mark_answered(segment, offset: int, method: int) -> None:
    """Set ``ANSWERED`` in the method field of the frame at ``offset`` (its last write)."""
    METHOD_FIELD.pack_into(segment, offset + METHOD_OFFSET, method | ANSWERED)


def answered(segment, offset: int) -> bool:
    """Whether the frame at ``offset`` is an answer (``ANSWERED`` set)."""
    return bool(segment[offset + METHOD_OFFSET + 1] & (ANSWERED >> 8))
