"""Admission's shortcuts decide as its estimates would: when the bound with every step at its
slowest bucket's time admits a request, the full estimate admits it too (random queue states, step
times that do not grow with rows, gathering queues, deadlines)."""
import types

import numpy as np
import pytest

from expertd.server.batching.admission import Admission, Limits, StepTimes
from expertd.server.errors import Overloaded

BUCKETS = (1, 4, 16, 64)


def bucket_for(rows):
    return next(b for b in BUCKETS if b >= rows)


class EstimatesOnly(Admission):
    """The same decision without the shortcut."""

    def _surely_in_time(self, *args):
        return False


def admitted(admission, *args, **kwargs):
    try:
        admission.check(*args, **kwargs)
        return True
    except Overloaded:
        return False


@pytest.mark.parametrize("seed", range(4))
def test_the_slowest_step_bound_never_admits_what_the_estimates_refuse(seed):
    rng = np.random.default_rng(seed)
    limits = Limits(max_requests=10_000, max_tokens=10_000_000, max_wait_s=0.05, step_rows=64)
    shortcuts = taken = 0
    for _ in range(1000):
        times = StepTimes()
        for key in ("a", "b"):
            for bucket in BUCKETS:  # unordered on purpose: an EWMA per bucket need not grow with rows
                times.observe(key, bucket, float(rng.uniform(0.0005, 0.004)))
        queues = [types.SimpleNamespace(step_key=key, rows=int(rng.integers(0, 200)), small_rows=0,
                                        gather_until=float(rng.uniform(-0.01, 0.01))) for key in ("a", "b")]
        for q in queues:
            q.small_rows = int(rng.integers(0, q.rows + 1))
        queue, tokens = queues[int(rng.integers(0, 2))], int(rng.choice([1, 16, 40, 128]))
        deadline_in = None if rng.random() < 0.3 else float(rng.uniform(0.0, 0.2))
        args = (queue, tokens, deadline_in)
        kwargs = dict(queues=queues, running_s=float(rng.uniform(0, 0.004)), pending=1, queued_tokens=0, now=0.0)
        fast = Admission(limits, times, bucket_for)
        if fast._surely_in_time(queue, tokens, deadline_in, [q for q in queues if q.rows], kwargs["running_s"], 0.0):
            shortcuts += 1
            assert admitted(EstimatesOnly(limits, times, bucket_for), *args, **kwargs)
        taken += admitted(fast, *args, **kwargs) == admitted(EstimatesOnly(limits, times, bucket_for), *args, **kwargs)
    assert shortcuts > 100 and taken == 1000  # the shortcut is exercised, and both decide alike everywhere
