"""A lone Forward at an idle server, computed as its doorbell is read: no task, no queue.

``forward_now`` takes the checks of ``frontends.ExpertServicer._forward`` in its order (the header,
admission, the body: ``frontends.decode``), then ``Batcher.direct.forward_now`` computes the step
on the calling thread (the event loop's, where the channel reads doorbells) and records it as the
batcher records every step. Where the server is not idle, or the call asks for its routing or an
output region, or its body is one the loop would decode off the loop, it gives None: the call takes
the usual path (a task on the loop), from its header again.
"""
from __future__ import annotations

from expertd.client import messages
from expertd.client.pb.v1 import expert_pb2
from expertd.server.batching import offload
from expertd.server.frontends import ExpertServicer, decode


def forward_now(servicer: ExpertServicer, message: expert_pb2.ForwardRequest,
                deadline: float | None) -> expert_pb2.ForwardResponse | None:
    """The answer of ``message`` computed now, or None (module docstring); the path's errors raise."""
    if message.return_routing or message.HasField("output_shared_memory"):
        return None
    header = decode.forward_header(message, servicer.model)
    servicer.batcher.check_admission(header, deadline)
    if header.body_elements >= offload.OFFLOAD_ELEMENTS:
        return None
    request = decode.decode_forward(message, servicer.model, deadline, servicer.shared_memory, header)
    outputs = []
    if not servicer.batcher.direct.forward_now(request, outputs.append):
        return None
    return messages.forward_response(messages.ForwardResult(outputs[0], None), message.request_id)
