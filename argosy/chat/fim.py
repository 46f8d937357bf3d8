"""Fill-in-the-middle: the prompt a code model completes between a prefix and a suffix, in its
own tokens.

A model has a FIM dialect when its tokenizer holds one of the known token sets; each family's
order is its own:

    StarCoder, SantaCoder   <fim_prefix>P<fim_suffix>S<fim_middle>           (prefix-suffix-middle)
    Qwen2.5-Coder           <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>
    CodeLlama               ▁<PRE> P ▁<SUF>S ▁<MID>                       (stops at ▁<EOT>)
    DeepSeek-Coder          <｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>
    Codestral               [SUFFIX]S[PREFIX]P                          (suffix-prefix-middle)

Generation stops at the end-of-sequence tokens and at the family's FIM end markers (a pad,
file-separator or EOT token), so the middle comes back alone. The prefix and suffix are
tokenized without special tokens (a `<fim_…>` string inside the user's code stays text); the
BOS goes first where the tokenizer adds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer


@dataclass(frozen=True, slots=True)
class FimDialect:
    family: str
    prefix_id: int
    suffix_id: int
    middle_id: int | None  # None: suffix-prefix-middle with no middle token (Codestral)
    suffix_first: bool
    stop_ids: tuple[int, ...]
    # the model's tokenizer with its special tokens read as plain text (the user's code)
    text_tokenizer: Tokenizer = field(repr=False, compare=False)

    def prompt_ids(self, prefix: str, suffix: str, bos_id: int | None) -> list[int]:
        def text(value: str) -> list[int]:
            return list(self.text_tokenizer.encode(value, add_special_tokens=False).ids) if value else []

        head = [bos_id] if bos_id is not None else []
        if self.suffix_first:
            ids = [*head, self.suffix_id, *text(suffix), self.prefix_id, *text(prefix)]
        else:
            ids = [*head, self.prefix_id, *text(prefix), self.suffix_id, *text(suffix)]
        return ids + ([self.middle_id] if self.middle_id is not None else [])


# (family, prefix, suffix, middle, suffix first, end markers)
_KNOWN: tuple[tuple[str, str, str, str | None, bool, tuple[str, ...]], ...] = (
    (
        "starcoder",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        False,
        ("<fim_pad>", "<file_sep>", "<|endoftext|>"),
    ),
    (
        "qwen",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        False,
        ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>"),
    ),
    ("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", False, ("▁<EOT>",)),
    ("codellama", "<PRE>", "<SUF>", "<MID>", False, ("<EOT>",)),
    (
        "deepseek",
        "<｜fim▁begin｜>",
        "<｜fim▁hole｜>",
        "<｜fim▁end｜>",
        False,
        ("<|EOT|>", "<｜end▁of▁sentence｜>"),
    ),
    ("codestral", "[PREFIX]", "[SUFFIX]", None, True, ()),
)


def fim_dialect(tokenizer: Tokenizer) -> FimDialect | None:
    """The model's FIM dialect, from the tokens its tokenizer holds (None: it has none)."""
    for family, prefix, suffix, middle, suffix_first, ends in _KNOWN:
        prefix_id, suffix_id = tokenizer.token_to_id(prefix), tokenizer.token_to_id(suffix)
        middle_id = tokenizer.token_to_id(middle) if middle is not None else None
        if prefix_id is None or suffix_id is None or (middle is not None and middle_id is None):
            continue
        stops = tuple(i for i in (tokenizer.token_to_id(end) for end in ends) if i is not None)
        text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        text_tokenizer.encode_special_tokens = True
        return FimDialect(family, prefix_id, suffix_id, middle_id, suffix_first, stops, text_tokenizer)
    return None
