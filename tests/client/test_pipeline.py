"""expertd.client.pipeline against the real server (tiny preset: layers 0 and 1, H=64, fp32, loopback).

m micro-batches in flight give the outputs of one micro-batch, in order, on every transport; the
attention of one micro-batch runs while another's expert call is in flight; a failing call (a layer
the server does not hold, an attention that raises, a server stopped mid-step, a caller that gives
up) reaches the caller and leaves nothing running.
"""
import asyncio
import json
import time

import numpy as np
import pytest
from cli_support import running_server

from expertd.client import AsyncExpertClient, ExpertClient, ExpertError, NotFoundError
from expertd.client.pipeline import TRANSPORTS, Pipeline, split_micro_batches

H = 64
LAYERS = [0, 1]
WEIGHTS = {layer: np.random.default_rng(100 + layer).standard_normal((H, H)).astype(np.float32) / np.sqrt(H)
           for layer in LAYERS}


def attention(layer: int, micro_batch: int, x: np.ndarray) -> np.ndarray:
    """A stand-in for the attention side's part of a layer: a fixed per-layer map of each token."""
    return np.tanh(x @ WEIGHTS.get(layer, WEIGHTS[0])).astype(np.float32)


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, H)).astype(np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    channel = str(tmp_path_factory.mktemp("channel") / "pipeline.sock")
    with running_server(tmp_path_factory, bucket_sizes=(1, 8, 16), shm_channel=channel) as handle:
        yield handle


@pytest.fixture(scope="module")
def target(server):
    return f"127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def reference(target):
    """Layer by layer with the blocking client, the whole batch in one call per layer."""
    x = tokens(11)
    with ExpertClient(target, timeout=60) as client:
        y = x
        for layer in LAYERS:
            y = client.forward(attention(layer, 0, y), layer=layer)
    return x, y


async def run(target, parts, *, transport, layers=LAYERS, attention_fn=attention, **kwargs):
    async with AsyncExpertClient(target, timeout=60) as client:
        async with Pipeline(client, layers, transport=transport, **kwargs) as pipeline:
            return await pipeline.run_step(parts, attention_fn)


async def leftover_tasks(wait: float = 2.0) -> set:
    """Tasks other than the caller's still alive after ``wait`` seconds (grpc's own bookkeeping of a
    cancelled call may take a loop iteration or two to finish)."""
    deadline = time.monotonic() + wait
    while (left := {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return left


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_pipeline_over_the_same_host_channel_gives_the_grpc_outputs(server, reference, micro_batches):
    x, want = reference
    got = asyncio.run(run(f"shm://{server.config.shm_channel}", split_micro_batches(x, micro_batches),
                          transport="unary"))
    np.testing.assert_array_equal(np.concatenate(got), want)


def test_split_micro_batches_keeps_row_order_and_refuses_empty_parts():
    x = tokens(7)
    parts = split_micro_batches(x, 3)
    assert [len(p) for p in parts] == [3, 2, 2]
    np.testing.assert_array_equal(np.concatenate(parts), x)
    with pytest.raises(ValueError, match="micro_batches must be an int between 1 and the 7 tokens"):
        split_micro_batches(x, 8)
    with pytest.raises(ValueError, match="x must be 2-D"):
        split_micro_batches(x[0], 1)


def test_pipeline_checks_its_arguments():
    with pytest.raises(ValueError, match="layers must be a non-empty list"):
        Pipeline(None, [])
    with pytest.raises(ValueError, match="transport must be one of"):
        Pipeline(None, [0], transport="carrier-pigeon")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        Pipeline(None, [0], timeout=0)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_micro_batches_give_the_outputs_of_one_batch_in_order(target, reference, transport, micro_batches):
    x, expected = reference
    outs = asyncio.run(run(target, split_micro_batches(x, micro_batches), transport=transport))
    assert [len(o) for o in outs] == [len(p) for p in split_micro_batches(x, micro_batches)]
    np.testing.assert_allclose(np.concatenate(outs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_attention_of_one_micro_batch_runs_while_another_is_at_the_experts(target, transport):
    calls = []

    def recording(layer, micro_batch, x):
        calls.append((layer, micro_batch))
        return attention(layer, micro_batch, x)

    asyncio.run(run(target, split_micro_batches(tokens(6), 3), transport=transport, attention_fn=recording))
    # Every micro-batch's layer-0 attention comes before any layer-1 attention: while micro-batch 0
    # waits for its layer-0 expert call, micro-batches 1 and 2 compute.
    assert calls[:3] == [(0, 0), (0, 1), (0, 2)]
    assert sorted(calls) == [(layer, i) for layer in LAYERS for i in range(3)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_async_attention_function_is_awaited(target, reference, transport):
    x, expected = reference

    async def on_a_device(layer, micro_batch, x):
        await asyncio.sleep(0.001)
        return attention(layer, micro_batch, x)

    outs = asyncio.run(run(target, split_micro_batches(x, 2), transport=transport, attention_fn=on_a_device))
    np.testing.assert_allclose(np.concatenate(outs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failing_layer_reaches_the_caller_and_the_pipeline_goes_on(target, reference, transport):
    x, expected = reference

    async def scenario():
        async with AsyncExpertClient(target, timeout=60) as client:
            async with Pipeline(client, [0, 7], transport=transport) as bad:
                with pytest.raises(NotFoundError, match="7"):
                    await bad.run_step(split_micro_batches(x, 3), attention)
                assert not await leftover_tasks()
            async with Pipeline(client, LAYERS, transport=transport) as good:  # the same channel still serves
                return await good.run_step(split_micro_batches(x, 3), attention)

    outs = asyncio.run(scenario())
    np.testing.assert_allclose(np.concatenate(outs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_attention_error_cancels_the_expert_calls_in_flight(target, transport):
    def broken(layer, micro_batch, x):
        if (layer, micro_batch) == (1, 1):
            raise RuntimeError("attention failed on micro-batch 1")
        return attention(layer, micro_batch, x)

    async def scenario():
        with pytest.raises(RuntimeError, match="attention failed on micro-batch 1"):
            await run(target, split_micro_batches(tokens(9), 3), transport=transport, attention_fn=broken)
        assert not await leftover_tasks()

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_caller_that_gives_up_leaves_nothing_running(target, transport):
    async def slow(layer, micro_batch, x):
        await asyncio.sleep(0.0 if layer == 0 else 30.0)
        return attention(layer, micro_batch, x)

    async def scenario():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run(target, split_micro_batches(tokens(4), 2), transport=transport,
                                       attention_fn=slow), timeout=2.0)
        assert not await leftover_tasks()

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_stopped_mid_step_fails_the_step_without_hanging(tmp_path_factory, transport):
    with running_server(tmp_path_factory, bucket_sizes=(1, 8)) as handle:
        target = f"127.0.0.1:{handle.port}"

        def stop_midway(layer, micro_batch, x):
            if (layer, micro_batch) == (1, 0):  # micro-batch 1's layer-0 call may still be in flight
                handle.stop(grace=0)
            return attention(layer, micro_batch, x)

        async def scenario():
            started = time.monotonic()
            async with AsyncExpertClient(target, timeout=10, retries=1) as client:
                async with Pipeline(client, LAYERS, transport=transport, timeout=10) as pipeline:
                    with pytest.raises(ExpertError) as caught:
                        await pipeline.run_step(split_micro_batches(tokens(6), 2), stop_midway)
            assert caught.value.code.name in ("UNAVAILABLE", "CANCELLED"), caught.value
            assert time.monotonic() - started < 10
            assert not await leftover_tasks()

        asyncio.run(scenario())


def load_example(name: str):
    """A module of examples/ (not a package), imported from its file."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_decode_loop_example_reports_every_m_with_the_expert_side_busy(server, target, capsys):
    decode_loop = load_example("decode_loop")
    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    assert decode_loop.main(["--target", target, "--metrics", metrics, "--tokens", "6", "--steps", "3", "--warmup",
                             "1", "--attention-ms", "1", "--micro-batches", "1,2,3,7", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers"] == LAYERS and report["hidden"] == H and report["dtype"] == "float32"
    assert [run["micro_batches"] for run in report["runs"]] == [1, 2, 3]  # 7 > 6 tokens: skipped
    for run in report["runs"]:
        assert run["tokens_per_s"] > 0 and run["layer_round_trip_ms"] > 0
        # 3 steps x 2 layers x 1 ms of synthetic attention, and engine steps the server counted
        assert 0 < run["expert_busy_fraction"] < 1 and 0 < run["attention_busy_fraction"] < 1
        assert run["attention_busy_fraction"] * run["steps"] * run["tokens"] / run["tokens_per_s"] >= 3 * 2 * 1e-3
