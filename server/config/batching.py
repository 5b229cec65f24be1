"""The ``[batching]`` section: token buckets, queue bounds, delays and request limits."""
from __future__ import annotations

import dataclasses

from expertd.server.config.fields import (
    int_list,
    option,
)


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    bucket_sizes: tuple[int, ...] = option((1, 4, 16, 64, 256), "token buckets compiled at start-up; a batch is "
                                           "padded to the smallest bucket that fits", parse=int_list, metavar="LIST")
    max_batch_tokens: int | None = option(None, "tokens merged into one step at most (default: the largest bucket)",
                                          parse=int, metavar="N")
    max_queue_delay_ms: float = option(2.0, "how long a batch that would be padded waits for more requests "
                                       "(counted from its first request's arrival or the previous step's end; "
                                       "batches that fill a bucket start at once)", parse=float, metavar="MS")
    max_queue_size: int = option(1024, "requests waiting or computing at most, a hard cap; more get "
                                 "RESOURCE_EXHAUSTED (the token and wait bounds normally refuse first)",
                                 parse=int, metavar="N")
    max_queue_tokens: int | None = option(None, "tokens queued (accepted, not yet computed) at most, over all "
                                          "layers; more get RESOURCE_EXHAUSTED (default: 8 x --max-request-tokens)",
                                          parse=int, metavar="N")
    max_queue_wait_ms: float = option(1000.0, "expected wait (the queued work ahead at the measured step times) "
                                      "at most; a request expected to wait longer, or to finish after its "
                                      "deadline, gets RESOURCE_EXHAUSTED at once", parse=float, metavar="MS")
    inline_step_max_ms: float = option(1.0, "a request that finds the server idle (nothing else admitted, the "
                                       "device thread free) runs its step on the event loop, without the hand-over "
                                       "to the device thread, when it is expected to take at most this long; 0: "
                                       "always hand over", parse=float, metavar="MS")
    small_step_slack: float = option(1.25, "a step carrying small requests (at most half a step) takes others' "
                                     "rows only while its fastest time stays within this factor of theirs "
                                     "alone; 0: always fill the step", parse=float, metavar="X")
    max_request_tokens: int = option(8192, "tokens one request may carry (larger requests are split into batches "
                                     "of at most the largest bucket); sizes the gRPC message limit", parse=int,
                                     metavar="N")
    expert_load_window_s: float = option(60.0, "recent window of GetExpertLoad and the load-imbalance gauge",
                                         parse=float, metavar="SECONDS")

    def __post_init__(self):
        buckets = self.bucket_sizes
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"--bucket-sizes must be ascending unique integers >= 1, got {list(buckets)}")
        if self.max_batch_tokens is not None and not 1 <= self.max_batch_tokens <= buckets[-1]:
            raise ValueError(f"--max-batch-tokens must be between 1 and the largest bucket {buckets[-1]}, "
                             f"got {self.max_batch_tokens}")
        for flag, value, ok, expected in (
                ("--max-queue-delay-ms", self.max_queue_delay_ms, self.max_queue_delay_ms >= 0, ">= 0"),
                ("--max-queue-size", self.max_queue_size, self.max_queue_size >= 1, ">= 1"),
                ("--max-request-tokens", self.max_request_tokens, self.max_request_tokens >= 1, ">= 1"),
                ("--max-queue-wait-ms", self.max_queue_wait_ms, self.max_queue_wait_ms > 0, "> 0"),
                ("--inline-step-max-ms", self.inline_step_max_ms, self.inline_step_max_ms >= 0, ">= 0"),
                ("--small-step-slack", self.small_step_slack, self.small_step_slack == 0 or self.small_step_slack >= 1,
                 ">= 1, or 0 to always fill steps"),
                ("--expert-load-window-s", self.expert_load_window_s, self.expert_load_window_s > 0, "> 0")):
            if not ok:  # NaN fails every comparison, so it is refused too
                raise ValueError(f"{flag} must be {expected}, got {value}")
        if self.max_queue_tokens is not None and self.max_queue_tokens < self.max_request_tokens:
            raise ValueError(f"--max-queue-tokens must be >= --max-request-tokens {self.max_request_tokens} (or "
                             f"the largest request could never be queued), got {self.max_queue_tokens}")

    @property
    def queue_tokens(self) -> int:
        """Tokens queued at most (--max-queue-tokens, default 8 x --max-request-tokens)."""
        return self.max_queue_tokens or 8 * self.max_request_tokens

    @property
    def batch_tokens(self) -> int:
        """Rows merged into one engine step at most (the largest bucket unless --max-batch-tokens is lower)."""
        return self.max_batch_tokens or self.bucket_sizes[-1]
