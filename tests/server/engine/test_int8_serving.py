"""`--expert-weights int8`: the real server (tiny preset, bf16, loopback port 0) serving INT8 expert
weights through the real client: the in-process layer on the same INT8 weights, within the documented
error of the bf16 layer, and what start-up and GetModelInfo-side reports say is served; the option's
checks. An FP8 checkpoint served so: its routed experts converted from the stored codes as they load
(the reference conversion's bits), the layer through the real client within the documented error of
the checkpoint's exact dense layer, and the rule that picks the conversion."""
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_fixtures import write_checkpoint
from service_support import server_config

from expertd.client import ExpertClient
from expertd.kernels import cpu, moe
from expertd.kernels.cpu import int8
from expertd.server import cli
from expertd.server import config as cfg
from expertd.server.app import create_server
from expertd.server.config import ModelConfig
from expertd.server.engine import build
from expertd.server.models.checkpoint import load_checkpoint

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")

H = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = ModelConfig(preset="tiny", dtype="bfloat16", num_devices=1, expert_weights="int8")
    handle = create_server(server_config(tmp_path_factory, model=model))
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=5)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _layer(params, x, cfg):
    return moe.moe_layer(params, x, cfg)


def test_int8_layer_through_the_real_client(server):
    x = np.random.default_rng(0).standard_normal((5, H)).astype(ml_dtypes.bfloat16)
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        for index, layer in server.engine.layers.items():
            assert all(getattr(layer.params, n).int8 for n in moe.EXPERT_WEIGHTS)
            y = client.forward(x, layer=index).astype(np.float32)
            same = np.asarray(_layer(layer.params, jnp.asarray(x), layer.cfg), np.float32)
            np.testing.assert_allclose(y, same, rtol=1e-2, atol=1e-2)  # the same INT8 layer, other batch padding
            bf16 = layer.params.replace(**{n: cpu.dense_weights(getattr(layer.params, n)).astype(jnp.bfloat16)
                                           for n in moe.EXPERT_WEIGHTS})
            ref = np.asarray(_layer(bf16, jnp.asarray(x), layer.cfg), np.float32)  # dequantised, then bf16
            assert np.abs(y - ref).max() / np.abs(ref).max() < int8.ERROR_BOUND


def test_start_up_and_info_say_int8_is_served(server):
    info = server.served.info()
    assert info["expert_weights"] == "int8" and info["weight_layout"] == "panels"
    assert {p["dtype"] for layer in info["layers"] for n, p in layer["params"].items() if n in moe.EXPERT_WEIGHTS} \
        == {"int8"}
    assert any("INT8 expert weights" in line for line in server.served.notes())


def test_the_option_is_checked():
    assert "--expert-weights dtype|int8" in cli.parser().format_help()  # its help renders (argparse: no bare %)
    assert cfg.parse_args(["--expert-weights", "int8"], environ={}).model.expert_weights == "int8"
    assert cfg.parse_args([], environ={}).model.expert_weights == "dtype"
    with pytest.raises(ValueError, match="--expert-weights must be one of"):
        ModelConfig(expert_weights="fp4")
    with pytest.raises(ValueError, match="drop --no-panel-weights"):
        ModelConfig(expert_weights="int8", panel_weights=False)


def test_an_fp8_checkpoint_is_served_as_int8_converted_from_its_codes(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8")
    write_checkpoint(path, "deepseek_v3", num_layers=3, quantize="fp8", dtype="bfloat16", block=(16, 16))
    model = ModelConfig(checkpoint=str(path), num_devices=1, expert_weights="int8")
    assert build.converts_fp8_to_int8(model, jax.devices("cpu")[:1])
    handle = create_server(server_config(tmp_path_factory, model=model))
    try:
        handle.wait_ready(timeout=300)
        assert handle.served.info()["expert_weights"] == "int8"
        kept = {layer.index: layer for layer in load_checkpoint(path, keep_fp8=True)}  # the stored codes
        dense = {layer.index: layer for layer in load_checkpoint(path, dtype="float32")}  # exact dequantisation
        with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as client:
            for index, layer in handle.engine.layers.items():
                for n in moe.EXPERT_WEIGHTS:
                    w, stored = getattr(layer.params, n), kept[index].params[n]
                    q_ref, s_ref = int8.fp8_to_int8_reference(stored.codes, stored.scales, stored.block)
                    e, k, c = w.logical_shape
                    q = np.asarray(w.panels).transpose(0, 2, 1, 3).reshape(e, k, -1)[:, :, :c]
                    np.testing.assert_array_equal(q, q_ref, err_msg=f"layer {index} {n}")
                    np.testing.assert_array_equal(np.asarray(w.scales), s_ref, err_msg=f"layer {index} {n}")
                x = np.random.default_rng(index).standard_normal((6, layer.cfg.hidden_size)).astype(ml_dtypes.bfloat16)
                y = client.forward(x, layer=index).astype(np.float32)
                params = moe.MoEParams.from_dict({k: jnp.asarray(v) for k, v in dense[index].params.items()},
                                                 layer.cfg)
                ref = np.asarray(_layer(params, jnp.asarray(x).astype(jnp.float32), layer.cfg), np.float32)
                assert np.abs(y - ref).max() / np.abs(ref).max() < int8.ERROR_BOUND
    finally:
        handle.stop(grace=5)


def test_the_fp8_to_int8_rule(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, quantize="fp8", dtype="bfloat16", block=(16, 16))
    cpu_device, gpu = types.SimpleNamespace(platform="cpu"), types.SimpleNamespace(platform="gpu")
    model = ModelConfig(checkpoint=str(tmp_path), expert_weights="int8")
    assert build.converts_fp8_to_int8(model, [cpu_device])
    assert not build.converts_fp8_to_int8(dataclasses.replace(model, expert_weights="dtype"), [cpu_device])
    assert not build.converts_fp8_to_int8(model, [gpu])
    assert not build.converts_fp8_to_int8(model, [cpu_device, cpu_device])  # expert parallel: dense weights
    assert not build.converts_fp8_to_int8(dataclasses.replace(model, backend="ragged_dot"), [cpu_device])
    write_checkpoint(tmp_path / "bf16", "deepseek_v3", num_layers=3, dtype="bfloat16")
    assert not build.converts_fp8_to_int8(dataclasses.replace(model, checkpoint=str(tmp_path / "bf16")), [cpu_device])

