"""Client-side pieces that need no server: argument checks, typed errors, rich details, backoff."""
import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from expertd.client import (
    Backoff,
    ExpertClient,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    errors,
    messages,
)
from expertd.client.channel import auth_metadata


def test_route_needs_exactly_one_input():
    with pytest.raises(ValueError, match="exactly one of hidden_states"):
        messages.route_request(None, None, 0, None)
    with pytest.raises(ValueError, match="exactly one of hidden_states"):
        messages.route_request(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), 0, None)


@pytest.mark.parametrize("layer", [-1, 1.5, True, "0"])
def test_layer_must_be_a_non_negative_int(layer):
    with pytest.raises(ValueError, match="layer must be a non-negative int"):
        messages.forward_request(np.zeros((1, 4), np.float32), layer, False)


def test_inputs_must_be_two_dimensional():
    with pytest.raises(ValueError, match=r"x must be 2-D \[tokens, features\]"):
        messages.forward_request(np.zeros(4, np.float32), 0, False)


def test_unsupported_dtype_is_refused_before_sending():
    with ExpertClient("127.0.0.1:1") as client:
        with pytest.raises(ValueError, match="unsupported dtype float64"):
            client.forward(np.zeros((1, 4)), layer=0)


@pytest.mark.parametrize("code, cls", [(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
                                       (grpc.StatusCode.NOT_FOUND, NotFoundError),
                                       (grpc.StatusCode.UNAVAILABLE, UnavailableError),
                                       (5, NotFoundError)])
def test_error_for_maps_codes_to_typed_exceptions(code, cls):
    error = errors.error_for(code, "the server's words")
    assert isinstance(error, cls) and error.message == "the server's words"
    assert error.retryable == (cls is UnavailableError)


class _FakeCall(grpc.RpcError):
    """What grpc hands the client: a code, details and trailing metadata."""

    def __init__(self, code, details, trailing):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_rich_details_are_read_from_the_trailers():
    status = status_pb2.Status(code=8, message="full")
    for detail in (error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=1, nanos=500_000_000)),
                   error_details_pb2.BadRequest(field_violations=[
                       error_details_pb2.BadRequest.FieldViolation(field="hidden_states", description="bad")])):
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    call = _FakeCall(grpc.StatusCode.RESOURCE_EXHAUSTED, "full",
                     (("grpc-status-details-bin", status.SerializeToString()),))
    error = errors.from_rpc_error(call)
    assert isinstance(error, ResourceExhaustedError) and error.retryable
    assert error.retry_delay == 1.5 and error.field_violations == [("hidden_states", "bad")]


def test_backoff_grows_is_capped_and_respects_the_server_hint():
    backoff = Backoff(initial=0.1, maximum=0.3, multiplier=2.0)
    assert all(0 <= backoff.delay(0) <= 0.1 for _ in range(50))
    assert all(0 <= backoff.delay(5) <= 0.3 for _ in range(50))
    assert backoff.delay(0, server_hint=2.0) == 2.0


def test_auth_metadata():
    assert auth_metadata(None) == ()
    assert auth_metadata("abc") == (("authorization", "Bearer abc"),)
    with pytest.raises(ValueError, match="single-line"):
        auth_metadata("a\nb")


def test_unreachable_server_is_unavailable_after_the_retries():
    with ExpertClient("127.0.0.1:1", retries=2, timeout=2, backoff=Backoff(initial=0.01, maximum=0.01)) as client:
        with pytest.raises(UnavailableError):
            client.model_info()
        with pytest.raises(TimeoutError, match="not SERVING after 0.3s"):
            client.wait_ready(timeout=0.3)
