"""A failed expertd call fails the vLLM step it happened in, not the engine.

vLLM's engine core treats any exception of a model step as fatal. ``EngineCore.step`` is wrapped:
when the step raises :class:`~expertd.client.vllm.session.ExpertdStepError` (the layer, the token
count and the server's message), the requests that step scheduled are finished with finish reason
``"error"``, the message as their ``stop_reason`` (``LLM.generate`` shows it; the OpenAI server
answers its usual internal-error response), and it is logged. The engine then serves the next
requests as usual; they work once the server answers again. Any other exception is vLLM's, as before.
"""
from __future__ import annotations

import logging
from collections import defaultdict

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import RequestStatus

from expertd.client.vllm.session import ExpertdStepError

logger = logging.getLogger("vllm.plugins.expertd")  # under vLLM's configured "vllm" logger
_INSTALLED = False


def fail_step(engine: EngineCore, scheduler_output, error: ExpertdStepError):
    """Finish the requests of a failed step with finish reason error; the step's return value."""
    scheduled = list(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
    logger.error("expertd: %s; failing the %d request(s) of this step", error, len(scheduled))
    finished = engine.scheduler.finish_requests(scheduled, RequestStatus.FINISHED_ERROR)
    by_client: dict[int, list[str]] = defaultdict(list)
    for request in finished:
        by_client[request.client_index].append(request.request_id)
    outputs = {
        client: EngineCoreOutputs(
            finished_requests=set(request_ids),
            outputs=[EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, stop_reason=str(error))
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
        except ExpertdStepError as error:
            if not scheduled:
                raise
            return fail_step(self, scheduled[-1], error)
        finally:
            del scheduler.schedule

    expertd_step.__wrapped__ = step
    EngineCore.step = expertd_step
    _INSTALLED = True
