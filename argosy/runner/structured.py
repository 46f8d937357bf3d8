"""Grammar-constrained decoding seam.

A `TokenGuide` is a per-request object that says which tokens may come next, as a packed
int32 bitmask (bit j of word i allows token 32*i + j — xgrammar's own layout), and is told
every token actually sampled. The sampler applies the mask before sampling. Backends
(xgrammar, llguidance) live behind this protocol; no backend types leak past this file and
the backend modules it names in `GRAMMAR_BACKENDS` (imported lazily: importing the sampler
must not import a grammar library).

Flow: a `GrammarBackend` is built once per model (`make_grammar_backend`); the request layer
turns `response_format` / a forced tool choice into a `GrammarSpec`, calls `compile` (cached
by the spec's canonical text; may take milliseconds to seconds for a large schema, so call
it off the event loop) and hands `guide(compiled)` — a fresh matcher — to
`engine.add_request(..., guide=...)`. For a thinking model, wrap that guide in
`DelayedGuide` so the reasoning runs free and the grammar starts after `</think>`.

A reasoning budget is a guide too (`ReasoningBudgetGuide`, with or without a grammar after
the reasoning): once the reasoning has run its budget of tokens, only its end marker may come.
"""

from __future__ import annotations

import importlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import torch
from tokenizers import Tokenizer

from argosy.errors import InvalidRequestError


class TokenGuide(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token mask for the next token into `bitmask[row]`."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar rejects it."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete and only an end token may follow."""
        ...


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def token_bitmask(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[words] int32 with exactly the bits of `token_ids` (those below vocab_size) set."""
    bits = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.int64)
    ids = [t for t in token_ids if 0 <= t < vocab_size]
    if ids:
        bits[ids] = 1
    words = (bits.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # bit 31 is the sign bit
    return words.to(torch.int32)


# -- what to constrain to ---------------------------------------------------------------

GrammarKind = Literal["json_object", "json_schema", "tool_call", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_object", "json_schema", "tool_call", "regex", "ebnf")


@dataclass(slots=True)
class ToolSchema:
    name: str
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments; None: any object


@dataclass(slots=True)
class ToolCallGrammar:
    """A forced call in the Hermes shape, one of `tools` per call:

        <tool_call>\\n{"name": "<name>", "arguments": <args matching that tool's schema>}\\n</tool_call>

    The name is fixed text in each alternative, so the arguments are bound to the schema of the
    name actually chosen. `parallel=False`: exactly one call; True: one or more, joined by
    `separator`. Markers are text: a vocabulary that has `<tool_call>` as one ordinary token may
    use it or spell it out; the chat family's parser must accept either.
    """

    tools: list[ToolSchema]
    parallel: bool = False
    begin: str = "<tool_call>\n"
    end: str = "\n</tool_call>"
    separator: str = "\n"
    name_key: str = "name"
    arguments_key: str = "arguments"  # "parameters" for Llama-3-style calls

    def __post_init__(self) -> None:
        if not self.tools:
            raise InvalidRequestError("A forced tool call needs at least one tool.")
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError(f"Tool names must be unique, got {names}.")
        for tool in self.tools:
            if not tool.name:
                raise InvalidRequestError("A tool needs a non-empty name.")
            if tool.parameters is not None and not isinstance(tool.parameters, dict):
                raise InvalidRequestError(
                    f"The parameters of tool {tool.name!r} must be a JSON schema object, "
                    f"got {type(tool.parameters).__name__}."
                )


@dataclass(slots=True)
class GrammarSpec:
    """What a request's output must match; plain data, checked for shape on construction.

    payload by kind: json_object -> None; json_schema -> dict (a JSON schema);
    tool_call -> ToolCallGrammar; regex -> str (the pattern); ebnf -> str (GBNF-style, rule `root`).
    Content errors (an unsupported keyword, a bad regex) surface from `GrammarBackend.compile`.
    """

    kind: GrammarKind
    payload: Any = None
    # json_schema: True generates only what the schema names (no properties or items beyond
    # it: OpenAI's `strict`); False follows JSON Schema's defaults (additional ones allowed).
    strict: bool = True
    _key: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"Unknown grammar kind {self.kind!r}; use one of {', '.join(GRAMMAR_KINDS)}."
            )
        expected: dict[str, type | None] = {
            "json_object": None,
            "json_schema": dict,
            "tool_call": ToolCallGrammar,
            "regex": str,
            "ebnf": str,
        }
        want = expected[self.kind]
        if want is None:
            if self.payload is not None:
                raise InvalidRequestError("A json_object grammar takes no payload.")
        elif not isinstance(self.payload, want):
            what = "a JSON schema must be a JSON object" if want is dict else f"expected {want.__name__}"
            raise InvalidRequestError(
                f"Invalid {self.kind} grammar: {what}, got {type(self.payload).__name__}."
            )
        elif want is str and not self.payload:
            raise InvalidRequestError(f"Invalid {self.kind} grammar: it is empty.")

    def cache_key(self) -> str:
        """Canonical text: separators and escapes normalized, key order kept.

        Key order is kept because it is meaning here: properties are generated in their
        declared order, so two schemas that differ only in order are different grammars.
        """
        if self._key is None:
            payload = asdict(self.payload) if isinstance(self.payload, ToolCallGrammar) else self.payload
            try:
                text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    f"Invalid {self.kind} grammar: not JSON-serialisable ({exc})."
                ) from exc
            loose = "" if self.strict or self.kind != "json_schema" else "loose:"
            self._key = f"{self.kind}:{loose}{text}"
        return self._key


@dataclass(slots=True, eq=False)
class CompiledGrammar:
    """A compiled grammar, shareable by any number of requests; `handle` is backend-private."""

    spec: GrammarSpec
    handle: Any
    compile_s: float  # seconds the compile took (0 for a cache hit, which returns this object)
    memory_bytes: int = 0


class GrammarBackend(Protocol):
    """Built once per model from (tokenizer, vocab_size, stop_token_ids)."""

    name: str

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch from the cache) `spec`; InvalidRequestError naming why it cannot be."""
        ...

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """`spec` compiled if the cache holds it, else None; never compiles (cheap)."""
        ...

    def guide(self, compiled: CompiledGrammar) -> TokenGuide:
        """A fresh per-request matcher at the start of `compiled`."""
        ...


BackendFactory = Callable[..., GrammarBackend]

# name -> "module:attribute"; imported on first use so a server without structured output
# never pays for the grammar library's import.
GRAMMAR_BACKENDS: dict[str, str] = {"xgrammar": "argosy.runner.grammar_xgrammar:XGrammarBackend"}


def make_grammar_backend(
    name: str, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int], **options: Any
) -> GrammarBackend:
    target = GRAMMAR_BACKENDS.get(name)
    if target is None:
        raise ValueError(f"Unknown grammar backend {name!r}; known: {', '.join(sorted(GRAMMAR_BACKENDS))}")
    module_name, _, attribute = target.partition(":")
    factory: BackendFactory = getattr(importlib.import_module(module_name), attribute)
    return factory(tokenizer, vocab_size, stop_token_ids, **options)


class CompileCache:
    """Thread-safe LRU of CompiledGrammar by spec key, bounded by total compiled bytes.

    Requests compile on the server's threads while the engine thread reads guides; two
    threads missing on the same key both compile, and the second result wins (harmless).
    """

    def __init__(self, max_bytes: int = 256 << 20, max_entries: int = 1024) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def get(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.num_misses += 1
                return None
            self._entries.move_to_end(key)
            self.num_hits += 1
            return entry

    def put(self, key: str, compiled: CompiledGrammar) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= old.memory_bytes
            self._entries[key] = compiled
            self._num_bytes += compiled.memory_bytes
            while len(self._entries) > 1 and (
                self._num_bytes > self.max_bytes or len(self._entries) > self.max_entries
            ):
                _, evicted = self._entries.popitem(last=False)
                self._num_bytes -= evicted.memory_bytes

    def __len__(self) -> int:
        return len(self._entries)


class DelayedGuide:
    """Lets everything through until `trigger_token_ids` (e.g. the ids of `</think>`) have just
    been generated, then hands over to `inner` (which starts at the grammar's beginning).

    Invariant: before the trigger `inner` has seen no token. The trigger is matched on token
    ids, so pass the id sequence the model emits: exact for models where the marker is one
    token (Qwen3, DeepSeek-R1); a multi-token marker spelled differently is not seen. Use it
    only when the prompt leaves the model inside its reasoning block.
    """

    def __init__(self, inner: TokenGuide, trigger_token_ids: Sequence[int]) -> None:
        if not trigger_token_ids:
            raise ValueError("DelayedGuide needs a non-empty trigger sequence")
        self.inner = inner
        self.trigger_token_ids = tuple(trigger_token_ids)
        self._recent: list[int] = []
        self.is_active = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.is_active:
            self.inner.fill_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)

    def accept_token(self, token_id: int) -> bool:
        if self.is_active:
            return self.inner.accept_token(token_id)
        self._recent.append(token_id)
        del self._recent[: -len(self.trigger_token_ids)]
        self.is_active = tuple(self._recent) == self.trigger_token_ids
        return True

    def is_terminated(self) -> bool:
        return self.is_active and self.inner.is_terminated()


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set `token_id`'s bit in `bitmask[row]` (bit 31 of a word is its sign bit)."""
    word, bit = divmod(token_id, 32)
    if 0 <= word < bitmask.shape[1]:
        bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)


class OptionalReasoningGuide:
    """For a model that may open its output with a reasoning block, or may not: the first
    token is `start_token_id` (the reasoning marker, e.g. Qwen3's `<think>`) or any token
    `inner` allows. After the marker everything is free until `end_token_ids` (a
    DelayedGuide), then `inner` from its beginning; without it, `inner` from the first token.
    """

    def __init__(self, inner: TokenGuide, start_token_id: int, end_token_ids: Sequence[int]) -> None:
        self.inner = inner
        self.start_token_id = start_token_id
        self._delayed = DelayedGuide(inner, end_token_ids)
        self._state = "first"  # "first" | "reasoning" | "grammar"

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == "reasoning":
            self._delayed.fill_bitmask(bitmask, row)
            return
        self.inner.fill_bitmask(bitmask, row)
        if self._state == "first":
            allow_token(bitmask, row, self.start_token_id)

    def accept_token(self, token_id: int) -> bool:
        if self._state == "first":
            if token_id == self.start_token_id:
                self._state = "reasoning"
                return True
            self._state = "grammar"
        if self._state == "reasoning":
            return self._delayed.accept_token(token_id)
        return self.inner.accept_token(token_id)

    def is_terminated(self) -> bool:
        if self._state == "reasoning":
            return self._delayed.is_terminated()
        return self._state == "grammar" and self.inner.is_terminated()


class ReasoningBudgetGuide:
    """Holds a reasoning block to at most `max_reasoning_tokens` tokens: once it has that
    many, only its end marker may come (`end_token_ids`, one token at a time, from wherever
    the model's own tokens left the marker), then the answer follows under `inner` (a
    grammar's guide, from its beginning) or free (`inner` None).

    Where the reasoning starts: in the prompt (`start_token_id` None: the first output token
    is reasoning), or, if the model opens it, with `start_token_id` as the first output token
    (then the first token is that marker or any token `inner` allows; no marker: no reasoning,
    the answer from the first token). Reasoning tokens are those between the markers; the
    count never includes a marker's. Invariant: `inner` sees only the answer's tokens. Markers
    are matched on token ids, as DelayedGuide's trigger is.
    """

    def __init__(
        self,
        inner: TokenGuide | None,
        end_token_ids: Sequence[int],
        max_reasoning_tokens: int,
        start_token_id: int | None = None,
    ) -> None:
        if not end_token_ids:
            raise ValueError("ReasoningBudgetGuide needs a non-empty end marker")
        if max_reasoning_tokens < 0:
            raise ValueError("max_reasoning_tokens must be >= 0")
        self.inner = inner
        self.end_token_ids = tuple(end_token_ids)
        self.max_reasoning_tokens = max_reasoning_tokens
        self.start_token_id = start_token_id
        self._state = "first" if start_token_id is not None else "reasoning"  # | "answer"
        self._num_tokens = 0  # tokens since the reasoning started (the end marker's too)
        self._num_matched = 0  # how many of the end marker's first tokens end the output
        self._recent: list[int] = []  # the reasoning's last tokens (as many as the marker has)

    @property
    def num_reasoning_tokens(self) -> int:
        """Reasoning tokens so far, not counting any part of the end marker."""
        return self._num_tokens - self._num_matched

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == "reasoning":
            # counted with a partial end marker: if the marker broke off, its tokens would be
            # reasoning, past the budget
            if self._num_tokens >= self.max_reasoning_tokens:
                bitmask[row].fill_(0)
                allow_token(bitmask, row, self.end_token_ids[self._num_matched])
            else:
                bitmask[row].fill_(-1)
            return
        if self.inner is None:
            bitmask[row].fill_(-1)
            return
        self.inner.fill_bitmask(bitmask, row)
        if self._state == "first":
            assert self.start_token_id is not None
            allow_token(bitmask, row, self.start_token_id)

    def accept_token(self, token_id: int) -> bool:
        if self._state == "first":
            if token_id == self.start_token_id:
                self._state = "reasoning"
                return True
            self._state = "answer"
        if self._state == "answer":
            return True if self.inner is None else self.inner.accept_token(token_id)
        self._num_tokens += 1
        self._recent.append(token_id)
        del self._recent[: -len(self.end_token_ids)]
        # the longest start of the marker the output ends with
        self._num_matched = next(
            (k for k in range(len(self._recent), 0, -1) if self._recent[-k:] == list(self.end_token_ids[:k])),
            0,
        )
        if self._num_matched == len(self.end_token_ids):
            self._state = "answer"
        return True

    def is_terminated(self) -> bool:
        return self._state == "answer" and self.inner is not None and self.inner.is_terminated()


@dataclass(slots=True)
class GuideSpec:
    """A request's token guide as plain data: the grammar, how it sits around a thinking
    model's reasoning block, and the reasoning's budget. It crosses the core/engine seam (and
    could cross a process); the engine compiles the grammar and builds the guide (`build_guide`).

    reasoning: "none" — the grammar holds from the first token; "delayed" — the prompt opened
    the reasoning block, the grammar starts after `end_token_ids` (DelayedGuide); "optional" —
    the model may open one with `start_token_id` first (OptionalReasoningGuide).
    max_reasoning_tokens: the reasoning is held to that many tokens (ReasoningBudgetGuide;
    needs a reasoning mode other than "none"); with it the grammar may be None (no grammar:
    the answer is free).
    """

    grammar: GrammarSpec | None
    reasoning: str = "none"
    start_token_id: int | None = None
    end_token_ids: tuple[int, ...] = ()
    max_reasoning_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.reasoning not in ("none", "delayed", "optional"):
            raise ValueError(f"unknown reasoning mode {self.reasoning!r}")
        if self.reasoning != "none" and not self.end_token_ids:
            raise ValueError(f"reasoning mode {self.reasoning!r} needs end_token_ids")
        if self.reasoning == "optional" and self.start_token_id is None:
            raise ValueError("reasoning mode 'optional' needs start_token_id")
        if self.max_reasoning_tokens is not None and self.reasoning == "none":
            raise ValueError("max_reasoning_tokens needs a reasoning mode")
        if self.grammar is None and self.max_reasoning_tokens is None:
            raise ValueError("a guide needs a grammar or a reasoning budget")


def build_guide(spec: GuideSpec, inner: TokenGuide | None) -> TokenGuide:
    """The guide `spec` describes around `inner` (a fresh matcher of its grammar; None when
    the spec has no grammar)."""
    if spec.max_reasoning_tokens is not None:
        start = spec.start_token_id if spec.reasoning == "optional" else None
        return ReasoningBudgetGuide(inner, spec.end_token_ids, spec.max_reasoning_tokens, start)
    assert inner is not None, "a guide without a reasoning budget has a grammar"
    if spec.reasoning == "delayed":
        return DelayedGuide(inner, spec.end_token_ids)
    if spec.reasoning == "optional":
        assert spec.start_token_id is not None
        return OptionalReasoningGuide(inner, spec.start_token_id, spec.end_token_ids)
    return inner
