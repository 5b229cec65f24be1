"""A lone Forward at an idle server, computed as its doorbell is read: no task, no queue.

``forward_now`` takes the checks of ``frontends.ExpertServicer._forward`` in its order (the header,
admission, the body: ``frontends.decode``), then ``Batcher.direct.forward_now`` computes the step
on the calling thread (the event loop's, where the channel reads doorbells), answers, then records
the step as the batcher records every step. Where the server is not idle, or the call asks for its routing or an
output region, or its body is one the loop would decode off the loop, it gives None: the call takes
the usual path (a task on the loop), from its header again.
"""
from __future__ import annotations

from collections.abc import Callable

from expertd.client import messages
from expertd.client.pb.v1 import expert_pb2
from expertd.server.batching import offload
from expertd.server.frontends import ExpertServicer, decode


def forward_now(servicer: ExpertServicer, message: expert_pb2.ForwardRequest, deadline: float | None,
                answer: Callable[[expert_pb2.ForwardResponse], None]) -> bool:
    """Compute ``message`` now and ``answer`` its response (before the step is recorded): True; or
    False, doing nothing (module docstring). The path's errors raise, after ``answer`` only where
    recording the step failed."""
    if message.return_routing or message.HasField("output_shared_memory"):
        return False
    header = decode.forward_header(message, servicer.model)
    servicer.batcher.check_admission(header, deadline)
    if header.body_elements >= offload.OFFLOAD_ELEMENTS:
        return False
    request = decode.decode_forward(message, servicer.model, deadline, servicer.shared_memory, header)

    def answer_output(output) -> None:
        answer(messages.forward_response(messages.ForwardResult(output, None), message.request_id))
    return servicer.batcher.direct.forward_now(request, answer_output)
