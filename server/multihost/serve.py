"""Multi-host serving: one expert-parallel mesh over the GPUs of several hosts (processes).

Every process of the group runs `expertd serve` with the same configuration. They join one
`jax.distributed` job (process 0 hosts the coordinator), so `jax.devices()` lists every device of
the group and each Engine builds the same global mesh, each process holding the expert shards of
its own devices. JAX's multi-controller rule then applies: all processes must run the same
compiled steps, with the same inputs, in the same order.

- Process 0, the leader, runs the whole server of `expertd.server.app` (gRPC front end, batcher,
  health, metrics). Its batcher runs steps through a `LeaderEngine`, which sends every step
  (layer, kind, the padded tokens, the valid count) to the followers over the batch channel
  (`expertd.server.multihost.channel`) before running it on the engine.
- Processes 1..N-1, the followers, serve only grpc.health.v1 (same port, same service names) and
  metrics; they receive the steps and run them on their own Engine, discarding the results.
- A lost peer (dead: its socket closes; hung: its heartbeats stop for `--peer-timeout-s`) makes
  the survivor report NOT_SERVING and exit with status 3 within `--peer-timeout-s` +
  `--exit-grace-s`, instead of blocking forever in a collective; Kubernetes then restarts the
  group (LeaderWorkerSet: RecreateGroupOnPodRestart).

Where the group comes from: ``expertd.server.config.MultihostConfig`` (flags and TOML ``[multihost]``
win over the environment):
  --coordinator-address HOST:PORT  or  $LWS_LEADER_ADDRESS + --coordinator-port (default 8476)
  --num-processes N                or  $LWS_GROUP_SIZE
  --process-id I                   or  $LWS_WORKER_INDEX
  --multihost-port P               the leader's batch channel (default: coordinator port + 1)
JAX's own cluster auto-detection is switched off (`cluster_detection_method="deactivate"`): it
supports only Jobs/JobSets on Kubernetes. One process (no flags, no LWS_* variables, or a group of
1) serves exactly as a single-host server.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import jax
import numpy as np

from expertd.server.app import create_server
from expertd.server.config import MultihostConfig, ServerConfig
from expertd.server.console import print_progress, say
from expertd.server.engine.warmup import warm_up
from expertd.server.multihost.channel import FollowerChannel, LeaderChannel, PeerLost
from expertd.server.multihost.follower import FollowerServer
from expertd.server.transport import listen

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 3


def initialize(group: MultihostConfig) -> None:
    """Join the jax.distributed job (blocks until every process arrived); before any JAX work."""
    jax.distributed.initialize(coordinator_address=group.coordinator_address, num_processes=group.num_processes,
                               process_id=group.process_id, cluster_detection_method="deactivate",
                               initialization_timeout=int(group.join_timeout_s))
    log.info("multi-host: process %d of %d joined; %d devices in the group, %d local",
             group.process_id, group.num_processes, jax.device_count(), jax.local_device_count())


# ---------------------------------------------------------------------- the leader's engine

class LeaderEngine:
    """Runs the batcher's steps (the Engine's `forward` and `route`, same arguments) on the leader's
    engine, each first sent to the followers (see module docstring). Its inputs are the batcher's:
    tokens padded to a bucket in the engine dtype (or fp32 logits), so every step can go over the
    channel as it is."""

    def __init__(self, engine, channel: LeaderChannel):
        self._engine, self._channel = engine, channel
        self._lock = threading.Lock()

    def forward(self, layer: int, tokens, num_valid: int, token_ids=None):
        return self._step("forward", {"layer": int(layer), "num_valid": int(num_valid)}, tokens, token_ids)

    def route(self, layer: int, tokens, num_valid: int, *, from_logits: bool = False, aux_loss_coeff: float = 1.0,
              token_ids=None):
        return self._step("route", {"layer": int(layer), "num_valid": int(num_valid), "from_logits": bool(from_logits),
                                    "aux_loss_coeff": float(aux_loss_coeff)}, tokens, token_ids)

    def _step(self, op: str, args: dict, tokens, token_ids):
        arrays = {"tokens": tokens} if token_ids is None else {"tokens": tokens, "token_ids": np.asarray(token_ids)}
        with self._lock:  # send and run as one: the followers see the steps in the leader's order
            self._channel.broadcast(op, args, arrays)
            return getattr(self._engine, op)(**arrays, **args)


def follow(engine, channel: FollowerChannel, metrics=None) -> None:
    """A follower's loop: run every step the leader sends, in order, until it says shutdown.

    A step the engine refuses (ValueError, LookupError) was refused on the leader too: it is
    skipped; PeerLost propagates.
    """
    for op, args, arrays in channel.steps():
        if op not in ("forward", "route"):
            raise PeerLost(f"multi-host: the leader sent an unknown step {op!r}")
        started = time.perf_counter()
        try:
            getattr(engine, op)(**args, **arrays)
        except (ValueError, LookupError) as exc:
            log.debug("multi-host: step %s rejected, as on the leader: %s", op, exc)
            continue
        if metrics is not None:
            metrics.observe_execution(args["layer"], op, time.perf_counter() - started)


# ---------------------------------------------------------------------- expertd serve

def serve(config: ServerConfig) -> int:
    """`expertd serve` as process `config.multihost.process_id` of a group; returns the exit status.
    A port another process listens on is refused in one line (status 1) before the group is joined;
    a bad setting or a port taken later, in one line after."""
    group = config.multihost
    try:
        check_ports(config)
    except OSError as exc:
        say(f"error: {exc}")
        return 1
    initialize(group)
    lost = threading.Event()
    try:
        code = (_serve_leader if group.is_leader else _serve_follower)(config, group, lost)
    except (ValueError, OSError) as exc:  # a bad setting, a port taken since the check: the cause alone
        say(f"error: {exc}")
        _exit_now(1)
    except Exception:  # noqa: BLE001 - JAX's exit hooks would wait for the others: leave at once
        log.exception("multi-host: process %d failed", group.process_id)
        _exit_now(1)
    if lost.is_set():
        _exit_now(EXIT_PEER_LOST)
    return code


def check_ports(config: ServerConfig) -> None:
    """OSError naming the flag when another process listens on a port this process would bind:
    gRPC and metrics, and the leader's batch channel."""
    listen.check_free(config.host, config.port, "--port")
    listen.check_free(config.metrics_bind_host, config.metrics_port, "--metrics-port")
    if config.multihost.is_leader:
        listen.check_free(config.host, config.multihost.channel_port, "--multihost-port")


def _serve_leader(config: ServerConfig, group: MultihostConfig, lost: threading.Event) -> int:
    handle = None

    def on_lost(reason: str) -> None:
        _report_lost(reason, lost, group)
        if handle is not None:
            handle.request_stop(group.exit_grace_s)  # health NOT_SERVING, new calls UNAVAILABLE

    channel = LeaderChannel(config.host, group.channel_port, group.num_processes - 1,
                            peer_timeout_s=group.peer_timeout_s, on_lost=on_lost)
    say(f"multi-host leader of {group.num_processes} processes: batch channel on port {channel.port}")
    # readiness means "the group is whole": after warm-up, wait for every follower to connect
    handle = create_server(config, progress=print_progress, step_runner=lambda engine: LeaderEngine(engine, channel),
                           on_warm=lambda: channel.accept(group.join_timeout_s))
    say(handle.listening_summary())
    say(f"metrics on {handle.metrics_url}")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: handle.request_stop())
    try:
        handle.wait_ready()
    except RuntimeError as exc:
        say(f"error: {exc}")
        channel.close()
        return _exit_now(1)
    say(f"ready: {len(handle.model.layers)} layers on {handle.model.mesh.size} devices of "
        f"{group.num_processes} processes")
    while not handle.wait(0.5):
        pass
    if not lost.is_set():
        channel.close()  # tells the followers to exit
        say("drained, followers told to stop, exiting")
    return 0


def _serve_follower(config: ServerConfig, group: MultihostConfig, lost: threading.Event) -> int:
    server = FollowerServer(config)
    say(f"multi-host follower {group.process_id}: health on {config.host}:{server.port}"
        + (" (TLS)" if server.tls else "") + f", metrics on {server.metrics_url}")
    log.info("%s", server.security)

    def on_lost(reason: str) -> None:
        server.mark_lost()
        _report_lost(reason, lost, group)

    channel = FollowerChannel(group.coordinator_host, group.channel_port, group.process_id,
                              peer_timeout_s=group.peer_timeout_s, on_lost=on_lost)
    # SIGTERM: keep running the leader's steps while it drains; it says shutdown when done.
    signal.signal(signal.SIGTERM, lambda *_: log.info("multi-host: SIGTERM; following the leader until it stops"))
    warm_up(server.engine, print_progress)
    channel.connect(group.join_timeout_s)
    server.set_ready(True)
    say(f"ready: following the leader at {group.coordinator_host}:{group.channel_port}")
    try:
        follow(server.engine, channel, server.metrics)
    except PeerLost:
        lost.wait()  # on_lost ran; serve() exits with EXIT_PEER_LOST
    server.stop()
    channel.close()
    say("the leader stopped, exiting")
    return 0


def _report_lost(reason: str, lost: threading.Event, group: MultihostConfig) -> None:
    if lost.is_set():
        return
    lost.set()
    log.error("multi-host: %s; NOT_SERVING, exiting with status %d within %.1f s", reason, EXIT_PEER_LOST,
              group.exit_grace_s)
    # A thread may be blocked in a collective that never finishes: leave after the grace at the latest.
    timer = threading.Timer(group.exit_grace_s, _exit_now, args=(EXIT_PEER_LOST,))
    timer.daemon = True
    timer.start()


def _exit_now(code: int):
    """Leave at once: `os._exit`, since JAX's exit hooks would wait for the lost peer."""
    logging.shutdown()
    os._exit(code)

