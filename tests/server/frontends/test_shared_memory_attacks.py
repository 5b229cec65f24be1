"""Shared memory against a caller that misbehaves (issue 53, items 3 and 4), a real ``expertd
serve`` process on loopback: a caller truncating its object while calls read and write it gets
INVALID_ARGUMENT for those calls, never a fault of the server (which stays SERVING and answers a
good neighbour); a root server refuses another user's object, naming ``key``."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from service_support import serve_process

from expertd.client import ExpertClient, InvalidArgumentError
from expertd.client.shared_memory import SharedMemoryRegion

H = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve_process(tmp_path_factory) as handle:
        yield handle


def test_truncating_a_region_while_calls_use_it_fails_those_calls_only(server):
    x = np.random.default_rng(0).standard_normal((8, H)).astype(np.float32)
    with ExpertClient(server.target, timeout=60, retries=0) as client, \
            SharedMemoryRegion("cut", 2 * x.nbytes, key=f"/expertd-cut-{os.getpid()}") as region:
        expected = client.forward(x, layer=0)
        client.register_shared_memory(region)
        inp, out = region.tensor(0, x.dtype, x.shape), region.tensor(x.nbytes, x.dtype, x.shape)
        inp.array[...] = x
        path = f"/dev/shm/{region.key.lstrip('/')}"
        stop = threading.Event()

        def cut():  # the attacker: shrink the object to nothing and back, as fast as it can
            fd = os.open(path, os.O_RDWR)
            try:
                while not stop.is_set():
                    os.ftruncate(fd, 0)
                    os.ftruncate(fd, 2 * x.nbytes)
            finally:
                os.ftruncate(fd, 2 * x.nbytes)
                os.close(fd)

        cutter = threading.Thread(target=cut)
        cutter.start()
        refused = answered = 0
        try:
            for _ in range(200):
                try:
                    client.forward(inp, layer=0, out=out)
                    answered += 1
                except InvalidArgumentError as exc:
                    assert "shrank" in str(exc) and "shared_memory" in str(exc), exc
                    refused += 1
        finally:
            stop.set()
            cutter.join()
        assert server.process.poll() is None, "the server died"
        assert answered + refused == 200
        inp.array[...] = x  # the truncations zeroed it
        np.testing.assert_array_equal(client.forward(inp, layer=0, out=out), expected)
        np.testing.assert_array_equal(client.forward(x, layer=0), expected)  # a neighbour without shm
        client.unregister_shared_memory()
        del inp, out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make an object of another user")
def test_a_root_server_refuses_another_users_object(server):
    with ExpertClient(server.target, timeout=60, retries=0) as client, \
            SharedMemoryRegion("theirs", 4096, key=f"/expertd-theirs-{os.getpid()}") as region:
        path = f"/dev/shm/{region.key.lstrip('/')}"
        os.chown(path, 65534, 65534)
        os.chmod(path, 0o600)
        with pytest.raises(InvalidArgumentError, match="key: .*belongs to uid 65534"):
            client.register_shared_memory(region)
        assert client.shared_memory_status() == []
