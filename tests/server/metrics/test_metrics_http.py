"""The metrics endpoint on its own (expertd.server.metrics.http): HTTP/1.1 rules, bounds, the token,
and no thread per connection (against prometheus_client's threaded server, which the same test
shows growing). TLS on a real server: test_service_security.py."""
from __future__ import annotations

import asyncio
import gzip
import http.client
import os
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from expertd.server.metrics.http import MetricsEndpoint

TOKEN = "metrics-token"


class Running:
    """A MetricsEndpoint on 127.0.0.1 port 0, served by an event loop on its own thread."""

    def __init__(self, **options):
        self.registry = CollectorRegistry()
        Counter("demo_requests", "Requests of the demo.", registry=self.registry).inc(3)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.endpoint = MetricsEndpoint(self.registry, **options)
        self.port = self.run(self.endpoint.start("127.0.0.1", 0))

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def connections(self) -> int:
        return self.run(_value(lambda: self.endpoint.connections))

    def close(self):
        self.run(self.endpoint.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def _value(fn):
    return fn()


@pytest.fixture
def running():
    started = []

    def start(**options) -> Running:
        started.append(Running(**options))
        return started[-1]

    yield start
    for endpoint in started:
        endpoint.close()


def get(port, path="/metrics", method="GET", headers=None, connection=None):
    conn = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers=headers or {})
    response = conn.getresponse()
    body = response.read()
    if connection is None:
        conn.close()
    return response, body


def raw(port, data: bytes, timeout=5.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends back until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def thread_count() -> int:
    """OS threads of this process (all of them, not only Python's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except FileNotFoundError:
        return threading.active_count()


def test_serves_the_registry_in_the_format_the_scraper_asks_for(running):
    endpoint = running()
    response, body = get(endpoint.port)
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    assert b"demo_requests_total 3.0" in body
    response, body = get(endpoint.port, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert response.getheader("Content-Type").startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    response, body = get(endpoint.port, headers={"Accept-Encoding": "gzip"})
    assert response.getheader("Content-Encoding") == "gzip" and b"demo_requests_total" in gzip.decompress(body)
    assert get(endpoint.port, "/metrics?name[]=demo_requests_total")[0].status == 200  # query ignored


def test_only_get_metrics(running):
    endpoint = running()
    for path in ("/", "/metrics/", "/metricsx", "/favicon.ico", "/debug"):
        response, body = get(endpoint.port, path)
        assert response.status == 404 and b"demo" not in body, path
    for method in ("POST", "PUT", "DELETE", "HEAD", "OPTIONS"):
        response, _ = get(endpoint.port, method=method)
        assert response.status == 405 and response.getheader("Allow") == "GET", method
    assert raw(endpoint.port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw(endpoint.port, b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello").startswith(b"HTTP/1.1 400 ")
    big = b"GET /metrics HTTP/1.1\r\nX-Padding: " + b"a" * 20000 + b"\r\n\r\n"
    assert raw(endpoint.port, big).startswith(b"HTTP/1.1 431 ")


def test_connections_are_kept_alive_as_http_1_1_says(running):
    endpoint = running()
    conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
    first, _ = get(endpoint.port, connection=conn)
    sock = conn.sock
    second, _ = get(endpoint.port, connection=conn)
    assert first.status == second.status == 200 and conn.sock is sock and endpoint.connections() == 1
    conn.close()
    closing = raw(endpoint.port, b"GET /metrics HTTP/1.0\r\n\r\n")  # HTTP/1.0: answered, then closed
    assert closing.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in closing


def test_the_token_is_required_when_configured(running):
    endpoint = running(token=TOKEN)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        response, body = get(endpoint.port, headers=headers)
        assert response.status == 401 and b"demo" not in body
        assert response.getheader("WWW-Authenticate").startswith("Bearer")
    response, body = get(endpoint.port, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status == 200 and b"demo_requests_total" in body


def test_idle_connections_are_closed_after_the_header_and_read_timeouts(running):
    endpoint = running(read_timeout_s=0.6, header_timeout_s=0.3)
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b""  # no request head: closed after the header timeout
        assert 0.2 < time.monotonic() - started < 3
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as sock:
        sock.sendall(b"GET /metr")  # a request head that never completes
        assert sock.recv(1) == b""
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        time.sleep(0.45)  # past the header timeout, within the read timeout: kept alive
        sock.sendall(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        answers = b""
        while chunk := sock.recv(65536):
            answers += chunk
        assert answers.count(b"HTTP/1.1 200 ") == 2


def test_idle_connections_never_cost_a_scrape(running):
    """Issue 53, item 7: connections that send nothing fill the cap, then a scraper still gets its
    answer at once (the longest-waiting idle connection is closed for it)."""
    endpoint = running(max_connections=3)
    idle = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) for _ in range(3)]
    try:
        deadline = time.monotonic() + 5
        while endpoint.connections() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(3):
            started = time.monotonic()
            answer = raw(endpoint.port, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 ")
            assert time.monotonic() - started < 2
        assert idle[0].recv(1) == b""  # the oldest idle connection was closed for a scraper
        assert endpoint.connections() <= 3
    finally:
        for sock in idle:
            sock.close()


def _threads_for_idle_connections(port: int, count: int, wait_for) -> int:
    """How many threads ``count`` idle connections to ``port`` add (after ``wait_for()`` holds)."""
    get(port)  # any worker the server starts on its first scrape exists before counting
    before = thread_count()
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]
    try:
        deadline = time.monotonic() + 10
        while not wait_for(before) and time.monotonic() < deadline:
            time.sleep(0.05)
        grown = thread_count() - before
        assert get(port)[0].status == 200  # still serving with the idle connections open
        return grown
    finally:
        for sock in sockets:
            sock.close()


def test_idle_connections_do_not_spend_a_thread_each(running):
    idle = 300
    endpoint = running(max_connections=idle + 10)
    grown = _threads_for_idle_connections(endpoint.port, idle, lambda before: endpoint.connections() == idle)
    assert grown <= 1, f"{idle} idle connections added {grown} threads"
    # The test can fail: prometheus_client's own threaded server (what served /metrics before)
    # spends a thread per idle connection (fewer connections here: its accept backlog is 5).
    threaded, _ = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        grown = _threads_for_idle_connections(threaded.server_port, 40,
                                              lambda before: thread_count() - before >= 30)
        assert grown >= 30
    finally:
        threaded.shutdown()
        threaded.server_close()
