"""The grammar seam (runner/structured.py) on xgrammar, with SmolLM2's real tokenizer.

Guides are driven without the model by a seeded walk over the tokens each mask allows, so
every output is one the grammar permits; the decoded text must then parse and validate.
The last test runs the real model through the engine with guides attached.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from argosy.errors import InvalidRequestError
from argosy.models.loader import resolve_model
from argosy.models.source import ModelSource
from argosy.runner.structured import (
    DelayedGuide,
    GrammarBackend,
    GrammarSpec,
    TokenGuide,
    ToolCallGrammar,
    ToolSchema,
    bitmask_words,
    make_grammar_backend,
    token_bitmask,
    unpack_bitmask,
)

pytest.importorskip("xgrammar")

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "pets": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"kind": {"type": "string", "maxLength": 20}, "legs": {"type": "integer"}},
                "required": ["kind", "legs"],
            },
        },
    },
    "required": ["name", "age", "color", "pets"],
}
WEATHER = ToolSchema(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
    },
)
NOOP = ToolSchema("noop")  # no parameters schema: any object
TOOL_CALL = re.compile(r'<tool_call>\n(\{"name": .*?\})\n</tool_call>', re.DOTALL)


# -- fixtures and helpers ----------------------------------------------------------------
@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def backend(source: ModelSource) -> GrammarBackend:
    started = time.perf_counter()
    backend = make_grammar_backend("xgrammar", source.tokenizer, source.vocab_size, source.eos_token_ids)
    print(f"\nxgrammar backend for smollm2 (import + vocabulary): {time.perf_counter() - started:.2f} s")
    return backend


@pytest.fixture(scope="module")
def closers(source: ModelSource) -> set[int]:
    """Tokens whose text can end a string, value, object or array: the walk favours them so
    unbounded strings and nesting end within a few dozen tokens."""
    tokenizer = source.tokenizer
    return {i for i in range(source.vocab_size) if any(c in tokenizer.decode([i]) for c in '"}],')}


def new_mask(vocab_size: int) -> torch.Tensor:
    return torch.full((1, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def allowed_ids(guide: TokenGuide, vocab_size: int) -> list[int]:
    mask = new_mask(vocab_size)
    guide.fill_bitmask(mask, 0)
    return unpack_bitmask(mask, vocab_size)[0].nonzero().flatten().tolist()


def special_ids(source: ModelSource) -> set[int]:
    return {i for i, t in source.tokenizer.get_added_tokens_decoder().items() if t.special}


def walk(
    guide: TokenGuide,
    source: ModelSource,
    rng: random.Random,
    closers: set[int],
    max_steps: int = 600,
) -> list[int]:
    """Seeded random walk over allowed tokens until the guide terminates; returns the tokens.

    Checks on the way: every mask is non-empty, never allows a special token other than EOS,
    and every chosen token is accepted.
    """
    forbidden = special_ids(source) - set(source.eos_token_ids)
    mask = new_mask(source.vocab_size)
    token_ids: list[int] = []
    while not guide.is_terminated():
        assert len(token_ids) < max_steps, "walk did not terminate"
        guide.fill_bitmask(mask, 0)
        allowed = unpack_bitmask(mask, source.vocab_size)[0].nonzero().flatten().tolist()
        assert allowed, "the grammar allows nothing"
        assert not forbidden & set(allowed), "a special token is allowed inside the grammar"
        closing = [t for t in allowed if t in closers]
        token_id = rng.choice(closing if closing and rng.random() < 0.5 else allowed)
        assert guide.accept_token(token_id)
        token_ids.append(token_id)
        if token_id in source.eos_token_ids:
            break
    return token_ids


def check_schema(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """The subset of JSON Schema the tests use (jsonschema is not a dependency); strict like
    the backend: an object has no property its schema does not name."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), f"{path}: not an object"
        properties = schema.get("properties")
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        if properties is not None:
            for key, item in value.items():
                assert key in properties, f"{path}: unexpected {key!r}"
                check_schema(item, properties[key], f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{path}: not an array"
        assert len(value) <= schema.get("maxItems", len(value))
        for i, item in enumerate(value):
            check_schema(item, schema.get("items", {}), f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str), f"{path}: not a string"
        assert len(value) <= schema.get("maxLength", len(value)), f"{path}: too long"
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: not an integer"
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: out of range"


def check_tool_calls(text: str, tools: list[ToolSchema], parallel: bool) -> list[dict[str, Any]]:
    calls = TOOL_CALL.findall(text)
    assert "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) == text, text
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    by_name = {tool.name: tool for tool in tools}
    parsed = []
    for body in calls:
        call = json.loads(body)
        assert list(call) == ["name", "arguments"]
        tool = by_name[call["name"]]
        check_schema(call["arguments"], tool.parameters or {"type": "object"})
        parsed.append(call)
    return parsed


def vocab_id(source: ModelSource, token: str) -> int:
    token_id = source.tokenizer.token_to_id(token)
    assert token_id is not None, token
    return int(token_id)


def decode(source: ModelSource, token_ids: list[int]) -> str:
    text: str = source.tokenizer.decode(token_ids, skip_special_tokens=True)
    return text


# -- specs and errors --------------------------------------------------------------------
@pytest.mark.parametrize("payload", [[{"type": "string"}], '{"type": "object"}', True, None])
def test_schema_that_is_not_an_object_is_rejected(payload: Any) -> None:
    with pytest.raises(InvalidRequestError, match="JSON schema must be a JSON object"):
        GrammarSpec("json_schema", payload)


def test_malformed_specs_are_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="Unknown grammar kind"):
        GrammarSpec("yaml")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="empty"):
        GrammarSpec("regex", "")
    with pytest.raises(InvalidRequestError, match="takes no payload"):
        GrammarSpec("json_object", {"type": "object"})
    with pytest.raises(InvalidRequestError, match="at least one tool"):
        ToolCallGrammar([])
    with pytest.raises(InvalidRequestError, match="unique"):
        ToolCallGrammar([NOOP, NOOP])
    with pytest.raises(InvalidRequestError, match="must be a JSON schema object"):
        ToolCallGrammar([ToolSchema("f", ["x"])])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (GrammarSpec("json_schema", {"type": "foo"}), 'Invalid JSON schema: Unsupported type "foo"'),
        (GrammarSpec("json_schema", {"type": "object", "properties": 5}), "properties must be an object"),
        (GrammarSpec("json_schema", {"type": "object", "required": "name"}), "required must be an array"),
        (GrammarSpec("json_schema", {"$ref": "#/$defs/missing"}), "missing"),
        (GrammarSpec("json_schema", {"type": "string", "pattern": "(["}), "Regex parsing error"),
        (GrammarSpec("regex", "a(b"), "Invalid regular expression"),
        (GrammarSpec("ebnf", "root ::= missing_rule"), 'Rule "missing_rule" is not defined'),
        (
            GrammarSpec("tool_call", ToolCallGrammar([ToolSchema("f", {"type": "bogus"})])),
            "Invalid tool parameters schema",
        ),
    ],
)
def test_uncompilable_spec_raises_invalid_request(
    backend: GrammarBackend, spec: GrammarSpec, reason: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        backend.compile(spec)
    assert reason in info.value.message
    assert "/project/" not in info.value.message and not info.value.message.startswith("[")
    assert info.value.param is None  # the caller knows which request field it came from


def test_compile_cache(backend: GrammarBackend) -> None:
    schema = dict(PERSON_SCHEMA, title="cache-test")
    first = backend.compile(GrammarSpec("json_schema", schema))
    started = time.perf_counter()
    again = backend.compile(GrammarSpec("json_schema", json.loads(json.dumps(schema, indent=4))))
    cached_s = time.perf_counter() - started
    assert again is first and first.compile_s > 0
    reordered = dict(reversed(list(schema.items())))  # property order is meaning: a new grammar
    assert backend.compile(GrammarSpec("json_schema", reordered)) is not first
    print(
        f"\ncompile json_schema: first {first.compile_s * 1e3:.2f} ms, cached {cached_s * 1e3:.3f} ms "
        f"({first.memory_bytes / 1024:.0f} KiB)"
    )
    tools = GrammarSpec("tool_call", ToolCallGrammar([WEATHER, NOOP], parallel=True))
    compiled = backend.compile(tools)
    assert (
        backend.compile(GrammarSpec("tool_call", ToolCallGrammar([WEATHER, NOOP], parallel=True))) is compiled
    )
    assert backend.compile(GrammarSpec("tool_call", ToolCallGrammar([WEATHER, NOOP]))) is not compiled
    print(f"compile tool_call (2 tools, parallel): first {compiled.compile_s * 1e3:.2f} ms")


# -- walks: every permitted output parses and validates ----------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_json_object_walk(backend: GrammarBackend, source: ModelSource, closers: set[int], seed: int) -> None:
    guide = backend.guide(backend.compile(GrammarSpec("json_object")))
    text = decode(source, walk(guide, source, random.Random(seed), closers))
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", range(20))
def test_json_schema_walk(backend: GrammarBackend, source: ModelSource, closers: set[int], seed: int) -> None:
    guide = backend.guide(backend.compile(GrammarSpec("json_schema", PERSON_SCHEMA)))
    text = decode(source, walk(guide, source, random.Random(seed), closers))
    check_schema(json.loads(text), PERSON_SCHEMA)
    assert list(json.loads(text)) == ["name", "age", "color", "pets"]  # declared order


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("parallel", [False, True])
def test_tool_call_walk(
    backend: GrammarBackend, source: ModelSource, closers: set[int], seed: int, parallel: bool
) -> None:
    spec = GrammarSpec("tool_call", ToolCallGrammar([WEATHER, NOOP], parallel=parallel))
    guide = backend.guide(backend.compile(spec))
    token_ids = walk(guide, source, random.Random(seed), closers)
    check_tool_calls(decode(source, token_ids), [WEATHER, NOOP], parallel)


@pytest.mark.parametrize("seed", range(5))
def test_regex_and_ebnf_walks(
    backend: GrammarBackend, source: ModelSource, closers: set[int], seed: int
) -> None:
    pattern = r"[a-z]{3}-\d{2}"
    text = decode(
        source,
        walk(
            backend.guide(backend.compile(GrammarSpec("regex", pattern))),
            source,
            random.Random(seed),
            closers,
        ),
    )
    assert re.fullmatch(pattern, text), text
    grammar = 'root ::= answer " " ("yes" | "no")\nanswer ::= "Answer:"'
    text = decode(
        source,
        walk(
            backend.guide(backend.compile(GrammarSpec("ebnf", grammar))), source, random.Random(seed), closers
        ),
    )
    assert text in ("Answer: yes", "Answer: no")


@pytest.fixture(scope="module")
def token_texts(source: ModelSource) -> list[str]:
    """Each token's text on its own ("" for special tokens: skip_special_tokens)."""
    return [source.tokenizer.decode([i]) for i in range(source.vocab_size)]


def test_masks_allow_exactly_what_the_regex_allows(
    backend: GrammarBackend, source: ModelSource, token_texts: list[str]
) -> None:
    """At every state of `[a-z]{3}-\\d{2}` the mask equals an independent oracle: the tokens
    whose text extends the text so far to a viable prefix of the language (Python's `re` on
    decoded token texts, not xgrammar), plus EOS once the text is complete."""
    viable = re.compile(r"[a-z]{0,3}|[a-z]{3}-[0-9]{0,2}")
    complete = re.compile(r"[a-z]{3}-[0-9]{2}")
    guide = backend.guide(backend.compile(GrammarSpec("regex", r"[a-z]{3}-\d{2}")))
    text = ""
    for char in "abc-1":  # one single-character token per step: every state of the pattern
        expected = {i for i, t in enumerate(token_texts) if t and viable.fullmatch(text + t)}
        if complete.fullmatch(text):
            expected |= set(source.eos_token_ids)
        assert not guide.is_terminated()
        assert set(allowed_ids(guide, source.vocab_size)) == expected, text
        feed(guide, [vocab_id(source, char)])
        text += char
    feed(guide, [vocab_id(source, "2")])
    assert guide.is_terminated()  # "abc-12": complete, and nothing may follow
    assert allowed_ids(guide, source.vocab_size) == source.eos_token_ids


def test_mask_inside_an_enum_allows_exactly_its_values_prefixes(
    backend: GrammarBackend, source: ModelSource, token_texts: list[str]
) -> None:
    guide = backend.guide(backend.compile(GrammarSpec("json_schema", PERSON_SCHEMA)))
    head = '{"name": "Ann", "age": 42, "color": "'
    feed(guide, source.tokenizer.encode(head, add_special_tokens=False).ids)
    values = [f'{value}"' for value in PERSON_SCHEMA["properties"]["color"]["enum"]]
    # no SmolLM2 token runs past a value's closing quote, so the oracle needs no JSON after it
    assert not [t for t in token_texts if any(t.startswith(v) and t != v for v in values)]
    expected = {i for i, t in enumerate(token_texts) if t and any(v.startswith(t) for v in values)}
    assert {token_texts[i] for i in expected} >= {"r", "red", "g", "green", "b", "blue"}
    assert set(allowed_ids(guide, source.vocab_size)) == expected


# -- termination, rejection, delayed start -----------------------------------------------
def feed(guide: TokenGuide, token_ids: list[int]) -> None:
    for token_id in token_ids:
        assert guide.accept_token(token_id), token_id


def test_after_completion_only_eos(backend: GrammarBackend, source: ModelSource) -> None:
    guide = backend.guide(backend.compile(GrammarSpec("json_object")))
    feed(guide, source.tokenizer.encode('{"a": [1, 2]', add_special_tokens=False).ids)
    assert not guide.is_terminated()
    assert 2 not in allowed_ids(guide, source.vocab_size)  # EOS only once the grammar is complete
    feed(guide, source.tokenizer.encode("}", add_special_tokens=False).ids)
    assert guide.is_terminated()  # complete and nothing but EOS may follow: the engine stops here
    assert allowed_ids(guide, source.vocab_size) == source.eos_token_ids
    assert guide.accept_token(source.eos_token_ids[0])  # a sampled EOS is still fine
    assert guide.is_terminated()
    assert allowed_ids(guide, source.vocab_size) == source.eos_token_ids
    assert guide.accept_token(vocab_id(source, "a")) is False


def test_complete_but_continuable_is_not_terminated(backend: GrammarBackend, source: ModelSource) -> None:
    guide = backend.guide(backend.compile(GrammarSpec("regex", "a+")))
    feed(guide, [vocab_id(source, "a")])
    assert not guide.is_terminated()
    allowed = allowed_ids(guide, source.vocab_size)
    assert 2 in allowed and vocab_id(source, "a") in allowed
    feed(guide, [2])
    assert guide.is_terminated()


def test_rejected_token_returns_false(backend: GrammarBackend, source: ModelSource) -> None:
    guide = backend.guide(backend.compile(GrammarSpec("json_schema", PERSON_SCHEMA)))
    before = allowed_ids(guide, source.vocab_size)
    hello = vocab_id(source, "hello")
    assert hello not in before
    assert guide.accept_token(hello) is False
    assert guide.accept_token(source.vocab_size + 7) is False  # out of range
    assert guide.accept_token(1) is False  # <|im_start|>: special
    assert guide.accept_token(2) is False  # EOS before the grammar is complete
    assert allowed_ids(guide, source.vocab_size) == before  # the state did not move
    assert not guide.is_terminated()
    feed(guide, source.tokenizer.encode('{"name": "Ann"', add_special_tokens=False).ids)


def test_forced_single_call_ends_after_one(backend: GrammarBackend, source: ModelSource) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    single = backend.guide(backend.compile(GrammarSpec("tool_call", ToolCallGrammar([WEATHER, NOOP]))))
    feed(single, source.tokenizer.encode(text, add_special_tokens=False).ids)
    assert single.is_terminated() and allowed_ids(single, source.vocab_size) == [2]

    parallel = backend.guide(
        backend.compile(GrammarSpec("tool_call", ToolCallGrammar([WEATHER, NOOP], parallel=True)))
    )
    feed(parallel, source.tokenizer.encode(text, add_special_tokens=False).ids)
    assert not parallel.is_terminated()
    allowed = allowed_ids(parallel, source.vocab_size)
    assert 2 in allowed and vocab_id(source, "Ċ") in allowed  # EOS, or "\n" + next call
    second = '\n<tool_call>\n{"name": "noop", "arguments": {"anything": [1]}}\n</tool_call>'
    feed(parallel, source.tokenizer.encode(second, add_special_tokens=False).ids)
    feed(parallel, [2])
    assert parallel.is_terminated()


def test_unknown_tool_name_is_not_allowed(backend: GrammarBackend, source: ModelSource) -> None:
    guide = backend.guide(backend.compile(GrammarSpec("tool_call", ToolCallGrammar([WEATHER]))))
    feed(guide, source.tokenizer.encode('<tool_call>\n{"name": "', add_special_tokens=False).ids)
    decoded = {source.tokenizer.decode([t]) for t in allowed_ids(guide, source.vocab_size)}
    assert decoded and all("get_weather".startswith(d) for d in decoded), decoded


def test_delayed_guide(backend: GrammarBackend, source: ModelSource, closers: set[int]) -> None:
    encode = source.tokenizer.encode
    trigger = encode("</think>", add_special_tokens=False).ids
    assert len(trigger) > 1  # a multi-token marker for this vocabulary
    compiled = backend.compile(GrammarSpec("json_schema", PERSON_SCHEMA))
    guide = DelayedGuide(backend.guide(compiled), trigger)
    vocab = source.vocab_size
    thinking = encode("Let me think: {not json] </thin k> and </", add_special_tokens=False).ids
    for token_id in thinking:
        mask = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
        guide.fill_bitmask(mask, 0)
        assert bool(unpack_bitmask(mask, vocab).all())  # everything is allowed while thinking
        assert guide.accept_token(token_id)
    assert not guide.is_active and not guide.is_terminated()
    feed(guide, trigger)
    assert guide.is_active
    assert allowed_ids(guide, vocab) == allowed_ids(backend.guide(compiled), vocab)  # grammar from its start
    after = walk(guide, source, random.Random(0), closers)
    check_schema(json.loads(decode(source, after)), PERSON_SCHEMA)
    assert guide.is_terminated()


def test_token_bitmask_matches_unpack() -> None:
    mask = token_bitmask([0, 31, 32, 63, 99, 1000], 100)
    assert mask.shape == (bitmask_words(100),) and mask.dtype == torch.int32
    assert unpack_bitmask(mask.unsqueeze(0), 100)[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 99]


# -- end to end: the real model through the engine ---------------------------------------
@pytest.mark.slow
def test_engine_generates_valid_json_and_tool_calls(backend: GrammarBackend) -> None:
    """Sampled at temperature 0.7: which tokens come out depends on the CPU's bf16 rounding,
    and neither grammar bounds its length (NOOP takes any object, `legs` any integer), so a
    request may end with "length" on one machine and "stop" on another. Either way, every
    token must be one the grammar allowed (a fresh guide accepts them all), and the finish
    reason must agree with the grammar's state: "stop" exactly when it is complete (then
    the text parses and validates), "length" only at max_tokens with the grammar still open.
    """
    from argosy import LLM, SamplingParams

    llm = LLM("smollm2", quantization="none", compile="off")
    engine = llm.engine
    source = engine.source

    def chat(user: str) -> list[int]:
        return engine.encode(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")

    person = backend.compile(GrammarSpec("json_schema", PERSON_SCHEMA))
    call = backend.compile(GrammarSpec("tool_call", ToolCallGrammar([WEATHER, NOOP])))
    requests: dict[str, tuple[str, Any]] = {}
    max_tokens = 200
    for seed in range(3):
        requests[f"person-{seed}"] = ("person", person)
        requests[f"call-{seed}"] = ("call", call)
    prompts = {
        "person": chat("Describe a person and their pets as JSON."),
        "call": chat("What is the weather in Paris? Use a tool."),
    }
    for request_id, (kind, compiled) in requests.items():
        seed = int(request_id.rsplit("-", 1)[1])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=seed)
        engine.add_request(request_id, prompts[kind], params, guide=backend.guide(compiled))
    # an unguided request in the same batch: guided rows are not row 0 of the logits
    engine.add_request("free", prompts["person"], SamplingParams(max_tokens=8, temperature=0.7, seed=1))

    token_ids: dict[str, list[int]] = {request_id: [] for request_id in [*requests, "free"]}
    finish: dict[str, str | None] = {}
    started = time.perf_counter()
    while len(finish) < len(token_ids):
        for out in engine.step():
            token_ids[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(ids) for ids in token_ids.values())
    print(f"\nengine: {len(token_ids)} requests, {num_tokens} tokens in {elapsed:.1f} s")
    for request_id, (kind, compiled) in requests.items():
        text = decode(source, token_ids[request_id])
        print(f"  {request_id} ({finish[request_id]}, {len(token_ids[request_id])} tokens): {text!r}")
        replay = backend.guide(compiled)
        feed(replay, token_ids[request_id])  # every token was allowed: the text is a valid prefix
        if finish[request_id] == "length":
            assert len(token_ids[request_id]) == max_tokens and not replay.is_terminated(), text
            continue
        assert finish[request_id] == "stop" and replay.is_terminated(), text
        if kind == "person":
            check_schema(json.loads(text), PERSON_SCHEMA)
        else:
            check_tool_calls(text, [WEATHER, NOOP], parallel=False)
    assert len(token_ids["free"]) >= 1
