"""A `tokenizers.Tokenizer` (and tokenizer_config.json) rebuilt from a GGUF's `tokenizer.ggml.*` keys.

A GGUF carries no tokenizer.json, only the vocabulary, merges, token types and a
pre-tokenizer *name* (`tokenizer.ggml.pre`). We rebuild what the model's original
tokenizer.json held:

- model "gpt2": byte-level BPE. The split regex comes from `_BYTE_LEVEL_PRE_TOKENIZERS`, keyed
  by the pre-tokenizer name exactly as llama.cpp keys its own regexes, so text is cut into
  the same pieces the merges were learned on. An unknown name is an error rather than a
  guess, since a wrong split silently changes token ids.
- model "llama": SentencePiece as BPE with byte fallback (what transformers' LlamaTokenizer
  builds); merges come from the file or, as usual for SentencePiece, from the token scores.

Control tokens (type 3) and the unknown token (type 2) become special added tokens and
user-defined ones (type 4, e.g. `<think>`) plain added tokens: either way they are matched
whole and never split. The tokenizer never inserts BOS/EOS itself; whether a prompt gets a
BOS is `add_bos_token` in tokenizer_config.json, applied by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from argosy.errors import ModelLoadError

TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # SmolLM / StarCoder: every digit is its own piece, then the GPT-2 split (their tokenizer.json).
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_split()]  # type: ignore[list-item]
    )


def _regex_split(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),  # type: ignore[list-item]
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # type: ignore[list-item]
            ]
        )

    return build


# tokenizer.ggml.pre -> pre-tokenizer. "default" is what older converters wrote when they did
# not recognise a BPE tokenizer; GPT-2's split is the reasonable reading of it.
_BYTE_LEVEL_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_split,
    "gpt-2": _gpt2_split,
    "gpt2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "starcoder": _digits_then_gpt2_split,
    "qwen2": _regex_split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _regex_split(_QWEN2_SPLIT),
    "llama-bpe": _regex_split(_LLAMA3_SPLIT),
    "llama3": _regex_split(_LLAMA3_SPLIT),
    "llama-v3": _regex_split(_LLAMA3_SPLIT),
    "smaug-bpe": _regex_split(_LLAMA3_SPLIT),
    "dbrx": _regex_split(_LLAMA3_SPLIT),
    "falcon3": _regex_split(_LLAMA3_SPLIT),
    "tekken": _regex_split(_TEKKEN_SPLIT),
    "gpt-4o": _regex_split(_GPT4O_SPLIT),
    "llama4": _regex_split(_GPT4O_SPLIT),
}

# Qwen's tokenizer.json NFC-normalizes text before splitting; llama.cpp and transformers' GGUF
# loader skip it, which only matters for text that is not already NFC.
_NFC_PRE_TOKENIZERS = frozenset({"qwen2", "deepseek-r1-qwen"})

# Llama 3's and Tekken's tokenizer.json set ignore_merges (a piece that is itself in the
# vocabulary is taken whole); llama.cpp sets it, and defaults add_bos_token on, for these names.
_IGNORE_MERGES_PRE_TOKENIZERS = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "tekken"})
_ADD_BOS_PRE_TOKENIZERS = _IGNORE_MERGES_PRE_TOKENIZERS

_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer described by a GGUF's metadata (see the module docstring)."""
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
    if tokenizer_model == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens)
    elif tokenizer_model == "llama":
        tokenizer = _sentencepiece_bpe(metadata, tokens)
    else:
        raise ModelLoadError(
            f"GGUF tokenizer model {tokenizer_model!r} is not supported; supported: 'gpt2', 'llama'"
        )
    _add_special_tokens(tokenizer, tokens, metadata.get("tokenizer.ggml.token_type") or [])
    return tokenizer


def build_tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: chat template, special token strings, add_bos/eos flags."""
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    # When the file does not say, follow llama.cpp's defaults: BOS for SentencePiece vocabularies
    # and for the Llama 3 / Tekken pre-tokenizers, none for other byte-level BPE.
    default_add_bos = (
        metadata.get("tokenizer.ggml.model") == "llama"
        or metadata.get("tokenizer.ggml.pre") in _ADD_BOS_PRE_TOKENIZERS
    )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = metadata.get(key)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[name] = tokens[int(token_id)]
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def _vocab(tokens: list[str]) -> dict[str, int]:
    # A duplicated token keeps its last id, as transformers' GGUF tokenizer does.
    return {token: token_id for token_id, token in enumerate(tokens)}


def _parse_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"GGUF merge {merge!r} is not two tokens separated by a space")
        pairs.append((left, right))
    return pairs


def _bpe_tokenizer(**bpe_args: Any) -> Tokenizer:
    try:
        return Tokenizer(BPE(**bpe_args))
    except Exception as exc:  # tokenizers reports e.g. a merge of unknown tokens as a bare Exception
        raise ModelLoadError(f"GGUF vocabulary does not form a valid BPE tokenizer: {exc}") from exc


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre_name = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre_name not in _BYTE_LEVEL_PRE_TOKENIZERS:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre_name!r} is not supported; supported: {sorted(_BYTE_LEVEL_PRE_TOKENIZERS)}"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    tokenizer = _bpe_tokenizer(
        vocab=_vocab(tokens),
        merges=_parse_merges(merges),
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre_name in _IGNORE_MERGES_PRE_TOKENIZERS,
    )
    if pre_name in _NFC_PRE_TOKENIZERS:
        tokenizer.normalizer = normalizers.NFC()  # type: ignore[assignment]
    tokenizer.pre_tokenizer = _BYTE_LEVEL_PRE_TOKENIZERS[pre_name]()  # type: ignore[assignment]
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # type: ignore[assignment]
    tokenizer.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    return tokenizer


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    vocab = _vocab(tokens)
    if metadata.get("tokenizer.ggml.merges"):
        merges = _parse_merges(metadata["tokenizer.ggml.merges"])
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise ModelLoadError("GGUF SentencePiece tokenizer has neither merges nor one score per token")
        merges = merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    tokenizer = _bpe_tokenizer(
        vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True
    )
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # Like transformers' (non-legacy) LlamaTokenizer: "▁" is prepended to the text's first piece
    # only. llama.cpp also prepends after each special token; the two differ only there.
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(  # type: ignore[assignment]
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps: list[decoders.Decoder] = [
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)  # type: ignore[assignment]
    return tokenizer


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens.

    SentencePiece merges the pair whose result scores highest, so merges are ranked by the
    merged token's score (then by shorter left/right piece, as transformers' generate_merges
    does, so both rebuild the same tokenizer).
    """
    # (score, len(left), len(right), -position, left, right): one sort of plain tuples, highest
    # first; -position keeps the splits of equal rank in the order they were found
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for merged, score in scores.items():
        splits = [
            (vocab[left], vocab[right], left, right)
            for cut in range(1, len(merged))
            if (left := merged[:cut]) in vocab and (right := merged[cut:]) in vocab
        ]
        if len(splits) > 1:
            splits.sort()
        for _, _, left, right in splits:
            ranked.append((score, len(left), len(right), -len(ranked), left, right))
    ranked.sort(reverse=True)
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    special: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for token, token_type in zip(tokens, token_types, strict=False):
        if not token:
            continue
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            # Not special, so decoding with skip_special_tokens keeps e.g. <think>, yet still whole.
            user_defined.append(AddedToken(token, special=False, normalized=False))
    if special:
        tokenizer.add_special_tokens(special)
    if user_defined:
        tokenizer.add_tokens(user_defined)
