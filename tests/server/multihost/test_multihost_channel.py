"""The multi-host batch channel on loopback (no JAX): framing, ordered broadcast to several
followers, and bounded detection of a dead or silent peer on both ends."""
from __future__ import annotations

import socket
import struct
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from expertd.server.multihost.channel import FollowerChannel, LeaderChannel, PeerLost, recv_frame, send_frame

TIMEOUT = 0.6  # peer timeout of these tests: detection must come within it (+ scheduling slack)


class Lost:
    """Records on_lost calls and when they happened."""

    def __init__(self):
        self.reasons, self.event = [], threading.Event()

    def __call__(self, reason):
        self.reasons.append(reason)
        self.event.set()


def leader_and_followers(count, accept_after=0.0):
    lost = Lost()
    leader = LeaderChannel("127.0.0.1", 0, count, peer_timeout_s=TIMEOUT, on_lost=lost)
    followers = [FollowerChannel("127.0.0.1", leader.port, i + 1, peer_timeout_s=TIMEOUT, on_lost=Lost())
                 for i in range(count)]
    threads = [threading.Thread(target=f.connect, args=(10,)) for f in followers]
    for t in threads:
        t.start()
    time.sleep(accept_after)  # the leader still warming up
    leader.accept(10)
    for t in threads:
        t.join()
    return leader, lost, followers


def test_frames_round_trip_every_dtype():
    a, b = socket.socketpair()
    arrays = {"x": np.arange(12, dtype=np.float32).reshape(3, 4),
              "h": (np.arange(6).reshape(2, 3) / 7).astype(ml_dtypes.bfloat16),
              "f16": np.linspace(-1, 1, 5, dtype=np.float16), "ids": np.array([[3, -1]], np.int32),
              "empty": np.zeros((0, 4), np.float32)}
    send_frame(a, {"type": "step", "args": {"layer": 3, "num_valid": None}}, arrays)
    header, got = recv_frame(b)
    assert header == {"type": "step", "args": {"layer": 3, "num_valid": None}}
    assert list(got) == list(arrays)
    for name, value in arrays.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape
        np.testing.assert_array_equal(got[name], value)
    with pytest.raises(ValueError, match="dtype"):
        send_frame(a, {}, {"x": np.zeros(2, np.float64)})


def test_garbage_is_refused():
    a, b = socket.socketpair()
    a.sendall(struct.pack("!II", 1 << 30, 0))
    with pytest.raises(PeerLost, match="not an expertd peer"):
        recv_frame(b)
    a.close()
    with pytest.raises(PeerLost, match="closed"):
        recv_frame(b)


def test_steps_reach_every_follower_in_order():
    # Followers that connect long before the leader accepts wait for it without timing out.
    leader, lost, followers = leader_and_followers(2, accept_after=2 * TIMEOUT)
    received = [[] for _ in followers]

    def consume(i):
        for op, args, arrays in followers[i].steps():
            received[i].append((op, args, {k: v.tolist() for k, v in arrays.items()}))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    sent = []
    for seq in range(20):
        x = np.full((2, 3), seq, np.float32)
        leader.broadcast("forward", {"layer": seq % 3, "num_valid": 1}, {"x": x})
        sent.append(("forward", {"layer": seq % 3, "num_valid": 1}, {"x": x.tolist()}))
        if seq == 10:
            time.sleep(2 * TIMEOUT)  # idle longer than the timeout: heartbeats keep both ends alive
    leader.close()
    for t in threads:
        t.join(10)
    assert received == [sent, sent]
    assert not lost.reasons and not any(f._on_lost.reasons for f in followers)


def test_leader_notices_a_dead_follower_at_once():
    leader, lost, followers = leader_and_followers(2)
    start = time.monotonic()
    followers[1].close()  # what the kernel does when the follower process dies
    assert lost.event.wait(5) and time.monotonic() - start < TIMEOUT
    assert "process 2" in lost.reasons[0]
    with pytest.raises(PeerLost):
        leader.broadcast("forward", {}, {"x": np.zeros((1, 1), np.float32)})
    leader.close()


def test_leader_notices_a_silent_follower_within_the_timeout():
    lost = Lost()
    leader = LeaderChannel("127.0.0.1", 0, 1, peer_timeout_s=TIMEOUT, on_lost=lost)
    hung = socket.create_connection(("127.0.0.1", leader.port))
    send_frame(hung, {"type": "hello", "process_id": 1})  # then never a heartbeat: a stopped process
    leader.accept(10)
    start = time.monotonic()
    assert lost.event.wait(5)
    assert TIMEOUT * 0.9 <= time.monotonic() - start <= TIMEOUT + 1.0
    assert "sent nothing" in lost.reasons[0]
    leader.close()
    hung.close()


def test_follower_notices_a_dead_leader():
    leader, _, (follower,) = leader_and_followers(1)
    for link in leader._links.values():
        link.close()  # no shutdown frame: the leader process died
    with pytest.raises(PeerLost):
        list(follower.steps())
    assert follower._on_lost.event.wait(5)


def test_accept_names_missing_followers_and_drops_strangers():
    leader = LeaderChannel("127.0.0.1", 0, 2, peer_timeout_s=TIMEOUT, on_lost=Lost())
    stranger = socket.create_connection(("127.0.0.1", leader.port))
    send_frame(stranger, {"type": "hello", "process_id": 7})  # no such process
    follower = FollowerChannel("127.0.0.1", leader.port, 2, peer_timeout_s=TIMEOUT, on_lost=Lost())
    # The follower said hello but is never welcomed: it gives up after its own timeout.
    connect = threading.Thread(target=pytest.raises, args=(TimeoutError, follower.connect, 1.5))
    connect.start()
    with pytest.raises(TimeoutError, match=r"followers \[1\]"):
        leader.accept(1.0)
    connect.join(10)
    follower.close()
    stranger.close()


def test_follower_gives_up_when_the_leader_never_accepts():
    leader = LeaderChannel("127.0.0.1", 0, 1, peer_timeout_s=TIMEOUT, on_lost=Lost())
    follower = FollowerChannel("127.0.0.1", leader.port, 1, peer_timeout_s=TIMEOUT, on_lost=Lost())
    with pytest.raises(TimeoutError, match="did not accept this process"):
        follower.connect(1.0)
    leader.close()


def test_follower_gives_up_when_no_leader_listens():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    follower = FollowerChannel("127.0.0.1", port, 1, peer_timeout_s=TIMEOUT, on_lost=Lost())
    with pytest.raises(TimeoutError, match="did not accept"):
        follower.connect(0.5)
