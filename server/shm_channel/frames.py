"""The channel's messages read and written (``expertd.client.shm_frames`` is the format): a HELLO
checked, a request frame read out of its slot (every field checked before the payload is copied,
nothing outside the slot read), an answer's payload."""
from __future__ import annotations

import asyncio
import mmap

import grpc
from google.protobuf.message import DecodeError

from expertd.client import shm_frames as wire
from expertd.server import errors
from expertd.server.transport.interceptors import undecodable_message


def header(segment: mmap.mmap, offset: int) -> tuple[int, int]:
    """(method id, timeout in microseconds) of the frame at ``offset``, unchecked."""
    _, _, method, _, timeout_us, _, _ = wire.FRAME.unpack_from(segment, offset)
    return method, timeout_us


def request(segment: mmap.mmap, offset: int, slot_bytes: int, call_id: int, message_class: type | None):
    """The request message of the frame at ``offset`` (the slot's start), copied out of the slot and
    parsed as ``message_class`` (None: a method the channel does not carry); InvalidRequest naming
    the frame's field that is wrong."""
    magic, version, method, framed_id, _, length, _ = wire.FRAME.unpack_from(segment, offset)
    if magic != wire.MAGIC or version != wire.VERSION or framed_id != call_id:
        raise errors.InvalidRequest("frame", f"expected magic {wire.MAGIC:#x}, version {wire.VERSION} and the "
                                             f"doorbell's call id {call_id}, got {magic:#x}, {version}, {framed_id}")
    if message_class is None:
        raise errors.InvalidRequest("frame.method", f"expected 1..{len(wire.METHODS)} (shm_frames.METHODS), "
                                                    f"got {method}")
    capacity = slot_bytes - wire.FRAME.size
    if length > capacity:
        raise errors.InvalidRequest("frame.payload_length", f"expected <= {capacity} bytes (the slot), got {length}")
    start = offset + wire.FRAME.size
    try:
        return message_class.FromString(segment[start:start + length])
    except DecodeError:
        raise errors.InvalidRequest("frame.payload", undecodable_message(message_class.DESCRIPTOR.full_name)) from None


def answer(response, exc: BaseException | None, slot_bytes: int) -> tuple[grpc.StatusCode, bytes, str]:
    """(code, payload, message to log) of the answer to a call: ``response`` serialized, or the status
    of ``exc`` (``errors.status_of``; a cancellation is the call's deadline) as a google.rpc.Status;
    RESOURCE_EXHAUSTED where it does not fit the slot."""
    if exc is None:
        code, body, shown = grpc.StatusCode.OK, response.SerializeToString(), ""
    else:
        status = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", []) \
            if isinstance(exc, asyncio.CancelledError) else errors.status_of(exc)
        code, body, shown = status[0], errors.rich_status(status).SerializeToString(), status[1]
    if len(body) > slot_bytes - wire.FRAME.size:
        status = (grpc.StatusCode.RESOURCE_EXHAUSTED, f"the answer is {len(body)} bytes, more than the shm channel's "
                  f"slot holds ({slot_bytes - wire.FRAME.size}); call over gRPC", [])
        code, body, shown = status[0], errors.rich_status(status).SerializeToString(), status[1]
    return code, body, shown


def hello_error(message: bytes) -> tuple[grpc.StatusCode, str] | None:
    """None for a well-formed HELLO, else the refusal's (code, message)."""
    if len(message) < wire.HELLO.size or len(message) > wire.MAX_HELLO_BYTES:
        return grpc.StatusCode.INVALID_ARGUMENT, (f"HELLO: expected the channel's {wire.HELLO.size}-byte header and a "
                                                  f"token of <= {wire.MAX_TOKEN_BYTES} bytes")
    magic, version, _, token_length = wire.HELLO.unpack_from(message)
    if magic != wire.MAGIC or version != wire.VERSION or token_length != len(message) - wire.HELLO.size:
        return grpc.StatusCode.FAILED_PRECONDITION, (f"HELLO: expected magic {wire.MAGIC:#x} version {wire.VERSION} "
                                                     f"and the token's length, got {magic:#x} version {version}")
    return None
