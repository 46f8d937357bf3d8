"""Fill-in-the-middle: the prompt a code model completes between a prefix and a suffix, in its
own tokens.

A model has a FIM dialect when its tokenizer holds one of the known token sets; each family's
order is its own:

    StarCoder, SantaCoder   <fim_prefix>P<fim_suffix>S<fim_middle>           (prefix-suffix-middle)
    Qwen2.5-Coder           <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>
    CodeLlama               ▁<PRE> P ▁<SUF>S ▁<MID>                       (stops at ▁<EOT>)
    DeepSeek-Coder          <｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>
    Codestral               [SUFFIX]S[PREFIX]P                          (suffix-prefix-middle)

`fim_mode` (a request's choice of layout, the two of the FIM paper, Bavarian et al. 2022):
"psm" (prefix-suffix-middle) or "spm" (suffix-prefix-middle: `<pre><suf>S<mid>P`, the
layout StarCoder and CodeLlama were also trained on). A family is served only in the layouts
it was trained on (`modes`, its native one first): another is answered in the native layout
and named degraded by the dialect, since a layout the model never saw gives it noise.

Generation stops at the end-of-sequence tokens and at the family's FIM end markers (a pad,
file-separator, repository or EOT token: llama.cpp's end-of-generation set for the family), so
the middle comes back alone. The prefix and suffix are tokenized without special tokens (a
`<fim_…>` string inside the user's code stays text); the BOS goes first where the tokenizer
adds one.

A suffix request that names no max_tokens gets FIM_DEFAULT_MAX_TOKENS (the reference's 128:
an editor's inline completion is a few lines, and without a cap a code model that does not
stop writes to the end of its context), unless the operator set a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

FIM_MODES = ("psm", "spm")
FIM_DEFAULT_MAX_TOKENS = 128


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
    modes: tuple[str, ...] = ("psm",)  # the layouts it was trained on, its native one first

    def honours(self, mode: str | None) -> bool:
        """Whether a request's `fim_mode` is served as asked (None: the native layout)."""
        return mode is None or mode in self.modes

    def prompt_ids(self, prefix: str, suffix: str, bos_id: int | None, mode: str | None = None) -> list[int]:
        """The FIM prompt in `mode`'s layout where the family honours it, else its native one."""

        def text(value: str) -> list[int]:
            return list(self.text_tokenizer.encode(value, add_special_tokens=False).ids) if value else []

        head = [bos_id] if bos_id is not None else []
        layout = mode if mode is not None and mode in self.modes else self.modes[0]
        if self.suffix_first:  # Codestral: [SUFFIX]S[PREFIX]P, no middle token
            return [*head, self.suffix_id, *text(suffix), self.prefix_id, *text(prefix)]
        assert self.middle_id is not None
        if layout == "spm":
            return [*head, self.prefix_id, self.suffix_id, *text(suffix), self.middle_id, *text(prefix)]
        return [*head, self.prefix_id, *text(prefix), self.suffix_id, *text(suffix), self.middle_id]


@dataclass(frozen=True, slots=True)
class _Family:
    name: str
    prefix: str
    suffix: str
    middle: str | None
    ends: tuple[str, ...]  # FIM end markers, beside the model's own end-of-sequence
    modes: tuple[str, ...] = ("psm",)
    suffix_first: bool = False


_KNOWN: tuple[_Family, ...] = (
    _Family(
        "starcoder",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        ("<fim_pad>", "<file_sep>", "<|endoftext|>"),
        modes=("psm", "spm"),
    ),
    # llama.cpp ends Qwen's generations at its EOS/EOT tokens and at the FIM pad, repository
    # and file-separator tokens (a model done with the gap starts the next file)
    _Family(
        "qwen",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<|im_end|>"),
    ),
    _Family("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", ("▁<EOT>",), modes=("psm", "spm")),
    _Family("codellama", "<PRE>", "<SUF>", "<MID>", ("<EOT>",), modes=("psm", "spm")),
    _Family(
        "deepseek",
        "<｜fim▁begin｜>",
        "<｜fim▁hole｜>",
        "<｜fim▁end｜>",
        ("<|EOT|>", "<｜end▁of▁sentence｜>"),
    ),
    _Family("codestral", "[PREFIX]", "[SUFFIX]", None, (), modes=("spm",), suffix_first=True),
)


def fim_dialect(tokenizer: Tokenizer) -> FimDialect | None:
    """The model's FIM dialect, from the tokens its tokenizer holds (None: it has none)."""
    for family in _KNOWN:
        prefix_id, suffix_id = tokenizer.token_to_id(family.prefix), tokenizer.token_to_id(family.suffix)
        middle_id = tokenizer.token_to_id(family.middle) if family.middle is not None else None
        if prefix_id is None or suffix_id is None or (family.middle is not None and middle_id is None):
            continue
        stops = tuple(i for i in (tokenizer.token_to_id(end) for end in family.ends) if i is not None)
        text_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        text_tokenizer.encode_special_tokens = True
        return FimDialect(
            family.name,
            prefix_id,
            suffix_id,
            middle_id,
            family.suffix_first,
            stops,
            text_tokenizer,
            family.modes,
        )
    return None


def fim_max_tokens(operator_max_tokens: int | None, context_length: int, prompt_len: int) -> int | None:
    """The max_tokens of a suffix request that names none: None where the operator set a
    default (it applies, as to any request) or the prompt leaves no room (the usual 400
    follows), else FIM_DEFAULT_MAX_TOKENS clamped to the room the prompt leaves."""
    room = context_length - prompt_len
    if operator_max_tokens is not None or room < 1:
        return None
    return min(FIM_DEFAULT_MAX_TOKENS, room)
