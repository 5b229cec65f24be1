"""The tokamax backend's edges (its results against the oracles are test_experts.py's and
test_moe.py's grids, which run every backend, and test_fp8.py's): the kernels import and run
without tokamax, asking for it then names the package and the extra, and on GPU it asks tokamax for
its own order (Mosaic GPU first)."""
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from expertd.kernels.experts import TokamaxMissing, grouped_ffn
from expertd.kernels.experts import tokamax as backend

WITHOUT_TOKAMAX = """
import sys
sys.modules["tokamax"] = None  # import tokamax raises ImportError
import jax.numpy as jnp
from expertd.kernels import experts, moe
from expertd.kernels.moe_reference import family_config
import jax
cfg = family_config("mixtral", 4, 2, 16, 32)
params = moe.init_params(cfg, jax.random.key(0), jnp.float32)
out = moe.moe_layer(moe.prepare_params(params, cfg), jnp.ones((3, 16)), cfg)
assert out.shape == (3, 16) and not experts.tokamax.available()
try:
    moe.moe_layer(params, jnp.ones((3, 16)), cfg, backend="tokamax")
except experts.TokamaxMissing as exc:
    print("refused:", exc)
"""


def test_the_kernels_run_without_tokamax_and_name_the_extra_when_it_is_asked_for():
    run = subprocess.run([sys.executable, "-c", WITHOUT_TOKAMAX], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: the 'tokamax' expert backend needs the tokamax package: pip install 'expertd[tokamax]'" \
        in run.stdout


def test_missing_tokamax_raises_an_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokamax", None)
    xs, gs, w = jnp.zeros((2, 16)), jnp.asarray([2], jnp.int32), jnp.zeros((1, 16, 16))
    with pytest.raises(TokamaxMissing, match=r"expertd\[tokamax\]") as info:
        grouped_ffn(xs, gs, w, w, w, backend="tokamax")
    assert isinstance(info.value, ImportError)


def test_gpu_leaves_the_order_to_tokamax_and_cpu_asks_for_xla():
    assert backend.implementation_for("gpu") is None  # tokamax's default: mosaic, triton, xla, as imported
    assert backend.implementation_for("cpu") == ("xla",)
