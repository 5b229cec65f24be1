"""A Forward is decoded and validated once and its tokens change dtype at most twice: once in
(wire -> engine dtype, none when they are equal) and once out (engine -> the caller's dtype).

Observed on the real path: a real server on loopback and the real clients (expertd.v1 and
tritonclient), with every dtype change counted at ``expertd.server.engine.api.cast`` (the one seam
the serving path changes a token array's dtype through), the arrays the engine is handed recorded
(``create_server``'s step runner), and the serving modules' source checked for any other
``.astype``. Adding a third cast, or one outside the seam, fails a test here.
"""
from __future__ import annotations

import ast
import pathlib

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as triton
from service_support import server_with_runner

from expertd.client import ExpertClient, codec
from expertd.client.pb.v1 import expert_pb2
from expertd.server.engine import api
from expertd.server.engine.description import MeshDescription, ModelDescription
from expertd.server.errors import InvalidRequest, UnknownLayerError
from expertd.server.frontends import decode
from expertd.server.models.presets import load_preset

H, E = 64, 8
BF16, FP16, FP32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
SERVING_MODULES = ("frontends/decode", "frontends/kserve_decode", "frontends/shared_memory", "frontends/expert_v1",
                   "frontends/kserve", "batching/batcher", "batching/device_steps", "batching/results",
                   "engine/api", "engine/engine", "engine/description", "errors")


class Recording:
    """The server's step runner: the real engine, recording the token arrays each step is handed."""

    def __init__(self, engine):
        self.engine, self.tokens = engine, []

    def forward(self, layer, tokens, num_valid, **options):
        self.tokens.append(tokens)
        return self.engine.forward(layer, tokens, num_valid, **options)

    def route(self, layer, tokens, num_valid, **options):
        self.tokens.append(tokens)
        return self.engine.route(layer, tokens, num_valid, **options)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with server_with_runner(tmp_path_factory, Recording, max_queue_delay_ms=0.0) as handle:  # fp32 tiny, buckets 1, 8
        handle.recording = handle.runner
        yield handle


@pytest.fixture
def casts(monkeypatch):
    """Every call of the seam: (dtype in, dtype asked for)."""
    calls = []
    real = api.cast

    def counting(array, dtype):
        calls.append((array.dtype, np.dtype(dtype)))
        return real(array, dtype)

    monkeypatch.setattr(api, "cast", counting)
    return calls


def _changes(calls):
    return [(a, b) for a, b in calls if a != b]


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16])
def test_forward_casts_in_once_and_out_once(server, casts, dtype):
    x = np.random.default_rng(0).standard_normal((1, H)).astype(dtype)  # 1 row: bucket 1, nothing to pad
    server.recording.tokens.clear()
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        y = client.forward(x, layer=0)
    assert y.dtype == dtype
    (handed,) = server.recording.tokens
    assert handed.dtype == FP32  # the engine's dtype, as decoded
    assert casts == [(dtype, FP32), (FP32, dtype)]  # in, out: the seam is called twice, no more
    assert len(_changes(casts)) == (0 if dtype == FP32 else 2)
    if dtype == FP32:  # no cast, no copy: the engine reads the request's own bytes
        assert not handed.flags.owndata and not handed.flags.writeable


def test_merged_and_split_requests_still_cast_once_each_way(server, casts):
    x = np.random.default_rng(1).standard_normal((13, H)).astype(BF16)  # 13 rows: parts of 8 and 5
    server.recording.tokens.clear()
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        y = client.forward(x, layer=1)
    assert y.dtype == BF16 and y.shape == (13, H)
    assert [t.shape for t in server.recording.tokens] == [(8, H), (8, H)]  # the 5-row part padded to 8
    assert all(t.dtype == FP32 for t in server.recording.tokens)
    assert casts == [(BF16, FP32), (FP32, BF16)]


def test_kserve_infer_casts_in_once_and_out_once(server, casts):
    x = np.random.default_rng(2).standard_normal((3, H)).astype(BF16)
    client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        tensor = triton.InferInput("hidden_states", list(x.shape), "BF16")
        tensor.set_data_from_numpy(x)
        result = client.infer("moe-layer-0", [tensor])
    finally:
        client.close()
    assert result.as_numpy("output").dtype == BF16
    assert casts == [(BF16, FP32), (FP32, BF16)]


def test_route_casts_its_input_once(server, casts):
    x = np.random.default_rng(3).standard_normal((2, H)).astype(BF16)
    logits = np.random.default_rng(4).standard_normal((2, E)).astype(FP16)
    with ExpertClient(f"127.0.0.1:{server.port}", timeout=60) as client:
        client.route(x, layer=0)
        client.route(layer=0, logits=logits)
    assert casts == [(BF16, FP32), (FP16, FP32)]  # routing answers ids and weights: nothing to cast back


def test_serving_modules_change_dtypes_only_through_the_seam():
    root = pathlib.Path(decode.__file__).parents[1]
    found = []
    for name in SERVING_MODULES:
        tree = ast.parse((root / f"{name}.py").read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and node.attr == "astype" and (name, function.name) != (
                        "engine/api", "cast"):
                    found.append(f"{name}.py:{node.lineno} in {function.name}")
    assert not found, "a token array's dtype changes only in api.cast"


# ---------------------------------------------------------------------- decoding, without a server

MODEL = ModelDescription(name="tiny", layers={layer.index: layer.cfg for layer in load_preset("tiny")},
                         dtype=BF16, buckets=(1, 8), max_request_tokens=16, max_batch_tokens=8,
                         mesh=MeshDescription("ep", 1, "cpu"))


def _message(x, layer=0):
    return expert_pb2.ForwardRequest(layer=layer, hidden_states=codec.encode(x))


def test_decoded_requests_are_in_the_engine_dtype_and_remember_the_callers():
    x = np.random.default_rng(5).standard_normal((3, H)).astype(np.float32)
    request = decode.decode_forward(_message(x), MODEL, deadline=12.5)
    assert (request.layer, request.tokens.dtype, request.out_dtype, request.deadline) == (0, BF16, FP32, 12.5)
    np.testing.assert_array_equal(request.tokens, x.astype(BF16))
    same = decode.decode_forward(_message(x.astype(BF16)), MODEL, deadline=None)
    assert not same.tokens.flags.owndata  # the message's bytes, not a copy


@pytest.mark.parametrize("x, layer, error, match", [
    (np.zeros((2, H), np.float32), 5, UnknownLayerError, r"layer 5 is not served; layers: \[0, 1\]"),
    (np.zeros((2, 32), np.float32), 0, InvalidRequest, r"hidden_states.shape: expected \[T, H=64\], got \[2, 32\]"),
    (np.zeros((17, H), np.float32), 0, InvalidRequest, r"expected 1 <= T <= 16 tokens"),
    (np.zeros((0, H), np.float32), 0, InvalidRequest, r"expected 1 <= T <= 16 tokens"),
    (np.zeros((2, H), np.int32), 0, InvalidRequest, r"hidden_states.dtype: expected one of"),
    (np.full((2, H), np.nan, np.float32), 0, InvalidRequest, r"contains NaN or Inf \(first at token 0\)"),
])
def test_bad_forward_requests_name_the_field(x, layer, error, match):
    with pytest.raises(error, match=match):
        decode.decode_forward(_message(x, layer), MODEL, deadline=None)


def test_bad_route_requests_name_the_field():
    message = expert_pb2.RouteRequest(layer=0)
    with pytest.raises(InvalidRequest, match="input: set hidden_states"):
        decode.decode_route(message, MODEL, 0.01, None)
    message.logits.CopyFrom(codec.encode(np.zeros((2, E - 1), np.float32)))
    with pytest.raises(InvalidRequest, match=r"logits.shape: expected \[T, E=8\]"):
        decode.decode_route(message, MODEL, 0.01, None)
    message.logits.CopyFrom(codec.encode(np.zeros((2, E), np.float16)))
    message.aux_loss_coeff = float("inf")
    with pytest.raises(InvalidRequest, match="aux_loss_coeff: must be finite"):
        decode.decode_route(message, MODEL, 0.01, None)
    message.ClearField("aux_loss_coeff")
    decoded = decode.decode_route(message, MODEL, 0.01, None)
    assert decoded.from_logits and decoded.tokens.dtype == FP32 and decoded.aux_loss_coeff == 0.01


def test_the_description_picks_buckets_and_sizes_messages():
    assert [MODEL.bucket_for(n) for n in (1, 2, 8)] == [1, 8, 8]
    with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
        MODEL.bucket_for(9)
    assert list(MODEL.layers) == [0, 1] and MODEL.layer(1).score_function == "sigmoid"
    with pytest.raises(TypeError):
        MODEL.layers[2] = MODEL.layer(0)  # read-only
    assert MODEL.max_message_bytes() == 16 * (4 * H + 8 * 2) + (1 << 20)
