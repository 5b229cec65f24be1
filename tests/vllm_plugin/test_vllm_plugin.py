"""expertd.client.vllm: a vLLM engine's MoE layers on a real ``expertd serve --checkpoint``.

Needs vLLM (``vllm-cpu`` 0.32 here), which pins transformers below the dev extra's floor: ``make
test`` runs this file in its own environment, .venv-vllm; in the main one it is skipped. Engines run
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one after another, on tiny random checkpoints
written by transformers (tests/client/hf_models.py) with the head sizes vLLM's CPU attention has
kernels for. Greedy tokens with the plugin equal vLLM's own for Qwen2-MoE (shared expert, float32),
DeepSeek-V3 (grouped sigmoid routing with a selection bias, a shared expert, MLA attention on
CPU_MLA) and Qwen3-MoE in bfloat16; the plugin's engine holds no routed-expert weights; a server
holding another model is refused with the layer and field named; a server that goes away fails
that step's requests with its message and the engine serves again once it is back; vLLM's OpenAI
server (its engine and worker in processes of their own, as ``vllm serve`` runs them) answers
/v1/completions with the same tokens, and a failed call there is one failed request.
"""
import contextlib
import gc
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in this process: a fraction of the start-up
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
vllm = pytest.importorskip("vllm", reason="the vLLM plugin's tests need vLLM (make test runs this file in .venv-vllm)")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "client"))
import hf_models  # noqa: E402 - after the path above
from vllm.inputs import TokensPrompt  # noqa: E402

from expertd.client.transformers import LayerMismatchError  # noqa: E402

# family -> (hf_models overrides for vLLM's CPU kernels, dtype, engine arguments)
FAMILIES = {
    # vLLM's Qwen2-MoE takes its head size as H / heads
    "qwen2_moe": (dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32), torch.float32, {}),
    # CPU_MLA has a kernel for DeepSeek's latent cache size only (kv_lora_rank 512 + rope 64) and is
    # deterministic run to run (the default AMX MLA is not). topk_method and scoring_func as DeepSeek-V3's
    # own config.json has them: transformers' config omits them, and vLLM then routes by softmax without
    # the bias, not as the model (and the server) does.
    "deepseek_v3": (dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, head_dim=64,
                         topk_method="noaux_tc", scoring_func="sigmoid"), torch.float32,
                    {"attention_backend": "CPU_MLA"}),
    "qwen3_moe": (dict(head_dim=32), torch.bfloat16, {}),
}
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [7, 8, 9], [100, 3, 64, 12, 12, 30, 77, 1, 19, 55, 23]]
NEW_TOKENS = 8


def save(model_type: str, path: pathlib.Path, **overrides) -> pathlib.Path:
    arguments, dtype, _ = FAMILIES[model_type]
    hf_models.build(model_type, dtype=dtype, **{**arguments, **overrides}).save_pretrained(path)
    return path


def engine(model_type: str, path, target: str | None = None, timeout: float = 30.0):
    _, dtype, extra = FAMILIES[model_type]
    if target is not None:
        extra = {**extra, "additional_config": {"expertd": {"target": target, "timeout": timeout}}}
    return vllm.LLM(model=str(path), enforce_eager=True, max_model_len=128, skip_tokenizer_init=True,
                    dtype=dtype, gpu_memory_utilization=0.15, seed=0, **extra)


def generate(llm) -> list:
    """(token ids, finish reason, stop reason) of each prompt, greedy."""
    params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in PROMPTS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outputs]


def refusal(model_type: str, path, target: str, timeout: float = 30.0) -> Exception:
    """The exception an engine's start raises, its tracebacks dropped: their frames hold the
    half-built engine, whose late shutdown would tear down the next engine's process groups."""
    try:
        engine(model_type, path, target, timeout)
    except Exception as error:  # noqa: BLE001 - returned to the test
        refused = error
    else:
        pytest.fail(f"the engine started with the expertd target {target}")
    cause = refused
    while cause is not None:
        cause.__traceback__ = None
        cause = cause.__cause__ or cause.__context__
    gc.collect()
    return refused


def expert_weights(llm) -> list[str]:
    """The names of the engine's routed-expert parameters (vLLM's w13 / w2 tensors)."""
    return llm.apply_model(lambda model: [name for name, _ in model.named_parameters()
                                          if name.endswith(("w13_weight", "w2_weight"))])[0]


def run(model_type: str, path, target: str | None = None) -> tuple[list, list[str]]:
    """Greedy outputs and routed-expert parameter names of a fresh engine, which is gone on return
    (a second engine in this process must not outlive its successor's start: its shutdown tears
    down vLLM's process-wide groups)."""
    llm = engine(model_type, path, target)
    try:
        return generate(llm), expert_weights(llm)
    finally:
        del llm
        gc.collect()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax-cache")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_greedy_tokens_on_expertd_equal_vllms_own(model_type, tmp_path, cache):
    path = save(model_type, tmp_path / model_type)
    local, weights = run(model_type, path)
    assert weights  # vLLM's own layers hold the routed experts
    with hf_models.expertd_serve(path, str(FAMILIES[model_type][1]).removeprefix("torch."), cache) as target:
        remote, weights = run(model_type, path, target)
    assert weights == []
    assert remote == local
    assert all(len(tokens) == NEW_TOKENS and reason == "length" for tokens, reason, _ in local)


def test_greedy_tokens_are_the_same_over_the_same_host_channel(tmp_path, cache):
    """``EXPERTD_VLLM_TARGET=shm://...``: the plugin's GetModelInfo check and every MoE layer's call
    over the server's same-host channel."""
    model_type = sorted(FAMILIES)[0]
    path = save(model_type, tmp_path / model_type)
    local, _ = run(model_type, path)
    channel = str(tmp_path / "vllm.sock")
    with hf_models.expertd_serve(path, str(FAMILIES[model_type][1]).removeprefix("torch."), cache,
                                 shm_channel=channel) as target:
        assert target == f"shm://{channel}"
        remote, weights = run(model_type, path, target)
    assert weights == [] and remote == local


def test_a_server_holding_another_model_is_refused_naming_layer_and_field(tmp_path, cache):
    served = save("qwen3_moe", tmp_path / "served")
    other = save("qwen3_moe", tmp_path / "other", num_experts_per_tok=1)
    with hf_models.expertd_serve(served, "bfloat16", cache) as target:
        refused = refusal("qwen3_moe", other, target)
    assert isinstance(refused, LayerMismatchError)
    assert refused.problems == ["layer 0: topk: model 1, server 2", "layer 1: topk: model 1, server 2"]
    assert f"expert server {target} does not serve this model's MoE layers" in str(refused)


def test_an_unreachable_server_refuses_the_engine_at_start(tmp_path):
    path = save("qwen3_moe", tmp_path / "model")
    target = f"127.0.0.1:{free_port()}"
    refused = refusal("qwen3_moe", path, target, timeout=2.0)
    assert isinstance(refused, RuntimeError)
    assert str(refused).startswith(f"expertd vLLM plugin: cannot read the expert server's layers at {target} "
                                   "(additional_config expertd.target): UNAVAILABLE")


def test_a_failed_call_fails_the_step_and_the_engine_serves_once_the_server_is_back(tmp_path, cache):
    path = save("qwen3_moe", tmp_path / "model")
    port = free_port()
    with hf_models.expertd_serve(path, "bfloat16", cache, port=port) as target:
        llm = engine("qwen3_moe", path, target, timeout=5.0)
        before = generate(llm)
    failed = generate(llm)  # the server is gone
    assert [(tokens, reason) for tokens, reason, _ in failed] == [([], "error")] * len(PROMPTS)
    assert all("expertd Forward of layer 0" in stop and f"at {target} failed: UNAVAILABLE" in stop
               for _, _, stop in failed)
    with hf_models.expertd_serve(path, "bfloat16", cache, port=port):
        after = generate(llm)
    del llm
    gc.collect()
    assert after == before


# ----------------------------------------------------------------------------- vLLM's OpenAI server

def save_tokenizer(path: pathlib.Path) -> None:
    """A word-level tokenizer of the tiny vocabulary ("<unk>", "<s>", "</s>", "t3" ... "t127")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, hf_models.BASE["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


@contextlib.contextmanager
def openai_server(path, target: str, log: pathlib.Path, ready_timeout: float = 600.0):
    """vLLM's OpenAI server (``vllm serve``'s server; vllm-cpu 0.32.0's ``vllm`` command fails its own
    version lookup, so its module runs it) in its own processes, with EXPERTD_VLLM_TARGET."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host",
               "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", "128", "--dtype", "bfloat16",
               "--gpu-memory-utilization", "0.15", "--seed", "0"]
    env = {**os.environ, "EXPERTD_VLLM_TARGET": target}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # as vllm serve runs: engine core and worker in processes
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while post(f"{url}/health")[0] != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's OpenAI server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def post(url: str, body: dict | None = None) -> tuple[int, dict | None]:
    """(HTTP status, JSON answer); GET without a body. Status 0: no answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")
    except OSError:
        return 0, None


def test_vllm_serve_answers_completions_and_survives_a_failed_call(tmp_path, cache):
    path = save("qwen3_moe", tmp_path / "model")
    save_tokenizer(path)
    port = free_port()
    expert_side = hf_models.expertd_serve(path, "bfloat16", cache, port=port)
    target = expert_side.__enter__()
    try:
        expected = run("qwen3_moe", path, target)[0][0][0]
        with openai_server(path, target, tmp_path / "vllm.log") as url:
            def complete():
                return post(f"{url}/v1/completions", {"model": str(path), "prompt": PROMPTS[0], "temperature": 0,
                                                      "max_tokens": NEW_TOKENS, "ignore_eos": True,
                                                      "return_token_ids": True})

            status, answer = complete()
            assert status == 200, answer
            assert answer["choices"][0]["token_ids"] == expected
            assert answer["choices"][0]["text"].split() == [f"t{i}" for i in expected if i > 2]
            log = (tmp_path / "vllm.log").read_text()
            assert f"expertd: MoE layers [0, 1] of this qwen3_moe model run on the expert server at {target}" in log

            expert_side.__exit__(None, None, None)
            expert_side = None
            status, answer = complete()  # the expert server is gone: this request fails, the engine lives
            assert status == 500, answer
            assert post(f"{url}/health")[0] == 200
            assert "expertd Forward of layer 0" in (tmp_path / "vllm.log").read_text()
            with hf_models.expertd_serve(path, "bfloat16", cache, port=port):
                status, answer = complete()
            assert status == 200, answer
            assert answer["choices"][0]["token_ids"] == expected
    finally:
        if expert_side is not None:
            expert_side.__exit__(None, None, None)
