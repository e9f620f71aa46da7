"""Options that fill a configuration struct: their defaults are the struct's, and a
``--config`` file is the struct as JSON, read back whole or refused naming the bad field."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from pdserve.cli.common import add_engine_args, add_field_option, field_default, from_options, read_config
from pdserve.types.engine_config import EngineConfig
from pdserve.worker.config import WorkerConfig


def test_an_option_not_given_leaves_the_field_to_the_structs_default():
    parser = argparse.ArgumentParser()
    add_field_option(parser, "--max-num-seqs", EngineConfig, "max_num_seqs", type=int, help="(default: {default})")
    add_field_option(parser, "--lease-ttl", WorkerConfig, "lease_ttl_s", type=float, help="(default: {default:g}s)")
    assert from_options(parser.parse_args([]), EngineConfig) == EngineConfig()
    given = parser.parse_args(["--max-num-seqs", "8", "--lease-ttl", "2"])
    assert from_options(given, EngineConfig) == EngineConfig(max_num_seqs=8)  # the worker's option is not the engine's
    assert from_options(given, WorkerConfig, role="decode", model="m", etcd="e").lease_ttl_s == 2.0
    assert f"(default: {EngineConfig().max_num_seqs})" in parser.format_help()
    assert f"(default: {field_default(WorkerConfig, 'lease_ttl_s'):g}s)" in parser.format_help()


def test_an_option_for_a_field_the_struct_lacks_is_refused_when_it_is_added():
    with pytest.raises(AttributeError, match="EngineConfig has no field 'max_seqs'"):
        add_field_option(argparse.ArgumentParser(), "--max-seqs", EngineConfig, "max_seqs", help="")


def test_a_config_file_reads_back_the_struct_it_was_written_from(tmp_path: Path):
    config = WorkerConfig(
        role="prefill",
        model="/m",
        etcd="http://e:2379",
        hold_s=5.0,
        engine=EngineConfig(max_num_seqs=8, kernels="torch", enable_prefix_caching=False),
    )
    path = tmp_path / "worker.json"
    path.write_bytes(msgspec.json.encode(config))
    assert read_config(str(path), WorkerConfig) == config


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (
            b'{"role": "prefill", "model": "/m", "etcd": "e", "engine": {"max_num_seqs": "many"}}',
            "Expected `int`, got `str` - at `$.engine.max_num_seqs`",
        ),
        (
            b'{"role": "prefill", "model": "/m", "etcd": "e", "engine": {"max_num_seqs": 0}}',
            "max_num_seqs must be >= 1, got 0 - at `$.engine`",
        ),
        (b'{"role": "prefill", "model": "/m", "etcd": "e", "lease_ttl": 3}', "unknown field `lease_ttl`"),
        (b'{"role": "prefill", "model": "/m"}', "missing required field `etcd`"),
        (b"{not json", "malformed"),
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_the_field(tmp_path: Path, content: bytes, error: str):
    path = tmp_path / "worker.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"--config {path}: not a WorkerConfig: .*") as raised:
        read_config(str(path), WorkerConfig)
    assert error in str(raised.value)


def test_a_missing_config_file_is_one_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="No such file"):
        read_config(str(tmp_path / "absent.json"), WorkerConfig)


def test_the_kv_cache_dtype_option_sets_the_engine_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert from_options(parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"]), EngineConfig).kv_cache_dtype == "fp8_e4m3"
    assert from_options(parser.parse_args([]), EngineConfig).kv_cache_dtype == "auto"
    assert "fp8_e4m3" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])


@pytest.mark.parametrize(
    "argv, dest",
    [
        (["decode", "--model", "/m", "--lease-ttl", "{}"], "WorkerConfig.lease_ttl_s"),
        (["prefill", "--model", "/m", "--hold", "{}"], "WorkerConfig.hold_s"),
        (["frontend", "--request-timeout", "{}"], "FrontendConfig.request_timeout_s"),
        (["up", "--restart-backoff", "{}"], "restart_backoff"),
        (["status", "--interval", "{}"], "interval"),
        (["drain", "w-1", "--timeout", "{}"], "timeout"),
        (["slo", "set", "--model", "m", "--ttft-p90", "{}"], "ttft_p90"),
    ],
)
def test_every_duration_option_reads_one_grammar(argv: list[str], dest: str) -> None:
    from pdserve.cli import build_parser

    for text, seconds in (("1m", 60.0), ("250ms", 0.25), ("2s", 2.0), ("1.5", 1.5)):
        args = build_parser().parse_args([part.format(text) for part in argv])
        assert getattr(args, dest) == pytest.approx(seconds), text


def test_generate_takes_its_sampling_defaults_from_sampling_params() -> None:
    from pdserve.cli import build_parser
    from pdserve.types.sampling_params import SamplingParams

    args = build_parser("generate").parse_args(["generate", "--target", "127.0.0.1:1", "--prompt", "hi"])
    default = SamplingParams()
    assert (args.max_tokens, args.temperature, args.top_p, args.top_k, args.min_p) == (
        default.max_tokens,
        default.temperature,
        default.top_p,
        default.top_k,
        default.min_p,
    )
