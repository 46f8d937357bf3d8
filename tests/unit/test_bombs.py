"""Grammar and template bombs: inputs built to make the server compile or render for a long
time, or to build something enormous, are refused with a 400 naming the field, quickly.

Covered elsewhere (not repeated here): too many tools, a schema too deep or too big, too many
logit_bias entries or stop strings (tests/unit/test_api_errors.py,
test_limits_are_400s_naming_the_field); a malformed pattern (tests/unit/test_structured.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jinja2
import pydantic
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from argosy.api.errors import from_validation_error, status_of
from argosy.api.openai.chat import ChatCompletionRequest
from argosy.chat.messages import OutputFormat, ToolChoice, ToolDefinition
from argosy.chat.template import ChatTemplate
from argosy.core.constraints import (
    MAX_PATTERN_COST,
    MAX_PATTERN_REPEAT,
    MAX_TOOL_SCHEMAS_BYTES,
    check_chat_options,
    check_schema_size,
)
from argosy.engine.grammar_service import COMPILE_DEADLINE_S, GrammarService
from argosy.errors import InvalidRequestError, OverloadedError
from argosy.runner.structured import GRAMMAR_BACKENDS, CompiledGrammar, GrammarSpec, TokenGuide

USER = [{"role": "user", "content": "hi"}]


# -- stop strings --------------------------------------------------------------------------
@pytest.mark.parametrize("stop", ["x" * 1001, ["ok", "y" * 1001]])
def test_a_stop_string_past_1000_characters_is_a_400_naming_stop(stop: Any) -> None:
    raw = json.dumps({"model": "m", "messages": USER, "stop": stop})
    with pytest.raises(pydantic.ValidationError) as caught:
        ChatCompletionRequest.model_validate_json(raw)
    error = from_validation_error(caught.value)
    assert error.param == "stop" and status_of(error) == 400
    assert "at most 1000 characters" in error.message


def test_stop_strings_at_the_limits_are_accepted() -> None:
    stop = ["z" * 1000] + [str(i) for i in range(15)]
    body = ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": USER, "stop": stop})
    )
    assert body.stop == stop


# -- patterns: refused before any compile ----------------------------------------------------
def pattern_schema(*patterns: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": p} for i, p in enumerate(patterns)},
    }


def schema_error(schema: dict[str, Any], param: str = "response_format") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        check_schema_size(schema, param)
    assert caught.value.param == param and status_of(caught.value) == 400
    return caught.value


@pytest.mark.parametrize(
    ("pattern", "count"),
    [
        ("^a{1,10000}$", 10000),  # 20 s to compile on xgrammar 0.2.9
        ("^a{5000}$", 5000),  # 6 s
        ("^[0-9]{3000,}$", 3000),
        ("^a{99999999999999999999}$", 10**9),  # more digits than int() takes: still a count
        ("^((((((a){1,5}){1,5}){1,5}){1,5}){1,5}){1,5}$", 5**6),  # nested: 7 s; counts multiply
        ("^(?:x(b{1,40}){1,40})$", 1600),
    ],
)
def test_a_pattern_that_repeats_too_often_is_a_400(pattern: str, count: int) -> None:
    error = schema_error(pattern_schema(pattern))
    assert f"repeats {count} times" in error.message and str(MAX_PATTERN_REPEAT) in error.message


def test_patterns_are_found_wherever_a_schema_holds_one() -> None:
    bomb = {"type": "string", "pattern": "a{2000}"}
    for schema in (
        {"type": "array", "items": bomb},
        {"anyOf": [{"type": "integer"}, bomb]},
        {"$defs": {"x": bomb}, "$ref": "#/$defs/x"},
        {"type": "object", "properties": {"enum": bomb}},  # a property *named* enum
        {"type": "object", "patternProperties": {"^k{2000}$": {"type": "string"}}},
    ):
        schema_error(schema)


def test_ordinary_patterns_and_literal_braces_pass() -> None:
    schema = pattern_schema(
        r"^\d{4}-\d{2}-\d{2}$",
        r"^(\d{1,3}\.){3}\d{1,3}$",
        r"^([a-z0-9-]{1,63}\.){1,10}[a-z]{2,63}$",
        r"^\{5000}$",  # an escaped brace
        "^[{5000}]+$",  # a brace in a character class
        "^[]{5000}]$",  # `]` first in a class is a literal
        f"^a{{1,{MAX_PATTERN_REPEAT}}}$",
    )
    schema["enum"] = [{"pattern": "a{9999}"}]  # data, not a schema
    num_bytes, cost = check_schema_size(schema, "response_format")
    assert num_bytes == len(json.dumps(schema, separators=(",", ":")))
    assert MAX_PATTERN_REPEAT**2 < cost < MAX_PATTERN_COST


def test_many_patterns_together_are_a_400() -> None:
    """Five quantifiers of 1000 each pass one by one but not together (about 1 s of compile)."""
    error = schema_error(pattern_schema(*["^[a-z]{1,1000}$"] * 5))
    assert "sum of their squared repetition counts is 5000000" in error.message


def test_the_pattern_budget_and_size_span_all_tools() -> None:
    tools = [
        ToolDefinition(f"t{i}", parameters=pattern_schema("^[a-z]{1,1000}$", "^[a-z]{1,1000}$"))
        for i in range(3)
    ]
    check_chat_options(tools[:2], ToolChoice("required"), None)
    with pytest.raises(InvalidRequestError) as caught:
        check_chat_options(tools, ToolChoice("required"), None)
    assert caught.value.param == "tools" and "squared repetition counts" in caught.value.message
    filler = {"type": "object", "description": "x" * 60_000}
    many = [ToolDefinition(f"f{i}", parameters=filler) for i in range(MAX_TOOL_SCHEMAS_BYTES // 60_000 + 1)]
    with pytest.raises(InvalidRequestError) as caught:
        check_chat_options(many, ToolChoice("auto"), None)
    assert (
        caught.value.param == "tools" and f"more than {MAX_TOOL_SCHEMAS_BYTES} bytes" in caught.value.message
    )


def test_a_response_format_pattern_bomb_names_response_format() -> None:
    output = OutputFormat("json_schema", pattern_schema("^a{1,10000}$"))
    with pytest.raises(InvalidRequestError) as caught:
        check_chat_options([], ToolChoice("auto"), output)
    assert caught.value.param == "response_format"


# -- the compile deadline, on xgrammar with SmolLM2's tokenizer --------------------------------
# Four quantifiers of 1000 each: within the static limits, and about 0.2-0.7 s to compile.
SLOW_SCHEMA = pattern_schema(*["^[a-z]{1,1000}$"] * 4)


@pytest.fixture(scope="module")
def grammar_service() -> GrammarService:
    pytest.importorskip("xgrammar")
    from argosy.models.loader import resolve_model

    source = resolve_model("smollm2")
    service = GrammarService(source.tokenizer, source.vocab_size, source.eos_token_ids)
    asyncio.run(service.compile(GrammarSpec("json_schema", {"type": "string"})))  # builds the backend
    return service


def test_a_compile_past_the_deadline_is_a_400_and_its_retry_is_refused_at_once(
    grammar_service: GrammarService,
) -> None:
    check_schema_size(SLOW_SCHEMA, "response_format")  # the static limits let it through
    service = grammar_service
    service.compile_deadline_s = 0.05
    try:
        with pytest.raises(InvalidRequestError) as caught:
            asyncio.run(service.compile(GrammarSpec("json_schema", SLOW_SCHEMA), "response_format"))
        assert caught.value.param == "response_format" and status_of(caught.value) == 400
        assert "took longer than 0.05 s to compile" in caught.value.message
        assert service.num_timed_out == 1
        num_started = service.num_compiles_started
        again = GrammarSpec("json_schema", json.loads(json.dumps(SLOW_SCHEMA, indent=2)))
        with pytest.raises(InvalidRequestError) as caught:
            asyncio.run(service.compile(again, "tools[0]"))
        assert caught.value.param == "tools[0]" and "before; it is not compiled again" in caught.value.message
        assert service.num_compiles_started == num_started  # refused without compiling
    finally:
        service.compile_deadline_s = COMPILE_DEADLINE_S
    # the abandoned compile holds one thread; others compile on a fresh worker
    compiled = asyncio.run(service.compile(GrammarSpec("json_schema", {"type": "integer"})))
    assert compiled.spec.payload == {"type": "integer"}


# -- the compile queue around an abandoned compile (a gated backend: deterministic) -----------
class GatedBackend:
    """A grammar backend whose compile of a spec titled "slow" blocks until `gate` opens."""

    name = "gated"
    gate = threading.Event()
    finished_while_gated: list[str] = []  # titles compiled while the gate was closed

    def __init__(self, *args: Any) -> None:
        self._compiled: dict[str, CompiledGrammar] = {}

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        title = spec.payload.get("title", "")
        if title == "slow":
            assert self.gate.wait(10), "the test never opened the gate"
        elif not self.gate.is_set():
            self.finished_while_gated.append(title)
        compiled = CompiledGrammar(spec, None, 0.0)
        self._compiled[spec.cache_key()] = compiled
        return compiled

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        return self._compiled.get(spec.cache_key())

    def guide(self, compiled: CompiledGrammar) -> TokenGuide:
        raise NotImplementedError


@pytest.fixture()
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(GRAMMAR_BACKENDS, "gated", f"{__name__}:GatedBackend")
    GatedBackend.gate.clear()
    GatedBackend.finished_while_gated.clear()
    yield
    GatedBackend.gate.set()


def titled(title: str) -> GrammarSpec:
    return GrammarSpec("json_schema", {"type": "string", "title": title})


def gated_service(max_abandoned: int = 2) -> GrammarService:
    """A service on the gated backend, built (by one quick compile) and ready."""
    service = GrammarService(
        None,  # type: ignore[arg-type]  # the gated backend reads no vocabulary
        32,
        [0],
        backend_name="gated",
        compile_deadline_s=0.05,
        max_abandoned=max_abandoned,
    )
    asyncio.run(service.compile(titled("warm")))
    return service


@pytest.mark.usefixtures("gated")
def test_compiles_queued_behind_an_abandoned_one_move_to_a_fresh_worker() -> None:
    service = gated_service()

    async def both() -> list[Any]:
        # gather starts them in order: "queued" is submitted behind "slow" on the same worker
        return await asyncio.gather(
            service.compile(titled("slow"), "tools"),
            service.compile(titled("queued"), "tools"),
            return_exceptions=True,
        )

    slow, queued = asyncio.run(both())
    assert isinstance(slow, InvalidRequestError) and "took longer than" in slow.message
    assert isinstance(queued, CompiledGrammar) and queued.spec.payload["title"] == "queued"
    assert GatedBackend.finished_while_gated == ["warm", "queued"]  # it did not wait for "slow"


@pytest.mark.usefixtures("gated")
def test_past_max_abandoned_compiles_new_ones_are_503_until_one_finishes() -> None:
    service = gated_service(max_abandoned=1)
    with pytest.raises(InvalidRequestError):
        asyncio.run(service.compile(titled("slow")))
    with pytest.raises(OverloadedError) as caught:
        asyncio.run(service.compile(titled("other")))
    assert status_of(caught.value) == 503 and "ran past their 0.05 s deadline" in caught.value.message
    GatedBackend.gate.set()  # the abandoned compile finishes; its thread exits

    async def until_compiled() -> CompiledGrammar:
        for _ in range(500):
            try:
                return await service.compile(titled("other"))
            except OverloadedError:
                await asyncio.sleep(0.01)
        raise AssertionError("the abandoned compile's thread never finished")

    assert asyncio.run(until_compiled()).spec.payload["title"] == "other"


# -- chat templates ------------------------------------------------------------------------
def render_error(source: str, messages: list[dict[str, Any]] | None = None) -> InvalidRequestError:
    template = ChatTemplate(source, render_deadline_s=0.2, max_render_chars=100_000)
    with pytest.raises(InvalidRequestError) as caught:
        template.render(messages if messages is not None else USER)
    assert caught.value.param == "messages" and status_of(caught.value) == 400
    return caught.value


@pytest.mark.parametrize(
    "source",
    [
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",  # emits nothing
        "{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% for c in m.content %}"
        "{% endfor %}{% endfor %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    ],
    ids=["empty-loops", "loops-over-content", "macro-fan-out"],
)
def test_a_template_that_loops_is_a_400(source: str) -> None:
    error = render_error(source, [{"role": "user", "content": "x" * 2000}])
    assert "took longer than 0.2 s to render" in error.message


@pytest.mark.parametrize(
    "source",
    [
        "{% for a in range(100000) %}{{ 'xxxxxxxxxx' }}{% endfor %}",  # output, piece by piece
        "{{ 'x' * 10000000000 }}",  # refused before it is built
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s | replace('x', 'xx') %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s.replace('x', 'xx') %}"
        "{% endfor %}",
    ],
    ids=["output", "repeat", "concat-doubling", "plus-doubling", "filter-doubling", "method-doubling"],
)
def test_a_template_that_builds_too_much_is_a_400(source: str) -> None:
    assert "produced more than 100000 characters" in render_error(source).message


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{{ 7 ** 1000000 }}", "more than 65536 bits"),
        (
            "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
            "bits",
        ),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
        ("{{ range(10000000) | list | length }}", "Range too big"),
        ("{{ 1 / 0 }}", "division by zero"),
    ],
)
def test_other_runaway_templates_are_400s(source: str, words: str) -> None:
    assert words in render_error(source).message


BUSY_TEMPLATE = """{% macro show(m) %}<{{ m.role | upper }}>{{ m.content ~ '.' }}{% endmacro %}
{%- for m in messages %}{{ show(m) }}{{ loop.index % 2 }}{{ '-' * 3 }}{{ 2 ** 5 }}
{%- if not loop.last %}{{ ', ' + m.role }}{% endif %}{% endfor %}
{%- for item in items recursive %}[{{ item.name }}{{ loop(item.children) if item.children else '' }}]{% endfor %}
{%- filter lower %}ABC{% for i in range(3) %}{{ i }}{% endfor %}{% endfilter %}
{%- set block | trim %}  kept  {% endset %}{{ block }}{{ messages | map(attribute='role') | join('/') }}
{{- messages | tojson }}"""


def test_an_ordinary_template_renders_exactly_as_jinja_renders_it() -> None:
    messages = [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Ünïcödé ✓"},
        {"role": "assistant", "content": "Ok"},
    ]
    items = [{"name": "a", "children": [{"name": "b", "children": []}]}, {"name": "c", "children": []}]
    ours = ChatTemplate(BUSY_TEMPLATE).render(messages, add_generation_prompt=False, items=items)
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    plain = env.from_string(BUSY_TEMPLATE).render(
        messages=messages, add_generation_prompt=False, items=items, tools=None, documents=None
    )
    assert ours == plain and "[a[b]][c]" in ours and "abc012" in ours


def test_smollm2_template_renders_a_large_conversation_identically() -> None:
    from argosy.models.loader import resolve_model

    source = resolve_model("smollm2")
    assert source.chat_template is not None
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " * 50} for i in range(2000)]
    ours = ChatTemplate(source.chat_template, bos_token=source.bos_token, eos_token=source.eos_token)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain = env.from_string(source.chat_template).render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=source.bos_token,
        eos_token=source.eos_token,
        tools=None,
        documents=None,
    )
    assert ours.render(messages) == plain


def test_a_template_syntax_error_is_still_named_chat_template() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        ChatTemplate("{{ messages | no_such_filter }}")
    assert caught.value.param == "chat_template"
    assert isinstance(caught.value.__cause__, jinja2.exceptions.TemplateSyntaxError)
