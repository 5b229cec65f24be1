"""Load for tests/server/batching/test_overload.py, run as its own process (``python overload_load.py SPEC``)
so that the load generator never shares the test's GIL with the server.

SPEC (JSON): target, hidden, duration (s), seed, and streams: each {name, tokens, deadline (s),
and either concurrency (closed loop) or rate (open loop, Poisson arrivals, req/s)}. Every stream
sends expertd.v1 Forward calls of [tokens, hidden] bf16, pre-serialized, on one shared channel.
Prints JSON: {"duration": s, "calls": {name: [[sent offset s, latency s, status code], ...]}}.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc
import ml_dtypes
import numpy as np

from expertd.client import codec
from expertd.client.pb.v1 import expert_pb2

FORWARD = "/expertd.v1.ExpertService/Forward"


def payloads(hidden: int, tokens: int, seed: int, variants: int = 4) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(
        rng.standard_normal((tokens, hidden), np.float32).astype(ml_dtypes.bfloat16))).SerializeToString()
        for _ in range(variants)]


async def run(spec: dict) -> dict:
    channel = grpc.aio.insecure_channel(spec["target"], options=[("grpc.max_send_message_length", -1),
                                                                 ("grpc.max_receive_message_length", -1)])
    call = channel.unary_unary(FORWARD)
    rng = np.random.default_rng(spec.get("seed", 0))
    calls: dict[str, list] = {}

    async def one(name: str, payload: bytes, started: float, timeout: float) -> None:
        sent = time.perf_counter()
        try:
            await call(payload, timeout=timeout)
            code = "OK"
        except grpc.aio.AioRpcError as error:
            code = error.code().name
        calls.setdefault(name, []).append((sent - started, time.perf_counter() - sent, code))

    async def closed(stream: dict, items: list[bytes], until: float, started: float) -> None:
        async def worker(i: int) -> None:
            n = i
            while time.perf_counter() < until:
                await one(stream["name"], items[n % len(items)], started, stream["deadline"])
                n += stream["concurrency"]
        await asyncio.gather(*(worker(i) for i in range(stream["concurrency"])))

    async def opened(stream: dict, items: list[bytes], until: float, started: float) -> None:
        tasks, next_send, n = set(), time.perf_counter(), 0
        while next_send < until:
            delay = next_send - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(one(stream["name"], items[n % len(items)], started, stream["deadline"]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
            next_send += rng.exponential(1.0 / stream["rate"])
        await asyncio.gather(*tasks)

    await channel.channel_ready()
    jobs = []
    prepared = [(stream, payloads(spec["hidden"], stream["tokens"], spec.get("seed", 0))) for stream in spec["streams"]]
    started = time.perf_counter()
    until = started + spec["duration"]
    for stream, items in prepared:
        jobs.append((opened if stream.get("rate") else closed)(stream, items, until, started))
    await asyncio.gather(*jobs)
    await channel.close()
    return {"duration": time.perf_counter() - started, "calls": calls}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(json.loads(sys.argv[1])))))
