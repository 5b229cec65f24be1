"""expertd.client.vllm without vLLM: where the layers go, and the refusal when the plugin cannot load.

The plugin's engines are tested in tests/vllm_plugin (their own environment); here, in any
environment: the target's settings and their errors, and ``register()`` where vLLM is absent:
with EXPERTD_VLLM_TARGET set it refuses naming the setting, without it vLLM is left alone.
"""
import importlib.util
import subprocess
import sys

import pytest

from expertd.client.vllm.target import DEFAULT_TIMEOUT_S, ENV_TARGET, ENV_TIMEOUT, Target, configured_target


@pytest.fixture(autouse=True)
def no_target_in_env(monkeypatch):
    monkeypatch.delenv(ENV_TARGET, raising=False)
    monkeypatch.delenv(ENV_TIMEOUT, raising=False)


def test_no_target_anywhere_means_vllm_runs_its_own_layers():
    assert configured_target(None) is None
    assert configured_target({}) is None
    assert configured_target({"other_plugin": {"x": 1}}) is None


def test_the_target_comes_from_additional_config_or_the_environment(monkeypatch):
    assert configured_target({"expertd": {"target": "h:1", "timeout": 5}}) == Target(
        "h:1", 5.0, "additional_config expertd.target")
    monkeypatch.setenv(ENV_TARGET, " h1:1,h2:1 ")
    assert configured_target({}) == Target("h1:1,h2:1", DEFAULT_TIMEOUT_S, ENV_TARGET)
    assert configured_target({"expertd": {"target": "h1:1,h2:1"}}).source == "additional_config expertd.target"
    monkeypatch.setenv(ENV_TIMEOUT, "2.5")
    assert configured_target(None).timeout_s == 2.5


@pytest.mark.parametrize(("config", "message"), [
    ({"expertd": "h:1"}, "additional_config expertd must be an object"),
    ({"expertd": {"target": ""}}, "expertd.target must be a non-empty string, got ''"),
    ({"expertd": {"target": 8001}}, "expertd.target must be a non-empty string, got 8001"),
    ({"expertd": {"target": "h:1", "timeout": 0}}, "must be a positive number of seconds, got 0"),
    ({"expertd": {"target": "h:1", "timeout": "soon"}}, "must be a positive number of seconds, got 'soon'"),
    ({"expertd": {"target": "h:1", "tiemout": 3}}, r"unknown keys \['tiemout'\]"),
])
def test_malformed_settings_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        configured_target(config)


def test_two_different_targets_are_refused(monkeypatch):
    monkeypatch.setenv(ENV_TARGET, "a:1")
    with pytest.raises(ValueError, match="EXPERTD_VLLM_TARGET='a:1' and additional_config expertd.target='b:1'"):
        configured_target({"expertd": {"target": "b:1"}})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_a_set_target_refuses_to_start_and_an_unset_one_leaves_vllm_alone():
    code = "import expertd.client.vllm as plugin; plugin.register(); print('registered')"
    refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"EXPERTD_VLLM_TARGET": "localhost:8001", "PATH": ""})
    assert refused.returncode != 0
    assert ("RuntimeError: EXPERTD_VLLM_TARGET=localhost:8001 is set, but the expertd vLLM plugin could not load "
            "(ModuleNotFoundError: No module named ") in refused.stderr
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": ""})
    assert quiet.returncode == 0 and quiet.stdout.strip() == "registered"
