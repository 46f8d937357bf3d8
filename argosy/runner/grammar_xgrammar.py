"""The xgrammar backend of the grammar seam (see structured.py); xgrammar types stay here.

Vocabulary: built from the model's `tokenizers.Tokenizer`, padded or cut to the model's
vocab_size (the mask width). Special added tokens (`<|im_start|>`, `<|endoftext|>`, …) are
entered as empty strings, which xgrammar treats as special and never allows inside a
grammar — without this they count as their literal text and may appear inside a JSON
string (then vanish from the detokenized output). Stop tokens are the model's EOS ids and
are allowed exactly when the grammar is complete.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
from xgrammar import structural_tag as st

from argosy.errors import InvalidRequestError
from argosy.runner.structured import (
    CompileCache,
    CompiledGrammar,
    GrammarSpec,
    ToolCallGrammar,
    bitmask_words,
    token_bitmask,
)

log = logging.getLogger(__name__)

_CPP_LOCATION = re.compile(r"^\[[0-9:.]+\] \S+:\d+: (Check failed: .*? is false: )?")


class XGrammarBackend:
    """GrammarBackend on xgrammar. Thread-safe: compile from any thread; each guide belongs to
    one request and is driven by the engine thread alone.

    `any_whitespace`: JSON may put any whitespace between tokens (True) or uses the compact
    `, ` / `: ` separators (False). `max_whitespace_cnt` bounds each whitespace run so a small
    model cannot loop on newlines until max_tokens.
    """

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        any_whitespace: bool = True,
        max_whitespace_cnt: int | None = 8,
        max_threads: int = 8,
        cache_max_bytes: int = 256 << 20,
    ) -> None:
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.max_whitespace_cnt = max_whitespace_cnt
        self.tokenizer_info = _tokenizer_info(tokenizer, vocab_size, list(stop_token_ids))
        self.stop_token_ids = list(self.tokenizer_info.stop_token_ids)
        # the cache is ours (keyed by spec, bounded); xgrammar's own would be unbounded
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )
        self.cache = CompileCache(max_bytes=cache_max_bytes)
        self._stop_mask = token_bitmask(self.stop_token_ids, vocab_size)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        key = spec.cache_key()
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        started = time.perf_counter()
        try:
            handle = self._compile(spec)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's C++ errors are RuntimeError
            raise InvalidRequestError(f"Invalid {_describe(spec.kind)}: {_clean(exc)}") from exc
        compiled = CompiledGrammar(spec, handle, time.perf_counter() - started, handle.memory_size_bytes)
        self.cache.put(key, compiled)
        return compiled

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        return self.cache.get(spec.cache_key())

    def guide(self, compiled: CompiledGrammar) -> XGrammarGuide:
        return XGrammarGuide(xgr.GrammarMatcher(compiled.handle), self._stop_mask, self.vocab_size)

    # -- spec -> xgrammar -----------------------------------------------------------------
    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_object":
            return self._json_schema({"type": "object"}, strict=False)
        if spec.kind == "json_schema":
            return self._json_schema(spec.payload, strict=spec.strict)
        if spec.kind == "tool_call":
            return self._compiler.compile_structural_tag(self._tool_call_tag(spec.payload))
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.payload)
        return self._compiler.compile_grammar(spec.payload)  # ebnf, root rule "root"

    def _json_schema(self, schema: dict[str, Any], strict: bool) -> xgr.CompiledGrammar:
        # strict: properties and items the schema does not name are not generated
        return self._compiler.compile_json_schema(
            json.dumps(schema),
            any_whitespace=self.any_whitespace,
            strict_mode=strict,
            max_whitespace_cnt=self.max_whitespace_cnt if self.any_whitespace else None,
        )

    def _tool_call_tag(self, grammar: ToolCallGrammar) -> st.StructuralTag:
        tags = []
        for tool in grammar.tools:
            head = "{" + json.dumps(grammar.name_key) + ": " + json.dumps(tool.name) + ", "
            head += json.dumps(grammar.arguments_key) + ": "
            tags.append(
                st.TagFormat(
                    begin=grammar.begin + head,
                    content=st.JSONSchemaFormat(
                        json_schema=tool.parameters if tool.parameters is not None else {"type": "object"},
                        max_whitespace_cnt=self.max_whitespace_cnt,
                    ),
                    end="}" + grammar.end,
                )
            )
        calls = st.TagsWithSeparatorFormat(
            tags=tags, separator=grammar.separator, at_least_one=True, stop_after_first=not grammar.parallel
        )
        return st.StructuralTag(format=calls)


class XGrammarGuide:
    """One request's matcher. Never raises into the engine:

    - a rejected token returns False and leaves the state where it was (the engine logs it;
      the next masks still follow the grammar from before that token);
    - once the grammar is complete and nothing but a stop token may follow, `is_terminated`
      is True (the engine stops without sampling EOS) and masks allow only stop tokens, as
      they do after a stop token was accepted or if the matcher fails.
    The mask computed to decide "complete, nothing may follow" is kept for the next fill.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, stop_mask: torch.Tensor, vocab_size: int) -> None:
        self._matcher = matcher
        self._stop_mask = stop_mask
        self._next_mask = torch.empty(1, bitmask_words(vocab_size), dtype=torch.int32)
        self._is_next_mask_valid = False
        self._is_complete_only_stop = False
        self._is_failed = False
        self.num_rejected = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._is_failed or self._is_complete_only_stop or self._matcher.is_terminated():
            bitmask[row].copy_(self._stop_mask)
        elif self._is_next_mask_valid:
            bitmask[row].copy_(self._next_mask[0])
        else:
            try:
                self._matcher.fill_next_token_bitmask(bitmask, row)
            except RuntimeError:
                log.exception("grammar mask failed; allowing only stop tokens from here")
                self._is_failed = True
                bitmask[row].copy_(self._stop_mask)

    def accept_token(self, token_id: int) -> bool:
        if self._is_failed or self._matcher.is_terminated():
            return False
        try:
            accepted = self._matcher.accept_token(token_id)
            if not accepted:
                self.num_rejected += 1
                return False
            self._is_next_mask_valid = False
            if self._matcher.is_completed() and not self._matcher.is_terminated():
                self._matcher.fill_next_token_bitmask(self._next_mask, 0)
                self._is_next_mask_valid = True
                self._is_complete_only_stop = not bool((self._next_mask[0] & ~self._stop_mask).any())
        except RuntimeError:
            log.exception("grammar matcher failed on token %d", token_id)
            self._is_failed = True
            return False
        return True

    def is_terminated(self) -> bool:
        return self._is_complete_only_stop or self._matcher.is_terminated()


def _tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    # xgrammar reads the vocabulary type (byte-level / byte-fallback) and prefix-space
    # behaviour from a transformers wrapper; the vocabulary itself we enter ourselves.
    detected = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer),
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids or None,
    )
    encoded_vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded_vocab[token_id] = token
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and token_id < vocab_size:
            encoded_vocab[token_id] = ""
    return xgr.TokenizerInfo(
        encoded_vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(detected.stop_token_ids),
        add_prefix_space=detected.add_prefix_space,
    )


def _describe(kind: str) -> str:
    return {
        "json_object": "JSON object grammar",
        "json_schema": "JSON schema",
        "tool_call": "tool parameters schema",
        "regex": "regular expression",
        "ebnf": "EBNF grammar",
    }[kind]


def _clean(exc: Exception) -> str:
    """xgrammar's C++ message without its timestamp and source location."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return _CPP_LOCATION.sub("", lines[0]) if lines else type(exc).__name__
