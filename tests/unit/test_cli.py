"""`argosy serve` flags: built from the config dataclasses, validated at start-up."""

from __future__ import annotations

import argparse

import pytest

from argosy.cli import build_parser, configs_from_args, parse_byte_size
from argosy.config import OperatorSampling
from argosy.errors import InvalidRequestError


def configs(*argv: str):  # type: ignore[no-untyped-def]
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
    assert engine.model == "smollm2"
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
