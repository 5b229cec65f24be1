"""Multi-host serving, in one process: the group's configuration from flags and the
LeaderWorkerSet variables; LeaderEngine + follow() (every step the leader runs reaches the follower
with the same inputs, in order: real engine, real channel on loopback). The real group of processes
is in test_multihost_processes.py."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from expertd.server.config import multihost_from
from expertd.server.engine import api
from expertd.server.engine.build import build_engine
from expertd.server.engine.warmup import warm_up
from expertd.server.models.presets import load_preset
from expertd.server.multihost import serve
from expertd.server.multihost.channel import FollowerChannel, LeaderChannel

BUCKETS = (8,)


# ---------------------------------------------------------------------- configuration

def test_group_from_lws_variables_and_flags():
    lws = {"LWS_LEADER_ADDRESS": "expertd-0.expertd.ns", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}
    group = multihost_from({}, lws)
    assert (group.coordinator_address, group.num_processes, group.process_id) == ("expertd-0.expertd.ns:8476", 4, 2)
    assert group.enabled and not group.is_leader and group.channel_port == 8477
    assert group.coordinator_host == "expertd-0.expertd.ns"
    flags = {"coordinator_port": 9000, "process_id": 0, "multihost_port": 7000, "peer_timeout_s": 1.5}
    group = multihost_from(flags, lws)
    assert group.coordinator_address == "expertd-0.expertd.ns:9000" and group.is_leader
    assert (group.channel_port, group.peer_timeout_s) == (7000, 1.5)
    explicit = multihost_from({"coordinator_address": "[fd00::1]:1234", "num_processes": 2, "process_id": 1}, lws)
    assert (explicit.coordinator_host, explicit.channel_port, explicit.num_processes) == ("fd00::1", 1235, 2)


def test_single_host_unless_a_group_is_given():
    assert not multihost_from({}, {}).enabled
    assert not multihost_from({}, {"LWS_LEADER_ADDRESS": "a", "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}).enabled


@pytest.mark.parametrize("given, environ, message", [
    ({"num_processes": 2, "process_id": 1}, {}, "--coordinator-address"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, {}, "--process-id"),
    ({"coordinator_address": "no-port", "num_processes": 2}, {}, "HOST:PORT"),
    ({"num_processes": 0}, {}, "--num-processes"),
    ({}, {"LWS_LEADER_ADDRESS": "a", "LWS_GROUP_SIZE": "two"}, "LWS_GROUP_SIZE"),
    ({"coordinator_address": "h:1", "num_processes": 2, "peer_timeout_s": 0}, {}, "--peer-timeout-s"),
])
def test_bad_group_settings_name_the_option(given, environ, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        multihost_from(given, environ)


# ---------------------------------------------------------------------- leader engine, in one process

def test_leader_engine_sends_every_step_and_the_follower_runs_it():
    engine = build_engine(load_preset("tiny", num_layers=1, dtype="float32"), buckets=BUCKETS, dtype="float32",
                          devices=1).engine
    lost = []
    leader_channel = LeaderChannel("127.0.0.1", 0, 1, peer_timeout_s=5, on_lost=lost.append)
    follower_channel = FollowerChannel("127.0.0.1", leader_channel.port, 1, peer_timeout_s=5, on_lost=lost.append)
    connect = threading.Thread(target=follower_channel.connect, args=(30,))
    connect.start()
    leader = serve.LeaderEngine(engine, leader_channel)
    warm_up(engine)
    leader_channel.accept(30)  # what the leader's server does after warm-up
    connect.join()

    class Recording:  # the follower's engine: the real one, recording what it is asked to run
        def __init__(self):
            self.calls, self.token_ids = [], []

        def forward(self, layer, tokens, num_valid, token_ids=None):
            self.calls.append(("forward", layer, tokens.copy(), num_valid))
            self.token_ids.append(token_ids)
            return engine.forward(layer, tokens, num_valid, token_ids=token_ids)

        def route(self, layer, tokens, num_valid, *, from_logits=False, aux_loss_coeff=1.0, token_ids=None):
            self.calls.append(("route", layer, tokens.copy(), num_valid, from_logits, aux_loss_coeff))
            return engine.route(layer, tokens, num_valid, from_logits=from_logits, aux_loss_coeff=aux_loss_coeff)

    follower = Recording()
    follow = threading.Thread(target=serve.follow, args=(follower, follower_channel))
    follow.start()
    rng = np.random.default_rng(1)
    x = api.pad_rows([rng.standard_normal((5, 64), dtype=np.float32)], 8)
    logits = api.pad_rows([rng.standard_normal((3, engine.layers[0].cfg.num_experts), dtype=np.float32)], 8)
    out = leader.forward(np.int64(0), x, num_valid=np.int64(4))
    routed = leader.route(0, logits, 3, from_logits=True, aux_loss_coeff=np.float32(0.5))
    with pytest.raises(LookupError):
        leader.forward(7, x, 5)  # unknown layer: refused on both sides, the follower goes on
    leader.forward(0, x, 5, token_ids=np.arange(8, dtype=np.int32))
    leader_channel.close()
    follow.join(30)
    assert not follow.is_alive() and not lost
    assert [c[0] for c in follower.calls] == ["forward", "route", "forward", "forward"]
    np.testing.assert_array_equal(follower.calls[0][2], x)
    assert follower.calls[0][3] == 4 and follower.calls[1][3:] == (3, True, 0.5)
    np.testing.assert_array_equal(follower.calls[1][2], logits)
    assert follower.token_ids[0] is None  # and a step's token ids travel to the followers with its tokens
    np.testing.assert_array_equal(follower.token_ids[-1], np.arange(8, dtype=np.int32))
    assert out.output.shape == (4, 64) and routed.topk_ids.shape == (3, engine.layers[0].cfg.topk)
