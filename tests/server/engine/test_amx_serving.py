"""The real server (tiny preset, bf16, loopback port 0) serving a layer on AMX tiles through the real
client: on the hardware's tiles where the CPU runs them (`cpu.isa() == "amx_bf16"`), else on their
software model (kernels/cpu/csrc/amx_tiles.h); the same bits as the AVX paths of the same server."""
import ml_dtypes
import numpy as np
import pytest
from service_support import server_config

from expertd.client import ExpertClient
from expertd.kernels import cpu
from expertd.kernels.cpu import diagnostics
from expertd.server.app import create_server
from expertd.server.config import ModelConfig

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = ModelConfig(preset="tiny", dtype="bfloat16", num_devices=1)
    handle = create_server(server_config(tmp_path_factory, model=model, bucket_sizes=(128,)))
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=5)


def test_the_server_serves_a_layer_on_the_tiles_through_the_real_client(server):
    """128 tokens (one step of the one 128-token bucket) of tiny's 8 experts, top 2: about 32 rows
    per expert, the AMX path's regime. On
    the hardware's tiles where the CPU runs them, else on the model; the same bits either way as the
    AVX paths of the same server."""
    x = np.random.default_rng(0).standard_normal((128, 64)).astype(ml_dtypes.bfloat16)
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=120) as client:
        with diagnostics.limit_isa("avx512_bf16"):
            want = client.forward(x, layer=0)
        before = diagnostics.path_items()["amx_bf16"]
        if cpu.isa() == "amx_bf16":
            got = client.forward(x, layer=0)
        else:
            with diagnostics.emulate_amx("high_first"):
                got = client.forward(x, layer=0)
        assert diagnostics.path_items()["amx_bf16"] > before
    assert got.shape == (128, 64) and np.isfinite(got.astype(np.float32)).all()
    np.testing.assert_array_equal(got, want)
