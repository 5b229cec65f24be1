"""This machine's rates, measured in the run that uses them: copy and read bandwidth (the memory
floors of moe_layer.py's (c) and (c')), a call timed in alternation with those probes (its floors
in its own minute) and the dense bf16 matmul rate (the GPU targets' unit)."""
from __future__ import annotations

import statistics

from harness.rounds import timed

PROBE_BYTES = 256 << 20


def copy_probes(nbytes: int = PROBE_BYTES) -> dict:
    """Zero-argument calls that each copy ``nbytes`` (read nbytes + write nbytes): numpy's copy and
    an XLA in-place add (donated: no fresh output pages)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    state = [jnp.ones(nbytes // 4, jnp.float32)]
    bump = jax.jit(lambda a: a + 1.0, donate_argnums=0)

    def xla_copy():
        state[0] = bump(state[0]).block_until_ready()
    return {"numpy copy": lambda: np.copyto(dst, src), "xla copy": xla_copy}


def read_probes(nbytes: int = PROBE_BYTES, blas: bool = True) -> dict:
    """Zero-argument calls that each read ``nbytes``: XLA's sum, XLA's and (with ``blas``) numpy's
    BLAS fp32 matrix-vector products."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from expertd.server.host import memory

    rows = nbytes // 4 // 4096
    host = np.ones((rows, 4096), np.float32)
    ones = np.ones(4096, np.float32)
    device = jnp.ones((rows, 4096), jnp.float32)
    memory.advise_huge_pages([device])  # like the weights (numpy's large arrays have them already)
    xla_sum, xla_matvec = jax.jit(jnp.sum), jax.jit(lambda a: a @ jnp.ones(4096, jnp.float32))
    probes = {"xla sum": lambda: xla_sum(device).block_until_ready(),
              "xla matvec": lambda: xla_matvec(device).block_until_ready()}
    return {"numpy matvec": lambda: host @ ones, **probes} if blas else probes


def fastest(probes: dict, reps: int) -> float:
    """The fastest call's seconds over ``reps`` calls of each probe (after one untimed call each:
    compiled, pages faulted in)."""
    for probe in probes.values():
        probe()
    return min(timed(probe) for probe in probes.values() for _ in range(reps))


def copy_bandwidth(nbytes: int = PROBE_BYTES) -> float:
    """Bytes moved per second (read + written) by the fastest of a numpy and an XLA copy."""
    return 2 * nbytes / fastest(copy_probes(nbytes), reps=5)


def read_bandwidth(nbytes: int = PROBE_BYTES) -> float:
    """Bytes read per second by the fastest of XLA's sum, XLA's and numpy's (BLAS) fp32
    matrix-vector product over ``nbytes``: the rate a weight-streaming layer can at best reach."""
    return nbytes / fastest(read_probes(nbytes), reps=7)


def paired_floors(layer_call, touched_bytes: int, rounds: int = 9, burst: int = 5) -> dict:
    """A layer call timed in rounds with the copy and read probes (moe_layer.py's short calls: T=16's
    target is a ratio to (c), and a shared machine's bandwidth drifts between minutes and within one).
    Each round times a burst of back-to-back layer calls, as a server runs them (the first call
    after a probe runs slower, so it is not counted), then
    each probe once. Returns the layer's median, (c) / (c') from the probes' fastest calls over all
    rounds, and the ratios the table reports: per round, the burst's median over that round's
    floors (its fastest copy / read probe), the median of those over the rounds, so that a layer
    call is only ever compared with the bandwidth of its own minute. Each round also records
    where its read floor lies in units of its copy floor ("read_floor_x_floor", = copy rate / read
    rate): the x (c) of a layer that reads its weights at the read probe's rate. Above 1.5 the
    T=16 target is out of reach in that round by (c)'s definition."""
    copies, reads = copy_probes(), read_probes(blas=False)  # BLAS's threads spin on after a call
    probes = {**copies, **reads}
    for probe in probes.values():
        probe()
    layer, probe_s = [], {name: [] for name in probes}
    by_round = {"x_floor": [], "x_read_floor": [], "read_floor_x_floor": []}
    for _ in range(rounds):
        layer_call()
        burst_s = [timed(layer_call) for _ in range(burst)]
        layer += burst_s
        for name, probe in probes.items():
            probe_s[name].append(timed(probe))
        copy_s, read_s = min(probe_s[n][-1] for n in copies), min(probe_s[n][-1] for n in reads)
        by_round["x_floor"].append(statistics.median(burst_s) / (touched_bytes * copy_s / (2 * PROBE_BYTES)))
        by_round["x_read_floor"].append(statistics.median(burst_s) / (touched_bytes * read_s / PROBE_BYTES))
        by_round["read_floor_x_floor"].append(2 * read_s / copy_s)
    copy_rate = 2 * PROBE_BYTES / min(min(probe_s[n]) for n in copies)
    read_rate = PROBE_BYTES / min(min(probe_s[n]) for n in reads)
    return {"auto": statistics.median(layer), "copy_bytes_per_s": copy_rate, "read_bytes_per_s": read_rate,
            "floor_s": touched_bytes / copy_rate, "read_floor_s": touched_bytes / read_rate,
            **{name: statistics.median(values) for name, values in by_round.items()},
            "rounds": {name: values for name, values in by_round.items()}}


def dense_matmul_rate(n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of one n x n x n bf16 matrix product on random data (median of ``reps`` after a
    warm-up): the device's dense matmul rate, which the GPU target at T=4096 is a fraction of."""
    import jax
    import jax.numpy as jnp

    a, b = (jax.random.normal(jax.random.key(s), (n, n), jnp.bfloat16) for s in (0, 1))
    product = jax.jit(jnp.matmul)
    product(a, b).block_until_ready()
    return 2 * n ** 3 / statistics.median(timed(lambda: product(a, b).block_until_ready()) for _ in range(reps))
