"""The batch channel between the multi-host leader (process 0) and its followers.

Why a side channel and not a JAX collective (`multihost_utils.broadcast_one_to_all`): a
collective has no timeout. If a follower dies or hangs, a broadcast blocks process 0 forever,
with the gRPC front end still answering "ready". Over TCP the leader learns of a dead follower at
once (the kernel closes its socket: EOF) and of a hung one within `peer_timeout_s` (its
heartbeats stop), so it can go NOT_SERVING and exit, and Kubernetes restarts the group. It also
keeps host-side batch data off the device collectives.

Protocol: one TCP connection per follower, to the leader's `--multihost-port`. Every message is a
frame: `!II` (header length, payload length), a UTF-8 JSON header, then the payload: the raw
little-endian bytes of the arrays listed in `header["arrays"]` (name, dtype, shape), back to
back. No pickle: a frame can only carry JSON values and numeric arrays.

- follower -> leader, once: `{"type": "hello", "process_id": i}`; then heartbeats.
- leader -> follower, once every follower said hello (after the leader's warm-up):
  `{"type": "welcome"}`; peer timeouts count from here on.
- leader -> follower: `{"type": "step", "seq": n, "op": ..., "args": {...}}` + arrays, in
  the order the leader runs the steps; `{"type": "shutdown"}` at a clean exit; heartbeats.
- heartbeats, both ways: `{"type": "heartbeat"}` every `peer_timeout_s / 4`. A side that
  receives nothing (no step, no heartbeat) for `peer_timeout_s`, or reads EOF, calls `on_lost`.
"""
from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

import ml_dtypes  # noqa: F401  (registers "bfloat16" with numpy)
import numpy as np

log = logging.getLogger(__name__)

_FRAME = struct.Struct("!II")
MAX_HEADER_BYTES = 1 << 20
DTYPES = frozenset({"float32", "bfloat16", "float16", "int32"})


class PeerLost(ConnectionError):
    """The other side of the channel died, closed the connection or stopped answering."""


# ---------------------------------------------------------------------- framing

def send_frame(sock: socket.socket, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
    """Send one frame: `header` (JSON values) plus `arrays` (name -> numeric array)."""
    arrays = {name: np.ascontiguousarray(value) for name, value in (arrays or {}).items()}
    for name, value in arrays.items():
        if value.dtype.name not in DTYPES:
            raise ValueError(f"array {name!r}: dtype must be one of {sorted(DTYPES)}, got {value.dtype}")
    header = {**header, "arrays": [{"name": n, "dtype": a.dtype.name, "shape": list(a.shape)} for n,
                                   a in arrays.items()]}
    header_bytes = json.dumps(header).encode()
    payload_bytes = sum(a.nbytes for a in arrays.values())
    sock.sendall(_FRAME.pack(len(header_bytes), payload_bytes) + header_bytes)
    for value in arrays.values():
        little = value.astype(value.dtype.newbyteorder("<"), copy=False)
        sock.sendall(memoryview(little.reshape(-1).view(np.uint8)))


def recv_frame(sock: socket.socket) -> tuple[dict, dict[str, np.ndarray]]:
    """Receive one frame; PeerLost on EOF, socket.timeout if nothing arrives in the socket timeout.

    Array bytes are received straight into the arrays' memory (no intermediate copies).
    """
    header_len, payload_len = _FRAME.unpack(_recv_into(sock, bytearray(_FRAME.size)))
    if header_len > MAX_HEADER_BYTES:
        raise PeerLost(f"frame header of {header_len} bytes exceeds {MAX_HEADER_BYTES}: not an expertd peer")
    header = json.loads(_recv_into(sock, bytearray(header_len)))
    specs = header.pop("arrays")
    for spec in specs:
        if spec["dtype"] not in DTYPES:
            raise PeerLost(f"array {spec['name']!r} has unsupported dtype {spec['dtype']!r}")
    arrays = {spec["name"]: np.empty(spec["shape"], np.dtype(spec["dtype"]).newbyteorder("<")) for spec in specs}
    needed = sum(a.nbytes for a in arrays.values())
    if needed != payload_len:
        raise PeerLost(f"frame payload is {payload_len} bytes, its arrays need {needed}")
    for value in arrays.values():
        _recv_into(sock, value.reshape(-1).view(np.uint8))
    return header, {name: value.astype(value.dtype.newbyteorder("="), copy=False) for name, value in arrays.items()}


def _recv_into(sock: socket.socket, buffer):
    """Fill `buffer` (bytearray or uint8 array) from the socket; returns it."""
    view, size, received = memoryview(buffer), len(buffer), 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise PeerLost("connection closed by the peer")
        received += count
    return buffer


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket; "" / "::" / "[::]" mean every interface, IPv4 and IPv6 where possible."""
    host = host.strip("[]")
    if host in ("", "::", "0.0.0.0") and socket.has_dualstack_ipv6():
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("0.0.0.0" if host == "" else host, port))


# ---------------------------------------------------------------------- one connection

class _Link:
    """A connected socket with a send lock, a heartbeat sender and a receiver thread.

    Every received frame other than a heartbeat goes to `on_frame`; silence for `timeout_s`, EOF or
    a send error calls `on_lost(reason)` once.
    """

    def __init__(self, sock: socket.socket, name: str, timeout_s: float,
                 on_frame: Callable[[dict, dict], None], on_lost: Callable[[str], None]):
        self.sock, self.name, self.timeout_s = sock, name, timeout_s
        self._on_frame, self._on_lost = on_frame, on_lost
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self._lost_once = threading.Lock()
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._threads = [threading.Thread(target=self._receive, name=f"{name}-recv", daemon=True),
                         threading.Thread(target=self._heartbeat, name=f"{name}-heartbeat", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def send(self, header: dict, arrays: dict | None = None) -> None:
        try:
            with self._send_lock:
                send_frame(self.sock, header, arrays)
        except OSError as exc:  # includes socket.timeout: the peer stopped reading
            self._lost(f"sending to {self.name} failed: {exc}")
            raise PeerLost(f"{self.name}: {exc}") from exc

    def finish(self) -> None:
        """The peer said goodbye: its closing the connection is no longer a loss. This side sends
        nothing more either (the peer's `close(drain_s)` waits for that end of stream)."""
        self._closed.set()
        self._end_sending()

    def close(self, drain_s: float = 0.0, farewell: dict | None = None) -> None:
        """Close the connection, after sending `farewell` if given (the peer's answer, closing its
        end, is then no loss). With `drain_s`, first end this side's sending and read (and drop) what
        the peer still sends for up to `drain_s` until it ends its own: closing a socket with input
        left unread resets the connection, and a reset makes the peer discard what it has received
        but not read yet (a loaded follower lost its last steps and the shutdown so)."""
        self._closed.set()
        if farewell is not None:
            try:
                self.send(farewell)
            except PeerLost:
                pass
        receiver = self._threads[0]
        if drain_s > 0 and receiver.is_alive():
            self._end_sending()
            receiver.join(drain_s)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _end_sending(self) -> None:
        with self._send_lock:  # not in the middle of a heartbeat's frame
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _receive(self) -> None:
        # Reads until the peer's end of stream (or silence, or an error), also after close() began,
        # which then ignores the loss.
        while True:
            try:
                header, arrays = recv_frame(self.sock)
            except TimeoutError:
                return self._lost(f"{self.name} sent nothing for {self.timeout_s:.1f} s")
            except (OSError, ValueError) as exc:  # PeerLost is an OSError; ValueError: bad JSON
                return self._lost(f"{self.name}: {exc}")
            if header.get("type") != "heartbeat":
                self._on_frame(header, arrays)

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.timeout_s / 4):
            try:
                self.send({"type": "heartbeat"})
            except PeerLost:
                return

    def _lost(self, reason: str) -> None:
        if self._closed.is_set() or not self._lost_once.acquire(blocking=False):
            return
        self._on_lost(reason)


# ---------------------------------------------------------------------- the two ends

CLOSE_DRAIN_S = 5.0  # how long the leader's close waits for each follower to read the last frames


class LeaderChannel:
    """Process 0's end: accepts `num_followers` followers, then broadcasts step frames in order."""

    def __init__(self, host: str, port: int, num_followers: int, *, peer_timeout_s: float,
                 on_lost: Callable[[str], None]):
        self.num_followers, self.peer_timeout_s, self._on_lost = num_followers, peer_timeout_s, on_lost
        self._listener = _listen(host, port)
        self.port = self._listener.getsockname()[1]
        self._links: dict[int, _Link] = {}
        self._seq = 0

    def accept(self, timeout_s: float) -> None:
        """Wait until every follower connected and said hello; TimeoutError naming the missing ones."""
        deadline = time.monotonic() + timeout_s
        while len(self._links) < self.num_followers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, self.num_followers + 1)) - set(self._links))
                raise TimeoutError(f"multi-host: followers {missing} did not connect to port {self.port} "
                                   f"within {timeout_s:.0f} s")
            self._listener.settimeout(remaining)
            try:
                sock, address = self._listener.accept()
            except TimeoutError:
                continue
            sock.settimeout(self.peer_timeout_s)
            try:
                hello, _ = recv_frame(sock)
                process_id = int(hello["process_id"]) if hello.get("type") == "hello" else -1
            except (OSError, ValueError, KeyError) as exc:
                log.warning("multi-host: dropped a connection from %s that did not say hello: %s", address, exc)
                sock.close()
                continue
            if not 1 <= process_id <= self.num_followers or process_id in self._links:
                log.warning("multi-host: dropped %s claiming process id %s", address, process_id)
                sock.close()
                continue
            self._links[process_id] = _Link(sock, f"process {process_id}", self.peer_timeout_s,
                                            self._unexpected, self._on_lost)
            log.info("multi-host: process %d connected from %s", process_id, address[0])
        for link in self._links.values():  # the group is whole: peer timeouts start now
            link.send({"type": "welcome"})
            link.start()

    def broadcast(self, op: str, args: dict, arrays: dict[str, np.ndarray]) -> None:
        """Send step `op` to every follower before the leader runs it; PeerLost if one is gone."""
        self._seq += 1
        for link in self._links.values():
            link.send({"type": "step", "seq": self._seq, "op": op, "args": args}, arrays)

    def close(self) -> None:
        """Tell the followers to exit cleanly, then close once each has read everything (or after
        CLOSE_DRAIN_S)."""
        for link in self._links.values():
            link.close(drain_s=min(self.peer_timeout_s, CLOSE_DRAIN_S), farewell={"type": "shutdown"})
        self._listener.close()

    def _unexpected(self, header: dict, arrays: dict) -> None:
        log.warning("multi-host: ignored an unexpected %r frame from a follower", header.get("type"))


class FollowerChannel:
    """A follower's end: connects to the leader, then yields the leader's steps in order."""

    def __init__(self, leader_host: str, port: int, process_id: int, *, peer_timeout_s: float,
                 on_lost: Callable[[str], None]):
        self.address, self.process_id, self.peer_timeout_s = (leader_host, port), process_id, peer_timeout_s
        self._on_lost = on_lost
        self._frames: queue.Queue = queue.Queue()
        self._link: _Link | None = None

    def connect(self, timeout_s: float) -> None:
        """Dial the leader (retrying while it starts) and say hello; TimeoutError when it never answers."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection(self.address, timeout=self.peer_timeout_s)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"multi-host: leader {self.address[0]}:{self.address[1]} did not accept "
                                       f"within {timeout_s:.0f} s: {exc}") from exc
                time.sleep(0.2)
        send_frame(sock, {"type": "hello", "process_id": self.process_id})
        # The leader accepts when its own warm-up is done: wait for its welcome, then heartbeats.
        sock.settimeout(max(deadline - time.monotonic(), self.peer_timeout_s))
        try:
            welcome, _ = recv_frame(sock)
        except TimeoutError:
            sock.close()
            raise TimeoutError(f"multi-host: leader {self.address[0]}:{self.address[1]} did not accept this "
                               f"process within {timeout_s:.0f} s") from None
        if welcome.get("type") != "welcome":
            sock.close()
            raise PeerLost(f"multi-host: expected the leader's welcome, got {welcome}")
        self._link = _Link(sock, "the leader", self.peer_timeout_s, self._received, self._lost)
        self._link.start()

    def steps(self):
        """Yield `(op, args, arrays)` for every step, in order, until the leader says shutdown."""
        expected = 1
        while True:
            header, arrays = self._frames.get()
            if header.get("type") == "shutdown":
                return
            if header.get("type") == "lost":
                raise PeerLost(header["reason"])
            if header.get("type") != "step" or header.get("seq") != expected:
                raise PeerLost(f"multi-host: expected step {expected}, got {header}")
            expected += 1
            yield header["op"], header["args"], arrays

    def close(self) -> None:
        if self._link is not None:
            self._link.close()

    def _received(self, header: dict, arrays: dict) -> None:
        if header.get("type") == "shutdown":
            self._link.finish()
        self._frames.put((header, arrays))

    def _lost(self, reason: str) -> None:
        self._frames.put(({"type": "lost", "reason": reason}, {}))
        self._on_lost(reason)
