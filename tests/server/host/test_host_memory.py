"""Huge pages for CPU-resident weights: real madvise calls on real XLA buffers, checked in smaps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import moe
from expertd.server.engine.build import build_engine
from expertd.server.host import memory
from expertd.server.models.presets import LoadedLayer

MIB = 1 << 20
# What the dev VM and CI run: Linux 6.x with THP in "madvise" (or "always") mode.
CAN_COLLAPSE = memory.thp_setting() in ("always", "madvise") and memory.kernel_version() >= (6, 1)


@pytest.mark.parametrize("address, nbytes, expected", [
    (0, 4 * MIB, (0, 4 * MIB)),
    (64, 4 * MIB, (2 * MIB, 4 * MIB)),             # XLA's buffers start just past a page boundary
    (2 * MIB - 64, 2 * MIB + 128, (2 * MIB, 4 * MIB)),
    (64, 2 * MIB, None),                            # no whole huge page inside
    (3 * MIB, MIB, None),
])
def test_aligned_interior(address, nbytes, expected):
    assert memory.aligned_interior(address, nbytes) == expected


def test_cpu_buffer_ranges_cover_every_shard():
    a = jnp.zeros((256, 1024), jnp.float32)
    assert memory.cpu_buffer_ranges([a]) == [(a.unsafe_buffer_pointer(), a.nbytes)]
    assert memory.cpu_buffer_ranges([]) == []
    mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices()[:4])  # conftest: 8 simulated CPU devices
    split = jax.device_put(jnp.zeros((8, 1024), jnp.float32),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep")))
    ranges = memory.cpu_buffer_ranges([split])
    assert sorted(ranges) == sorted((s.data.unsafe_buffer_pointer(), 2 * 1024 * 4) for s in split.addressable_shards)
    assert len(set(ranges)) == 4


@pytest.mark.skipif(not CAN_COLLAPSE, reason="needs THP (always / madvise) and Linux 6.1+ (MADV_COLLAPSE)")
def test_weights_move_onto_huge_pages_with_their_values():
    w = jax.random.normal(jax.random.key(0), (4, 1024, 2048), jnp.float32)  # 32 MiB, one XLA buffer
    before = np.asarray(w).copy()
    report = memory.advise_huge_pages([w])
    assert report.reason is None
    start, end = memory.aligned_interior(w.unsafe_buffer_pointer(), w.nbytes)
    assert report.eligible_bytes == end - start >= 30 * MIB
    # all of it, unless the kernel found no free huge page for some (counted); smaps agrees there are some
    assert report.huge_bytes == report.eligible_bytes - report.collapse_errors * memory.HUGE_PAGE > 0
    assert memory.huge_page_bytes([(start, end)]) >= memory.HUGE_PAGE
    np.testing.assert_array_equal(np.asarray(w), before)
    np.testing.assert_array_equal(np.asarray(w * 2), before * 2)  # and XLA still computes on it


def test_collapse_counts_each_page_and_retries_a_failed_one_once():
    """The kernel's answer per 2 MiB page decides huge_bytes: here page 1 fails once (EAGAIN) and
    page 3 twice (no free huge page)."""
    calls = []

    def madvise(address, length, advice):
        assert length == memory.HUGE_PAGE and advice == memory.MADV_COLLAPSE
        calls.append(page := address // memory.HUGE_PAGE)
        return -1 if page == 3 or (page == 1 and calls.count(1) == 1) else 0

    ranges = [(0, 2 * memory.HUGE_PAGE), (3 * memory.HUGE_PAGE, 5 * memory.HUGE_PAGE)]
    assert memory.collapse_pages(madvise, ranges) == 1
    assert calls == [0, 1, 3, 4, 1, 3]


def test_small_buffers_are_left_alone_with_a_reason():
    report = memory.advise_huge_pages([jnp.ones((16, 16))])
    assert report.eligible_bytes == report.huge_bytes == 0 and report.reason


def test_engine_reports_its_weights_on_huge_pages():
    cfg = moe.MoEConfig(num_experts=4, topk=2, hidden_size=512, intermediate_size=1024)  # 8 MiB per expert matrix
    params = {name: np.asarray(v) for name, v in moe.init_params(cfg, jax.random.key(0), jnp.float32).items()}
    layer = LoadedLayer(index=0, cfg=cfg, params=params, source="test")
    info = build_engine([layer], buckets=(8,), dtype="float32", devices=1).info()["huge_pages"]
    assert info["eligible_bytes"] >= 3 * 6 * MIB  # w_gate, w_up, w_down: 8 MiB each, 6+ in whole pages
    if CAN_COLLAPSE:
        assert info["reason"] is None
        assert info["huge_bytes"] == info["eligible_bytes"] - info["collapse_errors"] * memory.HUGE_PAGE > 0
    assert build_engine([layer], buckets=(8,), dtype="float32", devices=1,
                        huge_pages=False).info()["huge_pages"] is None


def test_without_thp_nothing_is_advised_and_the_report_says_why(monkeypatch):
    monkeypatch.setattr(memory, "thp_setting", lambda: "never")
    w = jnp.ones((2, 1024, 1024), jnp.float32)  # 8 MiB: 3-4 whole huge pages
    report = memory.advise_huge_pages([w])
    assert report.eligible_bytes >= 6 * MIB and report.huge_bytes == 0
    assert report.reason == "transparent huge pages are never on this system"
