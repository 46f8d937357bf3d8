"""`argosy serve` flags: built from the config dataclasses, validated at start-up."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from argosy.cli import build_parser, configs_from_args, parse_byte_size
from argosy.config import OperatorSampling
from argosy.errors import InvalidRequestError


def configs(*argv: str):  # type: ignore[no-untyped-def]
    engine, server, _ = configs_and_models(*argv)
    return engine, server


def configs_and_models(*argv: str):  # type: ignore[no-untyped-def]
    parser = build_parser()
    return configs_from_args(parser, parser.parse_args(["serve", *argv]))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("512M", 512 * 2**20),
        ("2G", 2 * 2**30),
        ("2GiB", 2 * 2**30),
        ("1.5k", 1536),
        ("64MB", 64 * 2**20),
    ],
)
def test_byte_sizes(text: str, expected: int) -> None:
    assert parse_byte_size(text) == expected


def test_a_bad_byte_size() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_byte_size("lots")


def test_defaults_come_from_the_dataclasses() -> None:
    engine, server = configs()
    assert engine.model == "qwen2.5-coder-0.5b"  # no --model: the default chat model
    assert engine.enable_prefix_caching is True
    assert server.host == "127.0.0.1" and server.port == 8000
    assert server.operator_sampling == OperatorSampling()


def test_every_issue_flag() -> None:
    engine, server = configs(
        "--model", "/models/x.gguf", "--host", "127.0.0.2", "--port", "9001", "--served-model-name", "x",
        "--max-model-len", "4096", "--kv-cache-memory", "256M", "--dtype", "float32", "--threads", "2",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--no-prefix-cache",
        "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05",
        "--repetition-penalty", "1.1", "--max-tokens", "128",
    )  # fmt: skip
    assert (engine.model, engine.max_model_len, engine.kv_cache_memory) == (
        "/models/x.gguf",
        4096,
        256 * 2**20,
    )
    assert (engine.dtype, engine.num_threads, engine.max_num_seqs) == ("float32", 2, 8)
    assert engine.max_num_batched_tokens == 256 and engine.enable_prefix_caching is False
    assert (server.host, server.port, server.served_model_name) == ("127.0.0.2", 9001, "x")
    assert server.operator_sampling == OperatorSampling(
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=128
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("--top-p", "0"),
        ("--temperature", "3"),
        ("--max-tokens", "0"),
        ("--min-p", "2"),
        ("--repetition-penalty", "0"),
        ("--dtype", "int3"),
        ("--port", "70000"),
        ("--max-num-seqs", "0"),
        ("--top-k", "many"),
    ],
)
def test_bad_flags_stop_start_up(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        configs(*argv)
    assert caught.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_operator_sampling_validates_itself() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        OperatorSampling(top_p=1.5)
    assert caught.value.param == "top_p"


def test_models_are_repeatable_with_ids_and_quantization() -> None:
    engine, _, specs = configs_and_models(
        "--model", "smollm2", "--model", "fast=smollm2:int4", "--model", "plain=smollm2:none", "--model", "minilm"
    )  # fmt: skip
    assert engine.model == "smollm2"  # the first model's source
    assert [(s.id, s.source, s.kind, s.quantization) for s in specs] == [
        ("smollm2", "smollm2", "chat", None),
        ("fast", "smollm2", "chat", "int4"),
        ("plain", "smollm2", "chat", "none"),
        ("minilm", "minilm", "embedding", None),
    ]
    assert specs[1].engine_config(engine).quantization == "int4"
    assert specs[0].engine_config(engine).quantization == "auto"  # the flag's default
    _, _, default = configs_and_models()
    assert [(s.id, s.source) for s in default] == [("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b")]


def test_served_model_name_renames_the_first_model_and_keeps_its_source_as_alias() -> None:
    _, _, specs = configs_and_models("--model", "smollm2", "--served-model-name", "tiny")
    assert specs[0].id == "tiny" and specs[0].aliases == ("smollm2",)


def test_models_from_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        '[[model]]\nid = "chat"\nsource = "smollm2"\naliases = ["default"]\npinned = true\n'
        'keep_alive = "5m"\n[model.sampling]\ntemperature = 0.2\n\n'
        '[[model]]\nsource = "minilm"\n'
    )
    _, _, specs = configs_and_models("--models", str(path))
    first, second = specs
    assert (first.id, first.aliases, first.pinned, first.keep_alive) == ("chat", ("default",), True, 300.0)
    assert first.sampling == OperatorSampling(temperature=0.2)
    assert (second.id, second.kind) == ("minilm", "embedding")


@pytest.mark.parametrize(
    "content",
    ['[[model]]\nid = "x"\n', '[[model]]\nsource = "smollm2"\ncolour = "red"\n', "model = 3\n", "[[model"],
)
def test_bad_models_files_stop_start_up(tmp_path: Path, content: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(content)
    with pytest.raises(SystemExit):
        configs_and_models("--models", str(path))


def test_gate_flags_repeat_and_keys_are_never_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from argosy.cli import _print_config

    engine, server = configs(
        "--api-key", "sk-one", "--api-key", "sk-two", "--trusted-proxies", "10.0.0.0/8",
        "--trusted-proxies", "192.168.1.1", "--allowed-origins", "*", "--rate-limit-per-minute", "90",
        "--max-small-body-bytes", "2K", "--host", "0.0.0.0",
    )  # fmt: skip
    assert server.api_key == ["sk-one", "sk-two"] and server.has_keys
    assert server.trusted_proxies == ["10.0.0.0/8", "192.168.1.1"] and server.allowed_origins == ["*"]
    assert server.rate_limit_per_minute == 90 and server.max_small_body_bytes == 2048
    _print_config(engine, server)
    printed = capsys.readouterr().out
    assert "sk-one" not in printed and "api_key=['***', '***']" in printed


def test_a_config_file_fills_what_flags_leave_unset(tmp_path: Path) -> None:
    from argosy.config_file import apply_config_file

    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "a"\nkey = "sk-a"\n')
    config = tmp_path / "argosy.toml"
    config.write_text(
        f'port = 9100\nmax-num-seqs = 4\nkv_cache_memory = "64M"\napi_keys = "{keys}"\n'
        'allowed_origins = "https://x.example"\nmodel = ["smollm2", "fast=smollm2:int4"]\n'
        'temperature = 0.4\nshutdown_grace = "10s"\n'
    )
    parser = build_parser()
    args = parser.parse_args(["serve", "--port", "9200"])
    apply_config_file(args, str(config))
    engine, server, specs = configs_from_args(parser, args)
    assert server.port == 9200  # the flag wins
    assert engine.max_num_seqs == 4 and engine.kv_cache_memory == 64 * 2**20
    assert server.api_keys == str(keys) and server.allowed_origins == ["https://x.example"]
    assert server.operator_sampling.temperature == 0.4 and server.shutdown_grace == 10.0
    assert [s.id for s in specs] == ["smollm2", "fast"]

    tables = tmp_path / "tables.toml"
    tables.write_text('[[model]]\nid = "tiny"\nsource = "smollm2"\npinned = true\n')
    args = parser.parse_args(["serve"])
    apply_config_file(args, str(tables))
    assert [(s.id, s.pinned) for s in configs_from_args(parser, args)[2]] == [("tiny", True)]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("colour = 1\n", "key 'colour': no such setting"),
        ('port = "x"\n', "key 'port'"),
        ("port = 1.5\n", "key 'port': expected int"),
        ('insecure = "yes"\n', "key 'insecure': expected true or false"),
        ("model = 3\n", "key 'model'"),
        ("port = \n", "not valid TOML"),
    ],
)
def test_a_bad_config_file_names_the_file_the_key_and_the_reason(
    tmp_path: Path, content: str, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from argosy.cli import main

    config = tmp_path / "argosy.toml"
    config.write_text(content)
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--config", str(config)])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert str(config) in err and reason in err


def test_a_bad_keys_file_stops_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "a"\n')
    with pytest.raises(SystemExit):
        configs("--api-keys", str(keys))
    assert "--api-keys" in capsys.readouterr().err


def test_lora_adapters_from_flags_and_the_models_file(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        '[[model]]\nsource = "minilm"\n\n[[model]]\nid = "chat"\nsource = "smollm2"\n'
        'adapters = ["sql=/a/sql", {name = "docs", path = "/a/docs"}]\n'
    )
    engine, server, specs = configs_and_models(
        "--models", str(path), "--lora", "fix=/a/fix", "--max-loras", "2", "--admin-key", "sk-admin"
    )
    chat = specs[1]
    # --lora adds to the first chat model's (the embedding model before it takes none)
    assert chat.adapters == (("sql", "/a/sql"), ("docs", "/a/docs"), ("fix", "/a/fix"))
    assert specs[0].adapters == ()
    assert chat.engine_config(engine).loras == chat.adapters and engine.max_loras == 2
    assert server.admin_key == ["sk-admin"] and server.has_keys
    for bad in ("nameonly", "=/path", "x="):
        with pytest.raises(SystemExit):
            configs_and_models("--lora", bad)
