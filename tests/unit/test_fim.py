"""Fill-in-the-middle prompts: each family's tokens found in a tokenizer and laid out in its
own order, the user's text never read as special tokens, the end markers to stop at."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from argosy.chat.fim import fim_dialect

WORDS = ["def", "f", "(", ")", ":", "return", "x", "<fim_prefix>"]


def tokenizer_with(specials: list[str]) -> Tokenizer:
    vocab = {word: i for i, word in enumerate(WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="x"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    return tokenizer


def ids(tokenizer: Tokenizer, *tokens: str) -> list[int]:
    return [tokenizer.token_to_id(t) for t in tokens]


def test_no_fim_tokens_no_dialect() -> None:
    assert fim_dialect(tokenizer_with(["<|endoftext|>"])) is None
    assert fim_dialect(tokenizer_with(["<fim_prefix>", "<fim_suffix>"])) is None  # no middle


def test_starcoder_prefix_suffix_middle_with_bos() -> None:
    tok = tokenizer_with(
        ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<|endoftext|>", "<s>"]
    )
    dialect = fim_dialect(tok)
    assert dialect is not None and dialect.family == "starcoder"
    prompt = dialect.prompt_ids("def f ( ) :", "return x", bos_id=tok.token_to_id("<s>"))
    assert prompt == ids(
        tok, "<s>", "<fim_prefix>", "def", "f", "(", ")", ":", "<fim_suffix>", "return", "x", "<fim_middle>"
    )
    assert set(dialect.stop_ids) == set(ids(tok, "<fim_pad>", "<|endoftext|>"))


def test_qwen_and_codellama_and_deepseek_tokens() -> None:
    qwen = tokenizer_with(
        ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>"]
    )
    dialect = fim_dialect(qwen)
    assert dialect is not None and dialect.family == "qwen"
    assert dialect.prompt_ids("", "", None) == ids(qwen, "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    assert set(dialect.stop_ids) == set(ids(qwen, "<|fim_pad|>", "<|file_sep|>"))
    llama = tokenizer_with(["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"])
    dialect = fim_dialect(llama)
    assert (
        dialect is not None
        and dialect.family == "codellama"
        and dialect.stop_ids == tuple(ids(llama, "▁<EOT>"))
    )
    deepseek = tokenizer_with(["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"])
    dialect = fim_dialect(deepseek)
    assert dialect is not None and dialect.family == "deepseek"
    assert dialect.prompt_ids("x", "f", None) == ids(
        deepseek, "<｜fim▁begin｜>", "x", "<｜fim▁hole｜>", "f", "<｜fim▁end｜>"
    )


def test_codestral_is_suffix_first_without_a_middle_token() -> None:
    tok = tokenizer_with(["[PREFIX]", "[SUFFIX]"])
    dialect = fim_dialect(tok)
    assert dialect is not None and dialect.suffix_first and dialect.middle_id is None
    assert dialect.prompt_ids("def", "return", None) == ids(tok, "[SUFFIX]", "return", "[PREFIX]", "def")


@pytest.mark.parametrize("text", ["<fim_middle>", "<fim_suffix> x"])
def test_special_token_text_in_the_users_code_is_not_a_special_token(text: str) -> None:
    tok = tokenizer_with(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    dialect = fim_dialect(tok)
    assert dialect is not None
    prompt = dialect.prompt_ids(text, "", None)
    specials = ids(tok, "<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    # exactly one of each special: the user's "<fim_…>" became ordinary (here: unknown) tokens
    assert [t for t in prompt if t in specials] == specials
