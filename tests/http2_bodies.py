"""A raw HTTP/2 caller for what no gRPC client sends: a message whose 5-byte gRPC prefix declares
more bytes than follow, its body sent as fast as the server's flow-control windows allow.

``send_declared`` tells how many bytes the server let the caller send before it answered, which is
what a server that reads a body before checking the call (or never stops reading it) would hold.
"""
from __future__ import annotations

import dataclasses
import socket
import struct
import time

import h2.config
import h2.connection
import h2.events
import h2.exceptions

CHUNK = 1 << 20  # zeros, sent a window's worth at a time
GOAWAY = 0x7  # the HTTP/2 frame type


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a declared body ended: ``sent`` bytes (prefix included) the server's windows let through,
    then a gRPC status (``code``: grpc-status as an int, ``message``), a stream reset (``reset``: the
    HTTP/2 error code), ``closed`` connection, or none of them before the time ran out."""
    sent: int
    code: int | None = None
    message: str = ""
    reset: int | None = None
    closed: bool = False

    @property
    def answered(self) -> bool:
        return self.code is not None or self.reset is not None or self.closed


def send_declared(port: int, method: str, declared: int, *, metadata: tuple[tuple[str, str], ...] = (),
                  send_at_most: int | None = None, timeout_s: float = 30.0) -> Outcome:
    """Open a stream to ``method`` on 127.0.0.1:``port`` (plaintext), send a gRPC prefix declaring
    ``declared`` bytes, then zeros while the server grants window (up to ``send_at_most``, default
    ``declared``), until it answers or ``timeout_s`` passes."""
    limit = declared if send_at_most is None else min(send_at_most, declared)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        connection.initiate_connection()
        sock.sendall(connection.data_to_send())
        stream = connection.get_next_available_stream_id()
        connection.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", method),
                                         (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                                         ("te", "trailers"), *metadata])
        pending = b"\x00" + struct.pack(">I", declared)  # uncompressed, the declared length
        sent, body_sent = 0, 0
        received = bytearray()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            window = min(connection.local_flow_control_window(stream), connection.max_outbound_frame_size)
            if window > 0 and body_sent < limit:
                if not pending:
                    pending = bytes(min(CHUNK, limit - body_sent))
                piece, pending = pending[:window], pending[window:]
                try:
                    connection.send_data(stream, piece)
                except h2.exceptions.StreamClosedError:
                    pass
                else:
                    sent += len(piece)
                    body_sent = max(sent - 5, 0)
                sock.setblocking(True)
                sock.sendall(connection.data_to_send())
                sock.setblocking(False)  # look for an answer between frames without waiting
            else:
                sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                data = sock.recv(1 << 16)
            except (TimeoutError, BlockingIOError):
                continue
            if not data:
                return Outcome(sent, closed=True)
            received += data
            for event in _events(connection, received):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    headers = dict(event.headers)
                    if "grpc-status" in headers:
                        return Outcome(sent, code=int(headers["grpc-status"]), message=headers.get("grpc-message", ""))
                elif isinstance(event, h2.events.StreamReset):
                    return Outcome(sent, reset=int(event.error_code))
            out = connection.data_to_send()
            if out:
                sock.setblocking(True)
                sock.sendall(out)
        return Outcome(sent)
    finally:
        sock.close()



def _events(connection: h2.connection.H2Connection, received: bytearray) -> list:
    """The events of the whole frames in ``received`` (which keeps what is left of a partial one).
    GOAWAY frames are not fed to h2: a server that is closing sends one, then still answers the
    streams it has begun, which h2 would refuse to read once it has seen the GOAWAY."""
    events = []
    while len(received) >= 9:
        size = 9 + int.from_bytes(received[:3], "big")
        if len(received) < size:
            break
        frame = bytes(received[:size])
        del received[:size]
        if frame[3] != GOAWAY:
            events.extend(connection.receive_data(frame))
    return events
