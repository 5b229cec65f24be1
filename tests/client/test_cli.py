"""`expertd info/health/route/forward/load` against a real server: tables, --json, files, exit codes.

Most runs go through ``expertd.client.cli.main(argv)`` in-process; a few through the installed
``expertd`` console script (which hands non-``serve`` commands to expertd.client.cli).
"""
import json
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from cli_support import free_port, running_server

from expertd.client import ExpertClient, cli

H, E, K = 64, 8, 2
EXPERTD = pathlib.Path(sys.executable).with_name("expertd")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory) as handle:
        yield handle


@pytest.fixture(scope="module")
def target(server):
    return f"127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def client(target):
    with ExpertClient(target, timeout=60) as c:
        yield c


def run(capsys, *argv):
    """(exit code, stdout, stderr) of ``expertd <argv>`` run in-process."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_client_commands_never_import_jax():
    # the console script enters through expertd.server.cli, which hands client commands over
    probe = ("import sys, expertd.server.cli, expertd.client.cli, expertd.client.loadtest; "
             "print('jax' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_console_script_info_json_and_exit_codes(target):
    result = subprocess.run([EXPERTD, "info", "--target", target, "--json"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert [layer["index"] for layer in info["layers"]] == [0, 1]
    assert info["layers"][0]["hidden_size"] == H and info["layers"][0]["kserve_model"] == "moe-layer-0"
    assert info["buckets"] == [1, 8] and info["dtype"] == "float32"
    result = subprocess.run([EXPERTD, "forward", "--target", target, "--layer", "9"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == cli.EXIT_INVALID_ARGUMENT and "layers [0, 1], not 9" in result.stderr
    dead = f"127.0.0.1:{free_port()}"
    result = subprocess.run([EXPERTD, "health", "--target", dead, "--timeout", "2"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == cli.EXIT_UNAVAILABLE and "UNREACHABLE" in result.stdout


def test_info_table(capsys, target):
    code, out, _ = run(capsys, "info", "--target", target)
    assert code == 0
    assert "buckets 1 8" in out and "moe-layer-1" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("layer"))
    assert header.split()[:5] == ["layer", "H", "I", "E", "k"]


def test_health(capsys, target):
    assert run_json(capsys, "health", "--target", target) == {"target": target, "service": "", "status": "SERVING"}
    code, out, _ = run(capsys, "health", "--target", target, "--service", "readiness")
    assert code == 0 and "SERVING" in out
    code, out, _ = run(capsys, "health", "--target", target, "--service", "no.such.Service", "--json")
    assert code == cli.EXIT_UNAVAILABLE and json.loads(out)["status"] == "SERVICE_UNKNOWN"


def test_forward_random_input_summary(capsys, target):
    document = run_json(capsys, "forward", "--target", target, "--layer", "1", "--tokens", "5", "--routing")
    assert document["input"]["shape"] == [5, H] and document["input"]["dtype"] == "bfloat16"
    assert document["output"]["shape"] == [5, H] and document["output"]["finite"]
    assert sum(document["routing"]["tokens_per_expert"]) == 5 * K
    code, out, _ = run(capsys, "forward", "--target", target, "--tokens", "3")
    assert code == 0 and "output [3, 64] bfloat16" in out and "latency" in out


def test_forward_npy_in_npy_out_equals_the_client(capsys, tmp_path, target, client):
    x = np.random.default_rng(1).standard_normal((6, H)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out, err = run(capsys, "forward", "--target", target, "--input", tmp_path / "x.npy", "--output",
                         tmp_path / "y.npy")
    assert code == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), client.forward(x, layer=0))
    # bfloat16 goes in as numpy saves it (2-byte voids) and comes back as float32, exactly
    xb = x.astype(ml_dtypes.bfloat16)
    np.save(tmp_path / "xb.npy", xb)
    document = run_json(capsys, "forward", "--target", target, "--input", tmp_path / "xb.npy", "--output",
                        tmp_path / "yb.npy")
    assert document["input"]["dtype"] == "bfloat16" and document["saved_dtype"] == "float32"
    np.testing.assert_array_equal(np.load(tmp_path / "yb.npy"), client.forward(xb, layer=0).astype(np.float32))


def test_route_hidden_states_and_logits(capsys, tmp_path, target, client):
    x = np.random.default_rng(2).standard_normal((7, H)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    document = run_json(capsys, "route", "--target", target, "--input", tmp_path / "x.npy", "--output",
                        tmp_path / "r.npz")
    expected = client.route(x, layer=0)
    np.testing.assert_array_equal(document["topk_ids"], expected.topk_ids)
    assert document["tokens_per_expert"] == expected.tokens_per_expert.tolist() and document["topk"] == K
    saved = np.load(tmp_path / "r.npz")
    np.testing.assert_array_equal(saved["topk_weights"], expected.topk_weights)
    logits = np.random.default_rng(3).standard_normal((4, E)).astype(np.float32)
    np.save(tmp_path / "logits.npy", logits)
    code, out, _ = run(capsys, "route", "--target", target, "--logits", tmp_path / "logits.npy", "--show", "2")
    assert code == 0 and "layer 0: 4 tokens, top-2 of 8 experts" in out
    assert sum(1 for line in out.splitlines() if line.startswith("token ")) == 2
    top = client.route(layer=0, logits=logits).topk_ids[0]
    assert f"token 0: {top[0]}:" in out


def test_load_table_json_and_plot(capsys, tmp_path, target, client):
    client.forward(np.ones((3, H), np.float32), layer=1)
    document = run_json(capsys, "load", "--target", target, "--layers", "1")
    (layer,) = document["layers"]
    assert layer["layer"] == 1 and len(layer["tokens_total"]) == E and sum(layer["tokens_total"]) >= 3 * K
    assert layer["imbalance_total"] >= 1.0
    code, out, _ = run(capsys, "load", "--target", target, "--plot", tmp_path / "load.png")
    assert code == 0 and "layer 0:" in out and "layer 1:" in out and "imbalance (max/mean)" in out
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exit_codes(capsys, tmp_path, target, monkeypatch):
    dead = f"127.0.0.1:{free_port()}"
    code, _, err = run(capsys, "info", "--target", dead, "--timeout", "2")
    assert code == cli.EXIT_UNAVAILABLE and "UNAVAILABLE" in err
    # invalid arguments caught before a call, and by the server (INVALID_ARGUMENT names the field)
    np.save(tmp_path / "wide.npy", np.zeros((2, H + 1), np.float32))
    bad_x = np.zeros((2, H), np.float32)
    bad_x[1, 0] = np.inf
    np.save(tmp_path / "inf.npy", bad_x)
    for argv, text in [
        (("forward", "--input", tmp_path / "wide.npy"), f"expected an array [T, {H}]"),
        (("forward", "--input", tmp_path / "missing.npy"), "No such file"),
        (("forward", "--tokens", "0"), "--tokens must be >= 1"),
        (("route", "--logits", tmp_path / "wide.npy"), f"[T, {E}]"),
        (("load", "--layers", "0,x"), "--layers"),
        (("forward", "--input", tmp_path / "inf.npy"), "hidden_states"),
    ]:
        code, _, err = run(capsys, *argv, "--target", target)
        assert code == cli.EXIT_INVALID_ARGUMENT and text in err, (argv, err)
    code, _, err = run(capsys, "load", "--target", target, "--layers", "5")
    assert code == cli.EXIT_INVALID_ARGUMENT and "NOT_FOUND" in err
    # a missing optional dependency is an "other" error, reported before any call
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run(capsys, "load", "--target", dead, "--plot", tmp_path / "x.png")
    assert code == cli.EXIT_ERROR and "expertd[plot]" in err
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["forward", "--no-such-flag"])
    assert excinfo.value.code == 2
