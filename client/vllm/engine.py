"""A failed expertd call fails the vLLM step it happened in, not the engine.

vLLM's engine core treats any exception of a model step as fatal. ``EngineCore.step`` is wrapped:
when the step raises :class:`~expertd.client.vllm.session.ExpertdStepError` (the layer, the token
count and the server's message; from a worker in another process, vLLM's multiprocess executor
raises ``RuntimeError("Worker failed with error '<that message>', ...")``), the requests that step
scheduled are finished with finish reason ``"error"``, the message as their ``stop_reason``
(``LLM.generate`` shows it; the OpenAI server answers its usual internal-error response), and it is
logged. The engine then serves the next requests as usual; they work once the server answers
again. Any other exception is vLLM's, as before.

Not covered: the batch queue (``step_with_batch_queue``: pipeline parallel, or async scheduling,
which vLLM's GPU platforms turn on by default and its CPU platform off), where a failed call stays
fatal; run with ``--no-async-scheduling`` there.
"""
from __future__ import annotations

import logging
import re
from collections import defaultdict

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import RequestStatus

from expertd.client.vllm.session import STEP_ERROR_PREFIX, ExpertdStepError

logger = logging.getLogger("vllm.plugins.expertd")  # under vLLM's configured "vllm" logger
_INSTALLED = False


# How vLLM's multiprocess executor re-raises a worker's exception: its str() in this message.
_FROM_WORKER = re.compile(r"Worker failed with error '(" + re.escape(STEP_ERROR_PREFIX) + r".*)', please check",
                          re.DOTALL)


def step_failure(error: BaseException) -> str | None:
    """The expertd call's message when ``error`` is a failed expertd call (here or in a worker), else None."""
    if isinstance(error, ExpertdStepError):
        return str(error)
    match = _FROM_WORKER.search(str(error)) if isinstance(error, RuntimeError) else None
    return match.group(1) if match else None


def fail_step(engine: EngineCore, scheduler_output, message: str):
    """Finish the requests of a failed step with finish reason error; the step's return value."""
    scheduled = list(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
    logger.error("expertd: %s; failing the %d request(s) of this step", message, len(scheduled))
    finished = engine.scheduler.finish_requests(scheduled, RequestStatus.FINISHED_ERROR)
    by_client: dict[int, list[str]] = defaultdict(list)
    for request in finished:
        by_client[request.client_index].append(request.request_id)
    outputs = {
        client: EngineCoreOutputs(
            finished_requests=set(request_ids),
            outputs=[EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, stop_reason=message)
                     for request_id in request_ids])
        for client, request_ids in by_client.items()}
    return outputs, bool(scheduled)


def install() -> None:
    """Wrap ``EngineCore.step`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    step = EngineCore.step

    def expertd_step(self):
        scheduler = self.scheduler
        scheduled = []
        schedule = scheduler.schedule

        def capture(*args, **kwargs):
            output = schedule(*args, **kwargs)
            scheduled.append(output)
            return output

        scheduler.schedule = capture
        try:
            return step(self)
        except Exception as error:
            message = step_failure(error)
            if message is None or not scheduled:
                raise
            return fail_step(self, scheduled[-1], message)
        finally:
            del scheduler.schedule

    expertd_step.__wrapped__ = step
    EngineCore.step = expertd_step
    _INSTALLED = True
