"""`--expert-weights int8`: the real server (tiny preset, bf16, loopback port 0) serving INT8 expert
weights through the real client: the in-process layer on the same INT8 weights, within the documented
error of the bf16 layer, and what start-up and GetModelInfo-side reports say is served; the option's
checks."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from service_support import server_config

from expertd.client import ExpertClient
from expertd.kernels import cpu, moe
from expertd.kernels.cpu import int8
from expertd.server import cli
from expertd.server import config as cfg
from expertd.server.app import create_server
from expertd.server.config import ModelConfig

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
