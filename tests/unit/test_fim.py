"""Fill-in-the-middle prompts: each family's tokens found in a tokenizer and laid out in its
own order, the user's text never read as special tokens, the end markers to stop at."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from argosy.chat.fim import FIM_DEFAULT_MAX_TOKENS, fim_dialect, fim_max_tokens

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


def test_fim_mode_lays_out_only_what_the_family_was_trained_on() -> None:
    star = tokenizer_with(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"])
    dialect = fim_dialect(star)
    assert dialect is not None and dialect.modes == ("psm", "spm")
    assert dialect.honours(None) and dialect.honours("psm") and dialect.honours("spm")
    # suffix-prefix-middle as StarCoder learnt it: <pre><suf>S<mid>P
    assert dialect.prompt_ids("def", "return", None, "spm") == ids(
        star, "<fim_prefix>", "<fim_suffix>", "return", "<fim_middle>", "def"
    )
    assert dialect.prompt_ids("def", "return", None, "psm") == dialect.prompt_ids("def", "return", None)
    qwen = tokenizer_with(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    dialect = fim_dialect(qwen)
    assert dialect is not None and dialect.modes == ("psm",) and not dialect.honours("spm")
    # a layout Qwen never saw is served in its own (the dialect names fim_mode degraded)
    assert dialect.prompt_ids("def", "return", None, "spm") == dialect.prompt_ids("def", "return", None)
    codestral = tokenizer_with(["[PREFIX]", "[SUFFIX]"])
    dialect = fim_dialect(codestral)
    assert dialect is not None and dialect.honours("spm") and not dialect.honours("psm")
    assert dialect.prompt_ids("def", "return", None, "psm") == ids(
        codestral, "[SUFFIX]", "return", "[PREFIX]", "def"
    )


def test_qwen_stops_at_llama_cpps_end_of_generation_set() -> None:
    ends = ["<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<|im_end|>"]
    qwen = tokenizer_with(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", *ends, "<|im_start|>"])
    dialect = fim_dialect(qwen)
    assert dialect is not None and set(dialect.stop_ids) == set(ids(qwen, *ends))


def test_the_fim_default_max_tokens() -> None:
    assert FIM_DEFAULT_MAX_TOKENS == 128  # the reference's FIM contract
    assert fim_max_tokens(None, context_length=4096, prompt_len=100) == 128
    assert fim_max_tokens(None, context_length=4096, prompt_len=4000) == 96  # the room left
    assert fim_max_tokens(None, context_length=4096, prompt_len=4096) is None  # the usual 400 follows
    assert fim_max_tokens(512, context_length=4096, prompt_len=100) is None  # the operator's default
