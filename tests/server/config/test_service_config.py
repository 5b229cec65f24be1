"""expertd serve configuration: flags, TOML, environment, validation, --help, and fail-closed security."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest
from tls_fixtures import make_pki

from expertd.server import config as cfg
from expertd.server.cli import main


def test_defaults_match_the_documented_ports_and_model():
    config = cfg.parse_args([], environ={})
    assert (config.port, config.metrics_port) == (8001, 8002)
    assert config.model.name == "tiny" and config.model.dtype == "auto"
    assert config.batching.batch_tokens == config.batching.bucket_sizes[-1] == 256
    assert config.security.token() is None and config.reflection and config.model.huge_pages
    assert config.model.panel_weights
    assert not config.retain_freed_memory


def test_toml_then_flags_then_environment_token(tmp_path):
    toml = tmp_path / "expertd.toml"
    toml.write_text('port = 9000\nreflection = false\naux_loss_coeff = 1\nretain_freed_memory = true\n'
                    '[model]\npreset = "mixtral-8x7b"\nnum_layers = 2\nhuge_pages = false\n'
                    '[batching]\nbucket_sizes = [1, 8, 64]\nmax_queue_delay_ms = 3\n')
    config = cfg.parse_args(["--config", str(toml), "--port", "0", "--max-queue-size", "7", "--reflection"],
                            environ={cfg.AUTH_TOKEN_ENV: "from-env"})
    assert config.port == 0 and config.reflection and config.aux_loss_coeff == 1.0
    assert config.model.preset == "mixtral-8x7b" and config.model.num_layers == 2 and not config.model.huge_pages
    assert cfg.parse_args(["--config", str(toml), "--huge-pages"], environ={}).model.huge_pages
    assert not cfg.parse_args(["--no-panel-weights"], environ={}).model.panel_weights
    assert config.retain_freed_memory
    assert not cfg.parse_args(["--config", str(toml), "--no-retain-freed-memory"], environ={}).retain_freed_memory
    assert config.batching.bucket_sizes == (1, 8, 64) and config.batching.max_queue_delay_ms == 3.0
    assert config.batching.max_queue_size == 7
    assert config.security.token() == "from-env"
    assert "from-env" not in repr(config)  # the token never shows up in logs


def test_token_file_wins_over_the_environment(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    config = cfg.parse_args(["--auth-token-file", str(token_file)], environ={cfg.AUTH_TOKEN_ENV: "from-env"})
    assert config.security.token() == "from-file"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bucket-sizes", "8,4"], "--bucket-sizes must be ascending"),
        (["--bucket-sizes", "1,8", "--max-batch-tokens", "9"], "--max-batch-tokens must be between 1 and"),
        (["--preset", "tiny", "--checkpoint", "/x"], "either --preset or --checkpoint"),
        (["--layers", "1", "--num-layers", "2"], "either --layers or --num-layers"),
        (["--dtype", "float64"], "--dtype must be one of"),
        (["--port", "70000"], "--port must be between 0 and 65535"),
        (["--port", "9000", "--metrics-port", "9000"], "must differ"),
        (["--tls-cert", "c.pem"], "--tls-cert and --tls-key must be given together"),
        (["--tls-client-ca", "ca.pem"], "needs --tls-cert"),
        (["--max-queue-size", "0"], "--max-queue-size must be >= 1"),
        (["--backend", "cuda"], "--backend must be 'auto' or one of"),
        (["--aux-loss-coeff", "-0.1"], "--aux-loss-coeff must be finite and >= 0, got -0.1"),
        (["--aux-loss-coeff", "nan"], "--aux-loss-coeff must be finite and >= 0, got nan"),
        (["--max-queue-tokens", "100"], "--max-queue-tokens must be >= --max-request-tokens 8192"),
        (["--max-queue-wait-ms", "0"], "--max-queue-wait-ms must be > 0"),
        (["--small-step-slack", "0.5"], "--small-step-slack must be >= 1, or 0 to always fill steps, got 0.5"),
        (["--native-cpu-isa", "sse2"], "--native-cpu-isa must be one of portable, avx2, avx512, avx512_bf16"),
        (["--num-processes", "2", "--coordinator-address", "h:1", "--num-devices", "2"],
         "--num-devices cannot be combined with a multi-host group"),
    ],
)
def test_bad_values_name_the_option(argv, message):
    with pytest.raises(ValueError, match=message):
        cfg.parse_args(argv, environ={})


@pytest.mark.parametrize(
    "toml, message",
    [
        ("portt = 1\n", "unknown option 'portt'"),
        ("[batching]\nmax_queue_size = \"big\"\n", "batching.max_queue_size must be int"),
        ("[batching]\nbucket_sizes = [1, 2.5]\n", "bucket_sizes must be tuple"),
        ("reflection = 1\n", "reflection must be bool"),
        ("[model\n", "--config"),
    ],
)
def test_bad_toml_names_the_key(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=message):
        cfg.parse_args(["--config", str(path)], environ={})


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    flags = [cfg.flag(section, field) for section, (cls, _) in cfg.SECTIONS.items() for field in cfg.options(cls)]
    assert len(flags) >= 40 and "--native-cpu-isa" in flags and "--coordinator-address" in flags
    for flag in flags:
        assert flag in text, flag
    assert "--ld-preload" not in text  # environment-only: LD_PRELOAD
    documented = {f.name for section, (cls, _) in cfg.SECTIONS.items() for f in dataclasses.fields(cls)}
    assert documented - {"ld_preload", *(s for s in cfg.SECTIONS if s)} == {
        f.name for _, (cls, _) in cfg.SECTIONS.items() for f in cfg.options(cls)}


def test_serve_rejects_a_bad_configuration_with_exit_status_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--bucket-sizes", "4,2"])
    assert info.value.code == 2
    assert "--bucket-sizes must be ascending" in capsys.readouterr().err


def test_serve_reports_a_missing_checkpoint_and_exits_1(tmp_path, capsys):
    status = main(["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "0", "--metrics-port", "0"])
    assert status == 1
    assert "missing is not a directory" in capsys.readouterr().out


def test_num_layers_takes_the_first_moe_layers_of_a_checkpoint(tmp_path):
    import hf_fixtures

    from expertd.server.engine.build import load_layers

    hf_fixtures.write_checkpoint(tmp_path, "deepseek_v3", num_layers=5)  # MoE layers 2, 3, 4
    config = cfg.parse_args(["--checkpoint", str(tmp_path), "--num-layers", "2", "--dtype", "float32"], environ={})
    assert [layer.index for layer in load_layers(config)] == [2, 3]
    with pytest.raises(ValueError, match="num_layers must be between 1 and 3"):
        load_layers(cfg.parse_args(["--checkpoint", str(tmp_path), "--num-layers", "4"], environ={}))


def test_multihost_and_native_options_come_from_flags_toml_and_the_old_variables(tmp_path):
    lws = {"LWS_LEADER_ADDRESS": "expertd-0.expertd", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    config = cfg.parse_args([], environ=lws)
    assert config.multihost.enabled and config.multihost.process_id == 1
    assert config.multihost.coordinator_address == "expertd-0.expertd:8476" and config.multihost.channel_port == 8477
    assert not cfg.parse_args(["--num-processes", "1", "--process-id", "0"], environ=lws).multihost.enabled  # flags win
    legacy = {"EXPERTD_NATIVE_CPU_ISA": "avx2", "EXPERTD_CACHE_DIR": "/cache", "EXPERTD_TRACE_PARALLEL_FOR": "1",
              "CXX": "clang++"}
    assert cfg.parse_args([], environ=legacy).native_cpu == cfg.NativeCpuConfig(
        isa="avx2", cache_dir="/cache", trace=True, compiler="clang++")
    assert cfg.parse_args([], environ={**legacy, "EXPERTD_NATIVE_CPU_PORTABLE": "1"}).native_cpu.isa == "portable"
    toml = tmp_path / "expertd.toml"
    toml.write_text('[native_cpu]\nisa = "avx512"\ntrace = false\n[multihost]\npeer_timeout_s = 3\n')
    config = cfg.parse_args(["--config", str(toml), "--native-cpu-cache-dir", "/flag"], environ=legacy)
    assert config.native_cpu == cfg.NativeCpuConfig(isa="avx512", cache_dir="/flag", trace=False, compiler="clang++")
    assert config.multihost.peer_timeout_s == 3.0
    assert cfg.parse_args([], environ={"LD_PRELOAD": "libjemalloc.so"}).ld_preload == "libjemalloc.so"
    assert cfg.parse_args([], environ={"EXPERTD_NATIVE_PORT": "8003"}).native_port == 8003
    assert cfg.parse_args(["--native-port", "0"], environ={"EXPERTD_NATIVE_PORT": "8003"}).native_port == 0
    with pytest.raises(ValueError, match="EXPERTD_NATIVE_PORT"):
        cfg.parse_args([], environ={"EXPERTD_NATIVE_PORT": "eighty"})
    with pytest.raises(ValueError, match="--native-port must be between 0 and 65535"):
        cfg.parse_args([], environ={"EXPERTD_NATIVE_PORT": "70000"})
    assert cfg.parse_args([], environ={}) == cfg.ServerConfig()  # nothing set: the defaults


def test_the_configs_lists_match_the_kernels():
    from expertd.kernels import cpu, experts

    assert cfg.EXPERT_BACKENDS is experts.BACKENDS and cfg.NATIVE_CPU_ISA_LEVELS is cpu.ISA_LEVELS  # one definition


def test_native_options_are_applied_to_the_process(monkeypatch):
    from expertd.kernels import cpu
    from expertd.server.host.process import configure_native_cpu

    applied = []
    monkeypatch.setattr(cpu, "configure", applied.append)
    config = cfg.parse_args(["--native-cpu-isa", "avx2", "--native-cpu-trace", "--native-cpu-cache-dir", "~/k"],
                            environ={"CXX": "clang++"})
    configure_native_cpu(config.native_cpu)
    assert applied == [cpu.BuildOptions(cache_dir=os.path.expanduser("~/k"), isa_cap="avx2", trace=True,
                                        compiler="clang++")]


# -- fail closed: every empty or unusable security input is an error at start ---------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, pki):
    """Files that must each stop the server: empty, whitespace, garbage, an encrypted key, ..."""
    directory = tmp_path_factory.mktemp("bad")
    files = {"empty": "", "blank": "  \n\n", "garbage": "not a certificate\n", "spaced-token": "two words\n"}
    for name, text in files.items():
        (directory / name).write_text(text)
    (directory / "good-token").write_text("s3cret\n")
    (directory / "broken-cert").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    subprocess.run(["openssl", "pkey", "-in", str(pki.server_key), "-aes256", "-passout", "pass:x", "-out",
                    str(directory / "encrypted.key")], check=True, capture_output=True)
    return directory


def _cases(pki, bad):
    """(argv, environ, TOML, message) for every fail-closed rule."""
    tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
    return [
        # set but empty, by flag, environment or TOML key
        (["--auth-token-file", ""], {}, None, "--auth-token-file is set but empty"),
        (["--auth-token-file", "   "], {}, None, "--auth-token-file is set but empty"),
        (["--auth-token", ""], {}, None, "--auth-token is set but empty"),
        ([], {cfg.AUTH_TOKEN_ENV: ""}, None, r"\$EXPERTD_AUTH_TOKEN is set but empty"),
        ([], {cfg.AUTH_TOKEN_ENV: " \t"}, None, r"\$EXPERTD_AUTH_TOKEN is set but empty"),
        (["--tls-cert", "", "--tls-key", ""], {}, None, "--tls-cert is set but empty"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", " "], {}, None, "--tls-key is set but empty"),
        ([*tls, "--tls-client-ca", ""], {}, None, "--tls-client-ca is set but empty"),
        ([], {}, '[security]\nauth_token_file = ""\n', "security.auth_token_file is empty"),
        ([], {}, '[security]\nauth_token = " "\n', "security.auth_token is empty"),
        ([], {}, '[security]\ntls_cert = ""\ntls_key = ""\n', "security.tls_cert is empty"),
        ([], {}, 'metrics_host = ""\n', "metrics_host is empty"),
        (["--metrics-host", ""], {}, None, "--metrics-host is set but empty"),
        # half of a pair, or an option that needs another
        (["--tls-key", str(pki.server_key)], {}, None, "--tls-cert and --tls-key must be given together"),
        (["--metrics-tls"], {}, None, "--metrics-tls needs --tls-cert"),
        (["--metrics-auth"], {}, None, "--metrics-auth needs a bearer token"),
        # unreadable
        (["--auth-token-file", str(bad / "missing")], {}, None, "--auth-token-file .*missing: cannot read it"),
        (["--auth-token-file", str(bad)], {}, None, "--auth-token-file .*: cannot read it"),
        (["--tls-cert", str(bad / "missing"), "--tls-key", str(pki.server_key)], {}, None,
         "--tls-cert .*missing: cannot read it"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(bad / "missing")], {}, None,
         "--tls-key .*missing: cannot read it"),
        ([*tls, "--tls-client-ca", str(bad / "missing")], {}, None, "--tls-client-ca .*missing: cannot read it"),
        # empty, or not what it should be
        (["--auth-token-file", str(bad / "empty")], {}, None, r"--auth-token-file .*empty \(first line\) is empty"),
        (["--auth-token-file", str(bad / "blank")], {}, None, r"--auth-token-file .*blank \(first line\) is empty"),
        (["--auth-token-file", str(bad / "spaced-token")], {}, None, "printable ASCII characters without whitespace"),
        ([], {cfg.AUTH_TOKEN_ENV: "t\u00f6ken"}, None, "printable ASCII characters without whitespace"),
        (["--tls-cert", str(bad / "empty"), "--tls-key", str(pki.server_key)], {}, None,
         "--tls-cert .*empty holds no PEM certificate"),
        (["--tls-cert", str(bad / "garbage"), "--tls-key", str(pki.server_key)], {}, None,
         "--tls-cert .*garbage holds no PEM certificate"),
        (["--tls-cert", str(pki.server_key), "--tls-key", str(pki.server_key)], {}, None,
         "--tls-cert .*server.key holds no PEM certificate"),
        (["--tls-cert", str(bad / "broken-cert"), "--tls-key", str(pki.server_key)], {}, None,
         "--tls-cert .*broken-cert is not a valid PEM certificate"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(bad / "garbage")], {}, None,
         "--tls-key .*garbage is not a PEM private key of the --tls-cert certificate"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key)], {}, None,
         "--tls-key .*client.key is not a PEM private key of the --tls-cert certificate"),
        (["--tls-cert", str(pki.server_cert), "--tls-key", str(bad / "encrypted.key")], {}, None,
         "--tls-key .*encrypted.key is encrypted"),
        ([*tls, "--tls-client-ca", str(bad / "garbage")], {}, None, "--tls-client-ca .*garbage holds no PEM"),
    ]


def _argv(tmp_path, argv, toml):
    if toml is None:
        return list(argv)
    path = tmp_path / "expertd.toml"
    path.write_text(toml)
    return ["--config", str(path), *argv]


def test_every_empty_or_unusable_security_input_is_an_error_naming_it(tmp_path, pki, bad_files):
    cases = _cases(pki, bad_files)
    assert len(cases) >= 30
    for argv, environ, toml, message in cases:
        with pytest.raises(ValueError, match=message):
            cfg.parse_args(_argv(tmp_path, argv, toml), environ=environ)


def test_expertd_serve_refuses_to_start_with_exit_status_2(tmp_path, pki, bad_files, capsys, monkeypatch):
    """One real start per rule: `expertd serve` stops at its configuration, before loading anything."""
    for argv, environ, toml, message in _cases(pki, bad_files):
        monkeypatch.delenv(cfg.AUTH_TOKEN_ENV, raising=False)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as info:
            main(["serve", "--port", "0", "--metrics-port", "0", *_argv(tmp_path, argv, toml)])
        assert info.value.code == 2, argv
        assert re.search(message, capsys.readouterr().err), (argv, environ, toml)


def test_a_refused_start_is_exit_status_2_from_the_process(tmp_path):
    result = subprocess.run([sys.executable, "-m", "expertd.server.cli", "serve", "--auth-token-file", ""],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, cfg.AUTH_TOKEN_ENV: "ignored-when-a-file-is-given"})
    assert result.returncode == 2 and "--auth-token-file is set but empty" in result.stderr
    result = subprocess.run([sys.executable, "-m", "expertd.server.cli", "serve"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, cfg.AUTH_TOKEN_ENV: ""})
    assert result.returncode == 2 and "$EXPERTD_AUTH_TOKEN is set but empty" in result.stderr


def test_good_security_settings_are_read_once_and_described(tmp_path, pki):
    token_file = tmp_path / "token"
    token_file.write_text(" s3cret \nsecond line ignored\n")
    config = cfg.parse_args(["--auth-token-file", str(token_file), "--tls-cert", str(pki.server_cert),
                             "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)], environ={})
    credentials = config.security.credentials()
    assert credentials.token == "s3cret" and credentials.tls.mutual
    assert credentials.tls.certificate_chain == pki.server_cert.read_bytes()
    assert credentials.describe() == "TLS on, mTLS on, auth on (--auth-token-file)"
    assert "s3cret" not in repr(credentials) and "PRIVATE KEY" not in repr(credentials)
    assert cfg.parse_args([], environ={cfg.AUTH_TOKEN_ENV: "abc"}).security.credentials().describe() == \
        "TLS off, mTLS off, auth on (--auth-token or $EXPERTD_AUTH_TOKEN)"
    assert cfg.parse_args([], environ={}).security.credentials().describe() == "TLS off, mTLS off, auth off"


def test_metrics_bind_loopback_by_default_when_auth_is_on():
    plain = cfg.ServerConfig(host="0.0.0.0")
    assert plain.metrics_bind_host == "0.0.0.0"
    with_auth = cfg.ServerConfig(host="0.0.0.0", security=cfg.SecurityConfig(auth_token="t"))
    assert with_auth.metrics_bind_host == "127.0.0.1"
    assert dataclasses.replace(with_auth, metrics_auth=True).metrics_bind_host == "0.0.0.0"
    assert dataclasses.replace(with_auth, metrics_host="10.0.0.5").metrics_bind_host == "10.0.0.5"


def test_the_same_host_channel_from_flags_and_toml(tmp_path):
    toml = tmp_path / "expertd.toml"
    toml.write_text('shm_channel = "experts"\nshm_channel_slots = 8\n')
    config = cfg.parse_args(["--config", str(toml), "--shm-channel-spin-us", "0"], environ={})
    assert (config.shm_channel, config.shm_channel_slots, config.shm_channel_spin_us) == ("experts", 8, 0.0)
    assert (config.shm_channel_group, config.shm_channel_clients) == (None, 64)
    assert cfg.parse_args([], environ={}).shm_channel is None


@pytest.mark.parametrize("argv, message", [
    (["--shm-channel", "x", "--shm-channel-slots", "0"], "--shm-channel-slots must be between 1 and 1024, got 0"),
    (["--shm-channel", "x", "--shm-channel-clients", "5000"], "--shm-channel-clients must be between 1 and 1024"),
    (["--shm-channel", "x", "--shm-channel-spin-us", "-1"], "--shm-channel-spin-us must be between 0 and 1000000"),
    (["--shm-channel-group", "video"], "--shm-channel-group needs --shm-channel NAME"),
    (["--shm-channel", " "], "--shm-channel is set but empty"),
])
def test_bad_same_host_channel_settings_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        cfg.parse_args(argv, environ={})


def test_the_tokamax_backend_without_its_package_is_refused_naming_the_extra(monkeypatch):
    from expertd.server.config import model

    real = model.importlib.util.find_spec
    missing = lambda name, *a: None if name == "tokamax" else real(name, *a)
    monkeypatch.setattr(model.importlib.util, "find_spec", missing)
    with pytest.raises(ValueError, match=r"--backend tokamax needs the tokamax package.*expertd\[tokamax\]"):
        cfg.parse_args(["--backend", "tokamax"], environ={})
    monkeypatch.undo()
    if real("tokamax") is not None:
        assert cfg.parse_args(["--backend", "tokamax"], environ={}).model.backend == "tokamax"
