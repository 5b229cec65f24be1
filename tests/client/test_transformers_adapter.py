"""expertd.client.transformers: a transformers model's sparse-MoE blocks computed by an expert server.

Every family in FAMILIES (tiny random models, no server): the blocks are found at the modelling
code's MoE layers, the start check reads its expected layer from the config, and with each block's
computation handed to the original block through the adapter's own path (``offload_moe`` with a
client that runs the original blocks) greedy ``generate`` is unchanged, whatever the block returns.

On a real ``expertd serve --checkpoint`` on loopback (Mixtral; Qwen2-MoE with a shared expert;
DeepSeek-V3 with grouped sigmoid routing and a selection bias; Qwen3-MoE from a bf16 checkpoint):
greedy tokens are identical local and offloaded, with the expert weights kept or dropped or never
loaded; a model the server does not match is refused with every difference named. A bf16 model
talks bf16 on the wire to a bf16 server.
"""
import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

EXTRA = "the transformers adapter needs torch and transformers (pip install 'expertd[transformers]')"
torch = pytest.importorskip("torch", reason=EXTRA)
pytest.importorskip("transformers", reason=EXTRA)

import grpc  # noqa: E402 - after the skips above
import hf_models  # noqa: E402
from hf_models import TINY, H, build, expertd_serve, generate, prompts  # noqa: E402

from expertd.client import ExpertClient  # noqa: E402
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc  # noqa: E402
from expertd.client.transformers import (  # noqa: E402
    FAMILIES,
    ExpertsElsewhere,
    LayerMismatchError,
    RemoteMoeBlock,
    expected_layer,
    find_moe_blocks,
    from_wire,
    load_without_experts,
    offload_moe,
    to_wire,
)


class OriginalBlocks:
    """A client whose Forward runs the model's original blocks in-process (the adapter's whole path
    except the network): shows what the adapter does to a model, for every family."""

    target = "in-process"

    def __init__(self, model):
        self.blocks = {block.index: block.module for block in find_moe_blocks(model)}

    def forward(self, x, *, layer):
        out = self.blocks[layer](torch.from_numpy(np.array(x))[None])
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(x.shape).detach().numpy()


# ----------------------------------------------------------------------------- every family, no server

def test_the_adapter_and_the_pipeline_import_neither_jax_nor_the_server():
    code = ("import sys, expertd.client.transformers, expertd.client.pipeline; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax' or m.startswith('expertd.server')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_tiny_models_cover_every_family():
    assert sorted(family.model_type for family in FAMILIES.values()) == sorted(TINY)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_every_family_is_found_checked_and_generates_the_same_tokens(model_type):
    *_, moe_layers, (experts, topk, inter) = TINY[model_type]
    model = build(model_type)
    blocks = list(find_moe_blocks(model))
    assert [block.index for block in blocks] == moe_layers
    spec = expected_layer(blocks[0].family, model.config.get_text_config(), blocks[0].index)
    assert (spec.hidden_size, spec.num_experts, spec.topk, spec.intermediate_size) == (H, experts, topk, inter)
    ids = prompts()
    local = generate(model, ids)
    offload = offload_moe(model, OriginalBlocks(model), check=False)
    assert all(isinstance(block, RemoteMoeBlock) for block in offload.blocks.values())
    assert offload.layers == moe_layers
    assert torch.equal(generate(model, ids), local)


def test_router_logits_come_from_the_kept_router_or_are_refused_naming_the_layer():
    ids = prompts()
    model = build("mixtral")
    with torch.no_grad():
        local = model(ids, output_router_logits=True).router_logits
    offload_moe(model, OriginalBlocks(build("mixtral")), check=False)  # a twin: its routers record nothing
    with torch.no_grad():
        kept = model(ids, output_router_logits=True).router_logits
    assert len(kept) == len(local) == 2 and all(torch.equal(a, b) for a, b in zip(kept, local))

    dropped = build("mixtral")
    offload_moe(dropped, OriginalBlocks(dropped), keep_local=False, check=False)
    with torch.no_grad(), pytest.raises(RuntimeError, match="router logits were asked for .* layer 0"):
        dropped(ids, output_router_logits=True)


def test_bf16_goes_to_numpy_as_its_bits_and_back():
    x = torch.randn(5, H).to(torch.bfloat16)
    wire = to_wire(x)
    assert wire.dtype == ml_dtypes.bfloat16 and wire.nbytes == 5 * H * 2
    np.testing.assert_array_equal(wire.view(np.int16), x.view(torch.int16).numpy())
    back = from_wire(wire, like=x)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        to_wire(x.double())
    with pytest.raises(TypeError, match="answered float32 for a torch.bfloat16 request"):
        from_wire(np.zeros((5, H), np.float32), like=x)


def test_a_model_without_known_blocks_is_refused():
    with pytest.raises(ValueError, match="no sparse-MoE block of a known family"):
        offload_moe(torch.nn.Linear(2, 2), OriginalBlocks(build("mixtral")), check=False)


def test_loading_without_experts_allocates_no_moe_weight(tmp_path):
    model = build("deepseek_v3")
    model.save_pretrained(tmp_path)
    light = load_without_experts(tmp_path)
    blocks = list(find_moe_blocks(light))
    assert [block.index for block in blocks] == [1, 2]
    assert all(isinstance(block.module, ExpertsElsewhere) for block in blocks)
    moe_weights = sum(p.numel() for block in find_moe_blocks(model) for p in block.module.state_dict().values())
    assert sum(v.numel() for v in light.state_dict().values()) == \
        sum(v.numel() for v in model.state_dict().values()) - moe_weights
    with torch.no_grad(), pytest.raises(RuntimeError, match="loaded without its experts: call .*offload_moe"):
        light(prompts())


# ----------------------------------------------------------------------------- a real expertd serve

# (family, checkpoint dtype): served with --dtype float32 and run locally in float32, so the tokens
# must be identical; qwen3_moe's checkpoint holds bf16 weights.
SERVED = [("mixtral", "float32"), ("qwen2_moe", "float32"), ("deepseek_v3", "float32"), ("qwen3_moe", "bfloat16")]


def save_checkpoint(model_type: str, dtype: str, path):
    model = build(model_type, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    if model_type == "qwen3_moe":  # transformers 5 writes num_local_experts; older loaders read num_experts
        config = json.loads((path / "config.json").read_text())
        config.setdefault("num_experts", config["num_local_experts"])
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def from_checkpoint(path, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "expertd-jax-cache"


@pytest.fixture(scope="module", params=SERVED, ids=[case[0] for case in SERVED])
def served(request, tmp_path_factory, cache):
    model_type, dtype = request.param
    path = save_checkpoint(model_type, dtype, tmp_path_factory.mktemp(model_type))
    with expertd_serve(path, "float32", cache) as target:
        yield model_type, path, target


def test_greedy_tokens_are_identical_local_and_offloaded(served):
    model_type, path, target = served
    model = from_checkpoint(path)
    ids = prompts()
    local = generate(model, ids)
    with offload_moe(model, target) as offload:
        assert offload.layers == TINY[model_type][3]
        assert torch.equal(generate(model, ids), local)
        offload.restore()
    assert not any(isinstance(module, RemoteMoeBlock) for module in model.modules())
    assert torch.equal(generate(model, ids), local)
    # The MoE blocks decide tokens here: with them computing nothing, the tokens change.
    zeroed = from_checkpoint(path)
    for block in offload_moe(zeroed, OriginalBlocks(zeroed), check=False).blocks.values():
        block.expert_call = lambda x, *, layer: np.zeros_like(x)
    assert not torch.equal(generate(zeroed, ids), local)


def test_greedy_tokens_are_identical_through_the_native_forward_port(tmp_path, cache):
    """``expertd serve --native-port``: the adapter's GetModelInfo check and every Forward on that port."""
    from native_front_fixtures import require_native_front

    require_native_front()
    path = save_checkpoint("mixtral", "float32", tmp_path / "mixtral")
    model = from_checkpoint(path)
    ids = prompts()
    local = generate(model, ids)
    with expertd_serve(path, "float32", cache, native=True) as target, offload_moe(model, target) as offload:
        assert offload.layers == TINY["mixtral"][3]
        assert torch.equal(generate(model, ids), local)


def test_greedy_tokens_are_identical_over_the_same_host_channel(tmp_path, cache):
    """``expertd serve --shm-channel``: the adapter's GetModelInfo check and every Forward over ``shm://``."""
    path = save_checkpoint("qwen3_moe", "float32", tmp_path / "qwen3_moe")
    model = from_checkpoint(path)
    ids = prompts()
    local = generate(model, ids)
    channel = str(tmp_path / "adapter.sock")
    with expertd_serve(path, "float32", cache, shm_channel=channel) as target, offload_moe(model, target) as offload:
        assert target == f"shm://{channel}" and offload.layers == TINY["qwen3_moe"][3]
        assert torch.equal(generate(model, ids), local)


def test_with_keep_local_false_the_attention_side_holds_no_expert_weight(served):
    model_type, path, target = served
    model = from_checkpoint(path)
    ids = prompts(seed=1)
    local = generate(model, ids)
    paths = [block.path for block in find_moe_blocks(model)]
    with offload_moe(model, target, keep_local=False) as offload:
        for block in offload.blocks.values():
            assert not list(block.parameters()) and not list(block.buffers())
        assert not [key for key in model.state_dict() if any(key.startswith(p + ".") for p in paths)]
        assert torch.equal(generate(model, ids), local)
        with pytest.raises(RuntimeError, match="keep_local=False"):
            offload.restore()


def test_a_model_loaded_without_experts_gives_the_same_tokens(served):
    model_type, path, target = served
    ids = prompts(seed=2)
    local = generate(from_checkpoint(path), ids)
    model = load_without_experts(path, dtype=torch.float32)
    with offload_moe(model, target) as offload:
        assert all(block.local is None for block in offload.blocks.values())
        assert torch.equal(generate(model.eval(), ids), local)


def test_a_model_the_server_does_not_hold_is_refused_with_every_difference(served):
    model_type, path, target = served
    layers = hf_models.config(model_type).num_hidden_layers + 1
    other = build(model_type, num_experts_per_tok=1, num_hidden_layers=layers)
    moe_layers = [block.index for block in find_moe_blocks(other)]
    served_layers, extra = moe_layers[:-1], moe_layers[-1]
    with pytest.raises(LayerMismatchError) as caught:
        offload_moe(other, target)
    topk = TINY[model_type][4][1]
    assert caught.value.problems == [
        *(f"layer {i}: topk: model 1, server {topk}" for i in served_layers),
        f"layer {extra}: not served (the server holds layers {served_layers})"]
    assert not any(isinstance(block.module, RemoteMoeBlock) for block in find_moe_blocks(other))  # untouched


def test_a_model_routed_differently_from_the_server_is_refused_naming_how(served):
    model_type, path, target = served
    family = next(family for family in FAMILIES.values() if family.model_type == model_type)
    if not isinstance(family.normalised, str):
        pytest.skip(f"{model_type} always divides its k routing weights by their sum")
    normalised = bool(hf_models.config(model_type).norm_topk_prob)
    overrides = {"norm_topk_prob": not normalised}
    expected = [f"topk_normalised: model {not normalised}, server {normalised}"]
    if isinstance(family.scaling, str):
        overrides[family.scaling] = 1.5
        served_scaling = float(getattr(hf_models.config(model_type), family.scaling))
        expected.append(f"scaling_factor: model 1.5, server {served_scaling}")
    other = build(model_type, **overrides)
    with pytest.raises(LayerMismatchError) as caught:
        offload_moe(other, target)
    assert caught.value.problems == [f"layer {i}: {problem}" for i in TINY[model_type][3] for problem in expected]


# ----------------------------------------------------------------------------- bf16 end to end

class RequestRecorder(grpc.UnaryUnaryClientInterceptor):
    """Keeps every request message the client sends."""

    def __init__(self):
        self.requests = []

    def intercept_unary_unary(self, continuation, details, request):
        self.requests.append(request)
        return continuation(details, request)


def test_a_bf16_model_sends_bf16_and_gets_bf16_from_a_bf16_server(tmp_path, cache):
    path = save_checkpoint("qwen3_moe", "bfloat16", tmp_path)
    model = from_checkpoint(path, torch.bfloat16)
    reference = from_checkpoint(path, torch.float32)
    ids = prompts(batch=4, length=8)
    with torch.no_grad():
        local, exact = model(ids).logits.float(), reference(ids).logits
    with expertd_serve(path, "bfloat16", cache) as target, ExpertClient(target) as client:
        recorder = RequestRecorder()
        client._stub = expert_pb2_grpc.ExpertServiceStub(grpc.intercept_channel(client._channel, recorder))
        offload_moe(model, client)
        with torch.no_grad():
            remote = model(ids).logits
        assert generate(model, prompts()).shape == (2, 5 + 6)
    assert remote.dtype == torch.bfloat16
    forwards = [r for r in recorder.requests if isinstance(r, expert_pb2.ForwardRequest)]
    assert forwards and all(r.hidden_states.dtype == expert_pb2.DTYPE_BFLOAT16 for r in forwards)
    assert forwards[0].hidden_states.shape == [4 * 8, H] and len(forwards[0].hidden_states.data) == 4 * 8 * H * 2
    # bf16 on both sides, rounded at different places (transformers' block accumulates the weighted
    # experts in bf16, the server in fp32): both stay within bf16 error of the float32 model.
    remote = remote.float()
    scale = exact.abs().mean()
    assert (remote - exact).abs().mean() < 0.02 * scale and (local - exact).abs().mean() < 0.02 * scale
    assert (remote.argmax(-1) == local.argmax(-1)).float().mean() > 0.9
