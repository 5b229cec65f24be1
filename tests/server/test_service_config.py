"""expertd serve configuration: flags, TOML, environment, validation and --help."""
import dataclasses
import os

import pytest

from expertd.server import config as cfg
from expertd.server.cli import main


def test_defaults_match_the_documented_ports_and_model():
    config = cfg.parse_args([], environ={})
    assert (config.port, config.metrics_port) == (8001, 8002)
    assert config.model.name == "tiny" and config.model.dtype == "bfloat16"
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

    from expertd.server.startup import load_layers

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
    assert cfg.parse_args([], environ={}) == cfg.ServerConfig()  # nothing set: the defaults


def test_the_configs_lists_match_the_kernels():
    from expertd.kernels import cpu, experts

    assert cfg.EXPERT_BACKENDS == experts.BACKENDS and cfg.NATIVE_CPU_ISA_LEVELS == cpu.ISA_LEVELS


def test_native_options_are_applied_to_the_process(monkeypatch):
    from expertd.kernels import cpu
    from expertd.server.process import configure_native_cpu

    applied = []
    monkeypatch.setattr(cpu, "configure", applied.append)
    config = cfg.parse_args(["--native-cpu-isa", "avx2", "--native-cpu-trace", "--native-cpu-cache-dir", "~/k"],
                            environ={"CXX": "clang++"})
    configure_native_cpu(config.native_cpu)
    assert applied == [cpu.BuildOptions(cache_dir=os.path.expanduser("~/k"), isa_cap="avx2", trace=True,
                                        compiler="clang++")]
