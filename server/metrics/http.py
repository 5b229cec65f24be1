"""The Prometheus endpoint: ``GET /metrics`` over HTTP/1.1 on asyncio, optionally behind TLS and the token.

Rules:
- No thread per connection: each connection is one coroutine on the event loop the endpoint is
  started on (the gRPC server's). The exposition is prometheus_client's own (``choose_encoder``
  picks OpenMetrics or the text format from the scraper's ``Accept``; gzip when accepted), rendered
  on one worker thread, so a large registry never stalls the loop.
- Only ``GET /metrics`` (a query string is ignored): other paths 404, other methods 405 (``Allow:
  GET``), a malformed request or one with a body 400, a request head over ``max_request_bytes`` 431.
  Connections are kept alive as HTTP/1.1 says (HTTP/1.0: closed unless asked).
- Bounded, and idle connections never cost a scrape: a new connection's first request head (and
  its TLS handshake) must be complete within ``header_timeout_s``, a kept-alive connection's next
  one within ``read_timeout_s`` of the previous answer, else the connection is closed. At most
  ``max_connections`` connections wait for a request head at once; a connection arriving beyond
  that closes the one that has waited longest, so a scraper that sends its request gets an answer
  whatever number of idle connections others hold open.
- With a token: ``Authorization: Bearer <token>`` (compared in constant time), else 401 with
  ``WWW-Authenticate: Bearer``. With an ``ssl.SSLContext``: HTTPS (mutual TLS if the context
  requires client certificates).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gzip
import hmac
import socket
import ssl
import typing
from http import HTTPStatus

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

if typing.TYPE_CHECKING:
    from expertd.server.config import ServerConfig
    from expertd.server.config.credentials import Credentials

PATH = "/metrics"
MAX_CONNECTIONS = 64
HEADER_TIMEOUT_S = 2.0  # a new connection's first request head
READ_TIMEOUT_S = 30.0   # a kept-alive connection's next one (scrapers keep connections between scrapes)
MAX_REQUEST_BYTES = 8192
CLOSE_LINGER_S = 1.0  # a closing connection reads (and drops) what the client still sends, this long at most


class MetricsEndpoint:
    """``GET /metrics`` of ``registry`` (see module docstring). Start and close it on one event loop.

    Attributes: ``port`` (bound by ``start``), ``scheme`` (``http`` or ``https``).
    """

    def __init__(self, registry: CollectorRegistry, *, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, max_connections: int = MAX_CONNECTIONS,
                 read_timeout_s: float = READ_TIMEOUT_S, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        if token is not None and not token:
            raise ValueError("token must not be empty")
        self._registry = registry
        self._expected = None if token is None else f"Bearer {token}".encode()
        self._ssl = ssl_context
        self._max_connections = max_connections
        self._read_timeout = read_timeout_s
        self._header_timeout = min(header_timeout_s, read_timeout_s)
        self._max_request_bytes = max_request_bytes
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expertd-metrics")
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._waiting: dict[asyncio.Task, asyncio.StreamWriter] = {}  # waiting for a request head, oldest first
        self.port = 0
        self.scheme = "https" if ssl_context is not None else "http"

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0: a free one; ``::``/``[::]``: IPv6 and IPv4); returns the port."""
        sock = _listening_socket(host, port)
        self._server = await asyncio.start_server(
            self._serve, sock=sock, ssl=self._ssl, limit=self._max_request_bytes,
            ssl_handshake_timeout=self._header_timeout if self._ssl is not None else None)
        self.port = sock.getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- one connection -------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            keep_alive, timeout = True, self._header_timeout
            while keep_alive:
                self._wait_for_head(task, writer)
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
                except asyncio.LimitOverrunError:
                    await _send(writer, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, b"request too large\n",
                                keep_alive=False)
                    return
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
                    return  # idle past the timeout, closed for a newer connection, or the peer went away
                finally:
                    self._waiting.pop(task, None)
                status, body, headers, keep_alive = await self._answer(head)
                await _send(writer, status, body, keep_alive=keep_alive, headers=headers)
                timeout = self._read_timeout
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            self._waiting.pop(task, None)
            self._connections.discard(task)
            await _close(reader, writer)

    def _wait_for_head(self, task: asyncio.Task, writer: asyncio.StreamWriter) -> None:
        """Count ``task``'s connection among those waiting for a request head, first closing the one
        that has waited longest when ``max_connections`` already wait."""
        while len(self._waiting) >= self._max_connections:
            oldest = next(iter(self._waiting))
            self._waiting.pop(oldest).close()  # its read ends (EOF): that connection returns
        self._waiting[task] = writer

    async def _answer(self, head: bytes) -> tuple[HTTPStatus, bytes, dict[str, str], bool]:
        """(status, body, extra headers, keep the connection) for one request head."""
        request = _parse(head)
        if request is None:
            return HTTPStatus.BAD_REQUEST, b"malformed request\n", {}, False
        method, target, version, fields = request
        keep_alive = _keep_alive(version, fields.get("connection", ""))
        if fields.get("content-length", "0").strip() != "0" or "transfer-encoding" in fields:
            return HTTPStatus.BAD_REQUEST, b"no request body expected\n", {}, False
        if target.partition("?")[0] != PATH:
            return HTTPStatus.NOT_FOUND, b"not found: only /metrics is served\n", {}, keep_alive
        if method != "GET":
            return HTTPStatus.METHOD_NOT_ALLOWED, b"only GET\n", {"Allow": "GET"}, keep_alive
        if self._expected is not None and not hmac.compare_digest(fields.get("authorization", "").encode(),
                                                                  self._expected):
            return (HTTPStatus.UNAUTHORIZED, b"missing or invalid bearer token\n",
                    {"WWW-Authenticate": 'Bearer realm="expertd metrics"'}, keep_alive)
        encoder, content_type = choose_encoder(fields.get("accept", ""))
        compress = gzip_accepted(fields.get("accept-encoding", ""))
        body = await asyncio.get_running_loop().run_in_executor(self._executor, _render, encoder, self._registry,
                                                                compress)
        headers = {"Content-Type": content_type, **({"Content-Encoding": "gzip"} if compress else {})}
        return HTTPStatus.OK, body, headers, keep_alive


async def _close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Close gracefully: half-close, then read what the client still sends (briefly), so that
    unread request bytes do not turn the close into a reset that loses the answer."""
    with contextlib.suppress(Exception):
        if writer.can_write_eof():
            writer.write_eof()
            async with asyncio.timeout(CLOSE_LINGER_S):  # in this task: nothing left unawaited if cancelled
                await _discard(reader)
    writer.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_LINGER_S):
            await writer.wait_closed()


async def _discard(reader: asyncio.StreamReader) -> None:
    while await reader.read(65536):
        pass


def _render(encoder, registry: CollectorRegistry, compress: bool) -> bytes:
    output = encoder(registry)
    return gzip.compress(output) if compress else output


def _parse(head: bytes) -> tuple[str, str, str, dict[str, str]] | None:
    """(method, target, version, lower-cased header fields) of a request head, or None if malformed."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        return None
    if not version.startswith("HTTP/1.") or not method.isalpha() or not target:
        return None
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return None
        fields[name.lower()] = value.strip()
    return method, target, version, fields


def _keep_alive(version: str, connection: str) -> bool:
    tokens = {token.strip().lower() for token in connection.split(",")}
    return "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens


async def _send(writer: asyncio.StreamWriter, status: HTTPStatus, body: bytes, *, keep_alive: bool,
                headers: dict[str, str] | None = None) -> None:
    headers = {"Content-Type": "text/plain; charset=utf-8", **(headers or {})}
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if not keep_alive:
        lines.append("Connection: close")
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
    await writer.drain()


def _listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; the IPv6 wildcard also takes IPv4 where the system can."""
    host = host.strip("[]")
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    dual = family == socket.AF_INET6 and host == "::" and socket.has_dualstack_ipv6()
    return socket.create_server((host, port), family=family, dualstack_ipv6=dual, backlog=128)


def metrics_endpoint(config: ServerConfig, credentials: Credentials, registry: CollectorRegistry) -> MetricsEndpoint:
    """The metrics endpoint ``config`` asks for: the token with ``--metrics-auth``, TLS with
    ``--metrics-tls`` (start it at ``config.metrics_bind_host``)."""
    return MetricsEndpoint(registry, token=credentials.token if config.metrics_auth else None,
                           ssl_context=credentials.tls.server_context() if config.metrics_tls else None)


def metrics_url(config: ServerConfig, endpoint: MetricsEndpoint) -> str:
    """``http(s)://host:port/metrics`` of a started ``endpoint`` (IPv6 hosts in brackets)."""
    host = config.metrics_bind_host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{endpoint.scheme}://{host}:{endpoint.port}/metrics"
