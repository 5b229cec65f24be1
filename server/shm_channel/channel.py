"""The same-host channel's server (``--shm-channel NAME``): a Unix socket for doorbells, one sealed
memfd per client for frames, every call handed to the server's one request path.

Wire format: ``expertd.client.shm_frames``. What is checked, in order:

- Attach. The socket file is 0600 (0660 with ``--shm-channel-group``, group-owned); the peer's
  ``SO_PEERCRED`` must be this process's uid, or (with a group) have the group as its primary or a
  supplementary group; with a bearer token set, HELLO must carry it (``transport.auth``); at most
  ``clients`` attached. A refusal is a REFUSED message (PERMISSION_DENIED, UNAUTHENTICATED,
  RESOURCE_EXHAUSTED) and the socket closes. HELLO must come within HELLO_TIMEOUT_S.
- Calls. A doorbell names a slot of the client's segment: a slot outside it, one with a call in
  flight, or a doorbell that is not one closes the connection (a client bug, logged once per
  interval). A frame's magic, version, method and length are checked before its payload is copied
  out of the slot; nothing outside the slot is read or written. The payload is the gRPC request
  message, handed to the method's handler (``frontends.ExpertServicer.unary_methods``, health):
  the main port's decode, admission, batching, answer, errors (``errors.status_of``) and logs.
- Deadline: the frame's timeout, from the doorbell, as gRPC's; the handler is cancelled at it.
  A lone Forward at an idle server is computed as its doorbell is read (``direct``).
- A client gone (its socket closed) frees its connection at once; its calls in flight finish, their
  answers dropped. ``stop`` closes every connection: waiting clients get UNAVAILABLE at once.

Threads: everything here belongs to the server's event loop (``add_reader`` on the sockets).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import grp
import logging
import mmap
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable

import grpc

from expertd.client import shm_frames as wire
from expertd.server import errors
from expertd.server.metrics.shm_channel import ShmChannelStats
from expertd.server.shm_channel import attach, direct, frames
from expertd.server.transport.auth import UNAUTHENTICATED_MESSAGE, authorized

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 2.0
QUIESCE_POLL_S = 0.005
PEERCRED = struct.Struct("3i")  # pid, uid, gid
FORWARD = wire.METHOD_IDS["/expertd.v1.ExpertService/Forward"]
Handler = tuple[type, Callable[..., Awaitable]]
"""(request message class, ``async handler(message, deadline) -> response message``)."""


class ShmChannel:
    """A listening channel (module docstring); create with ``ShmChannel.start``. Loop-owned."""

    def __init__(self, path: str, listener: socket.socket, handlers: dict[int, Handler], *,
                 loop: asyncio.AbstractEventLoop, slots: int, slot_bytes: int, clients: int, group_id: int | None,
                 token: bytes | None, stats: ShmChannelStats, direct=None, spin_s: float = 0.0):
        self.path, self._listener, self._handlers, self._loop = path, listener, handlers, loop
        self._direct = direct
        self._spin_s, self._hot_until, self._hot = spin_s, 0.0, False  # ``_stay_hot``
        self._slots, self._slot_bytes, self._max_clients, self._group_id = slots, slot_bytes, clients, group_id
        self._token, self.stats = token, stats
        self._clients: set[attach.Client] = set()
        self._calls: set[asyncio.Task] = set()
        self._stopped = False
        loop.add_reader(listener, self._accept)

    @classmethod
    def start(cls, name: str, handlers: dict[str, Handler], *, slots: int, max_message_bytes: int, clients: int,
              group: str | None = None, token: str | None = None, direct_servicer=None,
              spin_us: float = 0.0) -> ShmChannel:
        """Listen at ``name``'s socket path (``shm_frames.socket_path``), replacing a stale socket
        there; ValueError naming the flag where a live server holds it, it cannot be bound or the
        group does not exist. ``handlers``: method path -> Handler (paths the wire does not carry are
        ignored). Each slot holds a frame of ``max_message_bytes`` (the gRPC port's limit).
        ``direct_servicer``: the ExpertServicer whose lone Forwards at an idle server are computed as
        their doorbell is read (``direct.forward_now``; only where its engine runs in this process).
        ``spin_us``: after each answer the loop polls, not sleeps, this long (``_stay_hot``)."""
        path = wire.socket_path(name)
        try:
            group_id = grp.getgrnam(group).gr_gid if group is not None else None
            listener = attach.listen(path, group_id)
        except KeyError:
            raise ValueError(f"--shm-channel-group {group!r}: no such group") from None
        except OSError as exc:
            raise ValueError(f"--shm-channel {name!r}: {exc.strerror or exc} ({path})") from exc
        return cls(path, listener, {wire.METHOD_IDS[p]: h for p, h in handlers.items() if p in wire.METHOD_IDS},
                   loop=asyncio.get_running_loop(), slots=slots, clients=clients, group_id=group_id,
                   slot_bytes=-(-(max_message_bytes + wire.FRAME.size) // mmap.PAGESIZE) * mmap.PAGESIZE,
                   token=None if token is None else token.encode(), stats=ShmChannelStats(wire.METHODS),
                   direct=None if direct_servicer is None else functools.partial(direct.forward_now, direct_servicer),
                   spin_s=spin_us / 1e6)

    # -- attach ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the next accept may work
                errors.client_errors.note("shm channel", f"accept failed: {exc}")
                return
            sock.setblocking(False)
            timer = self._loop.call_later(HELLO_TIMEOUT_S, self._hello_timed_out, sock)
            self._loop.add_reader(sock, self._hello, sock, timer)

    def _hello_timed_out(self, sock: socket.socket) -> None:
        self._refuse(sock, "hello_timeout", grpc.StatusCode.DEADLINE_EXCEEDED,
                     f"no HELLO within {HELLO_TIMEOUT_S:g} s of connecting")

    def _hello(self, sock: socket.socket, timer: asyncio.TimerHandle) -> None:
        timer.cancel()
        self._loop.remove_reader(sock)
        try:
            message = sock.recv(wire.MAX_HELLO_BYTES + 1)
            pid, uid, gid = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
        except OSError:
            sock.close()
            return
        if (malformed := frames.hello_error(message)) is not None:
            return self._refuse(sock, "malformed", *malformed)
        if not self._permitted(pid, uid, gid):
            return self._refuse(sock, "permission", grpc.StatusCode.PERMISSION_DENIED,
                                f"uid {uid} may not attach: the channel serves uid {os.geteuid()}"
                                + (f" and group {self._group_id}" if self._group_id is not None else ""))
        if self._token is not None and not authorized([("authorization", message[wire.HELLO.size:])], self._token):
            return self._refuse(sock, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        if len(self._clients) >= self._max_clients or self._stopped:
            return self._refuse(sock, "full", grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(self._clients)} clients attached, the most --shm-channel-clients allows")
        try:
            client = self._attach(sock, pid)
        except OSError as exc:
            return self._refuse(sock, "memory", grpc.StatusCode.RESOURCE_EXHAUSTED, f"no segment for a client: {exc}")
        self._clients.add(client)
        self.stats.clients = len(self._clients)
        self._loop.add_reader(sock, self._doorbells, client)

    def _permitted(self, pid: int, uid: int, gid: int) -> bool:
        return uid == os.geteuid() or self._group_id is not None and attach.in_group(pid, gid, self._group_id)

    def _attach(self, sock: socket.socket, pid: int) -> attach.Client:
        """A sealed memfd of the client's slots, mapped here and passed to it in WELCOME."""
        welcome = wire.WELCOME.pack(wire.MAGIC, wire.VERSION, 0, self._slots, self._slot_bytes)
        return attach.Client(sock, attach.send_segment(sock, welcome, self._slots * self._slot_bytes), self._slots,
                       self._slot_bytes, pid)

    def _refuse(self, sock: socket.socket, reason: str, code: grpc.StatusCode, message: str) -> None:
        self.stats.refuse(reason)
        errors.client_errors.note("shm channel", f"attach refused ({reason}): {message}")
        with contextlib.suppress(OSError):
            sock.send(wire.REFUSED.pack(wire.MAGIC, wire.VERSION, 0, code.value[0]) + errors.bounded(message).encode())
        with contextlib.suppress(KeyError, ValueError):
            self._loop.remove_reader(sock)
        sock.close()

    # -- calls -----------------------------------------------------------------------------------
    def _doorbells(self, client: attach.Client) -> None:
        while not client.gone:
            try:
                bell = client.sock.recv(wire.DOORBELL.size + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return self._detach(client)
            if not bell:
                return self._detach(client)
            kind, slot, call_id = wire.DOORBELL.unpack(bell) if len(bell) == wire.DOORBELL.size else (0, -1, 0)
            if kind != wire.CALL or not 0 <= slot < client.slots or slot in client.busy:
                errors.client_errors.note("shm channel", f"client pid {client.pid} sent a doorbell for "
                                          f"{'a busy' if slot in client.busy else 'no'} slot (kind {kind}, slot "
                                          f"{slot}, {len(bell)} bytes): disconnected")
                return self._detach(client)
            client.busy.add(slot)
            self._call(client, slot, call_id, time.perf_counter())

    def _call(self, client: attach.Client, slot: int, call_id: int, started: float) -> None:
        """Read the frame in ``slot`` and serve it: answered now where it fails its frame checks or a
        lone Forward is computed at once (``direct``), else by a task on the loop."""
        method, timeout_us = frames.header(client.segment, slot * client.slot_bytes)
        path = wire.METHODS[method - 1] if method in self._handlers else None
        metrics = self.stats.methods.get(path) if path else None
        if metrics is not None:
            metrics.started.inc()
            metrics.received.inc()
        try:
            message_class, serve = self._handlers.get(method, (None, None))
            message = frames.request(client.segment, slot * client.slot_bytes, client.slot_bytes, call_id,
                                     message_class)
            deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
            answer = functools.partial(self._finish, client, slot, call_id, method, metrics, started)
            if method == FORWARD and self._direct and self._direct(message, deadline, lambda r: answer(response=r)):
                return
        except Exception as exc:  # noqa: BLE001 - every failure is an answer, as on gRPC
            if slot not in client.busy:  # answered (its slot is free again): recording its step failed
                return log.exception("shm channel: recording a direct step failed")
            return self._finish(client, slot, call_id, method, metrics, started, exc=exc)
        call = self._loop.create_task(self._serve(client, slot, call_id, method, metrics, started, serve, message,
                                                  timeout_us))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    async def _serve(self, client: attach.Client, slot: int, call_id: int, method: int, metrics, started: float, serve,
                     message, timeout_us: int) -> None:
        expiry = None
        try:
            deadline = time.monotonic() + timeout_us / 1e6 if timeout_us else None
            if deadline is not None:  # cancelled at its deadline, as gRPC cancels a handler (no wait_for task)
                expiry = self._loop.call_at(self._loop.time() + timeout_us / 1e6, asyncio.current_task().cancel)
            response = await serve(message, deadline)
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - every failure is an answer
            if isinstance(exc, asyncio.CancelledError) and (self._stopped or expiry is None):
                raise  # the channel stops: nobody waits for this answer
            return self._finish(client, slot, call_id, method, metrics, started, exc=exc)
        finally:
            if expiry is not None:
                expiry.cancel()
        self._finish(client, slot, call_id, method, metrics, started, response=response)

    def _finish(self, client: attach.Client, slot: int, call_id: int, method: int, metrics, started: float, *,
                response=None, exc: BaseException | None = None) -> None:
        """Answer a call with ``response``, or with the status of ``exc`` (a cancellation: its deadline)."""
        code, body, shown = frames.answer(response, exc, client.slot_bytes)
        if code.name in errors.CLIENT_CODES:
            errors.client_errors.note(code.name, f"{wire.METHODS[method - 1] if metrics else 'shm channel'}: {shown}")
        if metrics is not None:
            if code == grpc.StatusCode.OK:
                metrics.sent.inc()
            metrics.handled(code.name, time.perf_counter() - started)
        self._answer(client, slot, call_id, method, code.value[0], body)

    def _answer(self, client: attach.Client, slot: int, call_id: int, method: int, code: int, body: bytes) -> None:
        client.busy.discard(slot)
        if client.gone:
            if not client.busy:
                client.segment.close()
            return
        offset = slot * client.slot_bytes
        start = offset + wire.FRAME.size
        client.segment[start:start + len(body)] = body
        wire.FRAME.pack_into(client.segment, offset, wire.MAGIC, wire.VERSION, method, call_id, 0, len(body), code)
        wire.mark_answered(client.segment, offset, method)  # last: what a spinning client waits for
        try:
            client.sock.send(wire.DOORBELL.pack(wire.ANSWER, slot, call_id))
        except OSError:  # gone, or a client that stopped reading its doorbells (it has slots-many at most)
            self._detach(client)
        if self._spin_s:
            self._hot_until = time.perf_counter() + self._spin_s
            if not self._hot:
                self._hot = True
                self._loop.call_soon(self._stay_hot)

    def _stay_hot(self) -> None:
        """Keep the loop polling (a ready callback: its select does not sleep) until ``_hot_until``."""
        if time.perf_counter() < self._hot_until and not self._stopped and not self._calls:  # none on a step
            self._loop.call_soon(self._stay_hot)
        else:
            self._hot = False

    def _detach(self, client: attach.Client) -> None:
        if client.gone:
            return
        client.gone = True
        with contextlib.suppress(KeyError, ValueError):
            self._loop.remove_reader(client.sock)
        client.sock.close()
        self._clients.discard(client)
        self.stats.clients = len(self._clients)
        if not client.busy:  # else the last answer closes it
            client.segment.close()

    # -- lifecycle -------------------------------------------------------------------------------
    async def quiesce(self, timeout: float) -> bool:
        """Wait until no call is in flight (False if ``timeout`` passed first)."""
        deadline = time.monotonic() + timeout
        while self._calls and time.monotonic() < deadline:
            await asyncio.sleep(QUIESCE_POLL_S)
        return not self._calls

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop attaching, finish the calls in flight for up to ``grace_s``, then close every client
        (their waiting calls get UNAVAILABLE) and remove the socket. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._loop.remove_reader(self._listener)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        await self.quiesce(grace_s)
        for call in list(self._calls):
            call.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
        for client in list(self._clients):
            self._detach(client)
