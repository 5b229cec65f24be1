"""Expert parallelism across processes: 2 processes x 2 CPU devices (jax.distributed, gloo) give the
same result as one process with 4 devices, with and without redundant experts (each process lays
out its own slots), and a missing peer ends in a bounded time."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_multiprocess import MODES, case, run_case, run_workers
from jax.sharding import AxisType

from expertd.kernels import moe

pytestmark = pytest.mark.multiprocess


def _failure(results):
    return "\n".join(f"worker rc={rc}:\n{err[-3000:]}" for rc, err in results)


def test_two_processes_match_one_process(tmp_path):
    cfg, params, x = case()
    np.savez(tmp_path / "inputs.npz", x=x, **params.to_dict())
    out = tmp_path / "result.npz"
    results = run_workers(tmp_path / "inputs.npz", out, timeout=150)
    assert all(rc == 0 for rc, _ in results), _failure(results)
    got = dict(np.load(out))
    assert got["num_global_devices"] == 4
    assert got["tokens_per_slot_eplb"].shape == (12,)  # 8 experts + 4 redundant slots

    mesh = jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    want = run_case(mesh, params.to_dict(), x)
    single = np.asarray(jax.jit(moe.moe_layer, static_argnames="cfg")(params, jnp.asarray(x), cfg))
    for mode in MODES:
        np.testing.assert_allclose(got[f"out_{mode}"], want[f"out_{mode}"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got[f"out_{mode}"], single, rtol=1e-5, atol=1e-5)
        for stat in ("tokens_per_expert", "tokens_per_slot", "dropped_pairs", "rows_received", "bytes_sent",
                     "min_rank_bytes"):
            np.testing.assert_array_equal(got[f"{stat}_{mode}"], want[f"{stat}_{mode}"])


def test_a_process_whose_peer_never_arrives_aborts_instead_of_hanging(tmp_path):
    (result,) = run_workers(tmp_path / "no-inputs.npz", tmp_path / "never.npz", start=[0], timeout=60,
                            initialization_timeout=2)
    returncode, err = result
    assert returncode is not None, "the lone worker hung until it was killed"
    assert returncode != 0, err[-2000:]
    assert not (tmp_path / "never.npz").exists()
