"""The same-host channel's connections (``shm://NAME``): attach, frames in slots, doorbells.

``connect`` attaches (HELLO, WELCOME with the memfd, or REFUSED); ``Connection`` is a blocking
connection any thread may call (its slots, answers and reader role guarded by its condition; one
thread reads the socket at a time and hands the others their answers); ``AsyncConnection`` belongs
to its event loop (``add_reader``). Failures are ``ShmRpcError``s, read as gRPC's ``grpc.RpcError``.
The wire format is ``expertd.client.shm_frames``.
"""
from __future__ import annotations

import asyncio
import itertools
import mmap
import os
import select
import socket
import threading
import time

import grpc
from google.rpc import status_pb2

from expertd.client import shm_frames as wire

CONNECT_TIMEOUT_S = 5.0
CLOSED = "the server closed the connection (it stopped or restarted)"


class ShmRpcError(grpc.RpcError):
    """A failed call over the channel, read as gRPC's ``grpc.RpcError`` is read."""

    def __init__(self, code: grpc.StatusCode, message: str, details: bytes = b""):
        super().__init__(f"{code.name}: {message}")
        self._code, self._message = code, message
        self._trailing = (("grpc-status-details-bin", details),) if details else ()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self):
        return self._trailing


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def error_of(code: int, payload: bytes) -> ShmRpcError:
    status = status_pb2.Status.FromString(payload)
    return ShmRpcError(_CODES.get(code, grpc.StatusCode.UNKNOWN), status.message, payload)


def _unavailable(path: str, why: str) -> ShmRpcError:
    return ShmRpcError(grpc.StatusCode.UNAVAILABLE, f"shm channel {path}: {why}")


def connect(path: str, token: bytes, timeout: float = CONNECT_TIMEOUT_S) -> tuple[socket.socket, mmap.mmap, int, int]:
    """(socket, mapped segment, slots, slot bytes) of a new connection to the channel at ``path``;
    ShmRpcError UNAVAILABLE where no server listens there, the server's code where it refused."""
    if len(token) > wire.MAX_TOKEN_BYTES:
        raise ShmRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"authorization: expected <= {wire.MAX_TOKEN_BYTES} "
                                                            f"bytes, got {len(token)}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            sock.sendall(wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0, len(token)) + token)
            message, fds, _, _ = socket.recv_fds(sock, wire.MAX_REFUSAL_BYTES, 1)
        except OSError as exc:  # absent, refused, timed out: nothing serves there now
            raise _unavailable(path, f"cannot connect ({exc.strerror or exc})") from None
        if len(message) >= wire.REFUSED.size and not fds:
            magic, _, _, code = wire.REFUSED.unpack_from(message)
            if magic == wire.MAGIC:
                text = message[wire.REFUSED.size:].decode("utf-8", "replace")
                raise ShmRpcError(_CODES.get(code, grpc.StatusCode.UNKNOWN), text)
        if len(message) != wire.WELCOME.size or len(fds) != 1:
            for fd in fds:
                socket.close(fd)
            raise _unavailable(path, "the server's answer to HELLO is not a channel's (expected WELCOME and a memfd)")
        magic, version, _, slots, slot_bytes = wire.WELCOME.unpack(message)
        try:
            if magic != wire.MAGIC or version != wire.VERSION:
                raise _unavailable(path, f"the server speaks channel version {version}, this client {wire.VERSION}")
            segment = mmap.mmap(fds[0], slots * slot_bytes)
        finally:
            socket.close(fds[0])
        sock.setblocking(False)  # waits are poll()s with the call's deadline
        return sock, segment, slots, slot_bytes
    except BaseException:
        sock.close()
        raise


class _Slots:
    """The frames of one connection's segment: write a request, read an answer, each bounded by its slot."""

    def __init__(self, path: str, segment: mmap.mmap, slots: int, slot_bytes: int):
        self.path, self.segment, self.count, self.slot_bytes = path, segment, slots, slot_bytes
        self.capacity = slot_bytes - wire.FRAME.size

    def check_size(self, payload: bytes) -> None:
        if len(payload) > self.capacity:
            raise ShmRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"request: {len(payload)} bytes, expected <= "
                              f"{self.capacity} (the shm channel's slot); send it over gRPC")

    def write(self, slot: int, method: int, call_id: int, timeout: float | None, payload: bytes) -> None:
        offset = slot * self.slot_bytes
        timeout_us = 0 if timeout is None else max(1, int(timeout * 1e6))
        wire.FRAME.pack_into(self.segment, offset, wire.MAGIC, wire.VERSION, method, call_id, timeout_us,
                             len(payload), 0)
        start = offset + wire.FRAME.size
        self.segment[start:start + len(payload)] = payload

    def spun(self, slot: int, seconds: float) -> bool:
        """Spin up to ``seconds`` on ``slot``'s answer (``shm_frames.answered``), yielding the CPU
        between looks; whether it came."""
        offset, end = slot * self.slot_bytes, time.perf_counter() + seconds
        while time.perf_counter() < end:
            if wire.answered(self.segment, offset):
                return True
            os.sched_yield()
        return wire.answered(self.segment, offset)

    def read(self, slot: int, call_id: int) -> tuple[int, bytes]:
        """(gRPC code, payload) of the answer in ``slot``."""
        offset = slot * self.slot_bytes
        magic, version, _, answered_id, _, length, code = wire.FRAME.unpack_from(self.segment, offset)
        if magic != wire.MAGIC or version != wire.VERSION or answered_id != call_id or length > self.capacity:
            raise _unavailable(self.path, f"the answer in slot {slot} is not a frame of call {call_id}")
        start = offset + wire.FRAME.size
        return code, self.segment[start:start + length]


class Connection:
    """One blocking connection (module docstring: any thread calls; one reads at a time)."""

    def __init__(self, path: str, token: bytes, spin_s: float = 0.0):
        self.sock, segment, slots, slot_bytes = connect(path, token)
        self._spin_s = spin_s if wire.SPIN_SAFE else 0.0
        self._caught: set[int] = set()  # calls answered while their caller spun: their doorbells are dropped
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)
        self.slots = _Slots(path, segment, slots, slot_bytes)
        self.path = path
        self._ready = threading.Condition()
        self._free = list(range(slots))
        self._answers: dict[int, int] = {}  # call id -> slot, answered and not yet read
        self._abandoned: dict[int, int] = {}  # call id -> slot of a call whose caller gave up waiting
        self._reading = False
        self._ids = itertools.count(1)
        self.broken: str | None = None

    def call(self, method: int, payload: bytes, deadline: float | None) -> tuple[int, bytes]:
        self.slots.check_size(payload)
        with self._ready:
            while not self._free:  # slots come back with answers, late ones too: read them if nobody is
                self._await_doorbells(deadline)
            slot, call_id = self._free.pop(), next(self._ids)
        try:
            self.slots.write(slot, method, call_id, None if deadline is None else deadline - time.monotonic(), payload)
            self.sock.send(wire.DOORBELL.pack(wire.CALL, slot, call_id))  # never full: one doorbell per slot
        except OSError as exc:
            self._break(f"lost ({exc})")
            raise _unavailable(self.path, self.broken) from None
        abandoned = caught = False
        try:
            if self._spin_s and not self._reading and self.slots.spun(slot, self._spin_s):
                caught = True
                return self.slots.read(slot, call_id)
            with self._ready:
                while call_id not in self._answers:
                    self._await_doorbells(deadline)
                del self._answers[call_id]
            return self.slots.read(slot, call_id)
        except ShmRpcError as error:
            abandoned = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not self.broken
            raise
        finally:
            with self._ready:
                if abandoned and call_id not in self._answers:
                    self._abandoned[call_id] = slot  # its answer frees the slot
                else:
                    if caught and call_id not in self._answers:
                        self._caught.add(call_id)
                        self._drain()  # its doorbell, and any before it: the socket never fills up
                    self._answers.pop(call_id, None)
                    self._free.append(slot)
                    self._ready.notify_all()

    def _await_doorbells(self, deadline: float | None) -> None:
        """Read doorbells, or wait while another thread does (the condition held); UNAVAILABLE once broken."""
        if self.broken:
            raise _unavailable(self.path, self.broken)
        if self._reading:
            self._wait(deadline)
        else:
            self._read_doorbells(deadline)

    def _wait(self, deadline: float | None) -> None:
        """Wait (the condition held) for a change; DEADLINE_EXCEEDED once ``deadline`` passed."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise ShmRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if self.broken:
            raise _unavailable(self.path, self.broken)
        self._ready.wait(remaining)

    def _read_doorbells(self, deadline: float | None) -> None:
        """Take the reader role (the condition held), read one doorbell and what else is waiting."""
        self._reading = True
        self._ready.release()
        bells, failure = [], None
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._poll.poll(None if remaining is None else remaining * 1000):
                while True:
                    try:
                        message = self.sock.recv(wire.DOORBELL.size)
                    except BlockingIOError:
                        break
                    if not message:
                        failure = CLOSED
                        break
                    bells.append(message)
        except ConnectionResetError:
            failure = CLOSED
        except OSError as exc:
            failure = f"lost ({exc})"
        finally:
            self._ready.acquire()
            self._reading = False
        for bell in bells:
            self._answered(bell)
        if failure:
            self.broken = failure
        self._ready.notify_all()
        if not bells and not failure:
            self._wait(deadline)  # the timeout passed: raises

    def _drain(self) -> None:
        """Read the doorbells waiting now, without waiting (the condition held; not while a reader reads)."""
        while not self._reading and not self.broken:
            try:
                bell = self.sock.recv(wire.DOORBELL.size)
            except BlockingIOError:
                return
            except OSError as exc:
                self.broken = CLOSED if isinstance(exc, ConnectionResetError) else f"lost ({exc})"
                return
            if not bell:
                self.broken = CLOSED
                return
            self._answered(bell)

    def _answered(self, bell: bytes) -> None:
        kind, slot, call_id = wire.DOORBELL.unpack(bell) if len(bell) == wire.DOORBELL.size else (0, 0, 0)
        if kind != wire.ANSWER:
            self.broken = "the server sent a doorbell that is not an answer"
        elif call_id in self._abandoned:
            self._free.append(self._abandoned.pop(call_id))
        elif call_id in self._caught:
            self._caught.discard(call_id)
        else:
            self._answers[call_id] = slot

    def _break(self, why: str) -> None:
        with self._ready:
            self.broken = self.broken or why
            self._ready.notify_all()

    def close(self) -> None:
        self._break("closed by the client")
        self.sock.close()


def _expire(answer: asyncio.Future) -> None:
    if not answer.done():
        answer.set_exception(ShmRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))


class AsyncConnection:
    """One asyncio connection: the loop reads its doorbells (``add_reader``) and owns its state."""

    def __init__(self, path: str, parts, loop: asyncio.AbstractEventLoop, spin_s: float = 0.0):
        self.sock, segment, slots, slot_bytes = parts
        self._spin_s, self._hot_until, self._hot = spin_s, 0.0, False  # ``_stay_hot``
        self.sock.setblocking(False)
        self.slots = _Slots(path, segment, slots, slot_bytes)
        self.path, self._loop = path, loop
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(slots):
            self._free.put_nowait(slot)
        self._waiting: dict[int, tuple[int, asyncio.Future]] = {}  # call id -> (slot, its answer)
        self._ids = itertools.count(1)
        self.broken: str | None = None
        loop.add_reader(self.sock, self._on_readable)

    @classmethod
    async def open(cls, path: str, token: bytes, spin_s: float = 0.0) -> AsyncConnection:
        return cls(path, await asyncio.to_thread(connect, path, token), asyncio.get_running_loop(), spin_s)

    async def call(self, method: int, payload: bytes, deadline: float | None) -> tuple[int, bytes]:
        self.slots.check_size(payload)
        if self._free.empty():  # every slot has a call in flight: wait for one (the rare path)
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                slot = await asyncio.wait_for(self._free.get(), remaining)
            except TimeoutError:
                raise ShmRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        else:
            slot = self._free.get_nowait()
        if self.broken:
            self._free.put_nowait(slot)
            raise _unavailable(self.path, self.broken)
        call_id, answer = next(self._ids), self._loop.create_future()
        self._waiting[call_id] = (slot, answer)
        try:
            self.slots.write(slot, method, call_id, None if deadline is None else deadline - time.monotonic(), payload)
            self.sock.send(wire.DOORBELL.pack(wire.CALL, slot, call_id))
        except OSError as exc:
            del self._waiting[call_id]
            self._free.put_nowait(slot)
            self._fail(f"lost ({exc})")
            raise _unavailable(self.path, self.broken) from None
        # the deadline is a timer, not a wait_for task; a call that gave up (deadline, cancelled) keeps
        # its slot until the answer comes (``_on_readable`` frees it)
        expiry = None if deadline is None else self._loop.call_later(deadline - time.monotonic(), _expire, answer)
        if self._spin_s:
            self._hot_until = time.perf_counter() + self._spin_s
            if not self._hot:
                self._hot = True
                self._loop.call_soon(self._stay_hot)
        try:
            await answer
        finally:
            if expiry is not None:
                expiry.cancel()
        try:
            return self.slots.read(slot, call_id)
        finally:
            self._free.put_nowait(slot)

    def _stay_hot(self) -> None:
        """Keep the loop polling, not sleeping, while a call waits and ``_hot_until`` has not passed:
        a ready callback makes its select look without waiting; other coroutines run meanwhile."""
        if self._waiting and time.perf_counter() < self._hot_until and not self.broken:
            self._loop.call_soon(self._stay_hot)
        else:
            self._hot = False

    def _on_readable(self) -> None:
        while True:
            try:
                bell = self.sock.recv(wire.DOORBELL.size)
            except BlockingIOError:
                return
            except ConnectionResetError:
                return self._fail(CLOSED)
            except OSError as exc:
                return self._fail(f"lost ({exc})")
            if not bell:
                return self._fail(CLOSED)
            kind, slot, call_id = wire.DOORBELL.unpack(bell) if len(bell) == wire.DOORBELL.size else (0, 0, 0)
            waiting = self._waiting.pop(call_id, None)
            if kind != wire.ANSWER or waiting is None or waiting[0] != slot:
                return self._fail("the server sent a doorbell that answers no call in flight")
            if waiting[1].done():  # its caller gave up: the slot is free again
                self._free.put_nowait(slot)
            else:
                waiting[1].set_result(None)

    def _fail(self, why: str) -> None:
        if self.broken:
            return
        self.broken = why
        self._loop.remove_reader(self.sock)
        for _, answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(_unavailable(self.path, why))
        self._waiting.clear()

    def close(self) -> None:
        self._fail("closed by the client")
        self.sock.close()
