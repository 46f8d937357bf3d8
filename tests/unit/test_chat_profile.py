"""ChatProfile: the family, tool prompt and marker tokens of a model, and its prompts.

A template that writes tools renders neutral messages exactly as transformers renders the
same conversation (calls' arguments as dicts); SmolLM2's template, which knows no tools, gets
our Hermes tool prompt, pinned here character for character.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, models

from argosy.chat.families import hermes
from argosy.chat.messages import Message, ToolCallRecord, ToolDefinition, template_messages
from argosy.chat.profile import ChatProfile
from argosy.chat.template import ChatTemplate
from argosy.chat.tool_prompt import hermes_conversation
from tests.unit.test_chat_template import BOS, EOS, transformers_render

FIXTURES = Path(__file__).parent / "fixtures"

WEATHER = ToolDefinition(
    "get_weather",
    "Get the weather for a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
HISTORY = [
    Message("system", "You are terse."),
    Message("user", "Weather in Paris?"),
    Message(
        "assistant",
        None,
        reasoning="Call the tool.",
        tool_calls=[ToolCallRecord("get_weather", '{"city": "Paris"}', "call_1")],
    ),
    Message("tool", '{"temp": 21}', tool_call_id="call_1"),
    Message("user", "Thanks. And tomorrow?"),
]


def tokenizer_with(special: list[str], plain: list[str] = ()) -> Tokenizer:  # type: ignore[assignment]
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False) for t in plain])
    return tokenizer


QWEN_TOKENS = tokenizer_with(
    ["<|im_start|>", "<|im_end|>"], ["<think>", "</think>", "<tool_call>", "</tool_call>"]
)
LLAMA_TOKENS = tokenizer_with(
    ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
)


def profile(name: str, tokenizer: Tokenizer) -> ChatProfile:
    template = ChatTemplate((FIXTURES / name).read_text(), bos_token=BOS, eos_token=EOS)
    return ChatProfile(template, tokenizer)


def test_qwen3_style_profile() -> None:
    qwen = profile("qwen3_style.jinja", QWEN_TOKENS)
    assert qwen.family.name == "qwen3" and qwen.call_family is qwen.family
    assert qwen.has_native_tools and qwen.has_reasoning
    assert qwen.reasoning_start_ids == [QWEN_TOKENS.token_to_id("<think>")]
    assert qwen.reasoning_end_ids == [QWEN_TOKENS.token_to_id("</think>")]
    assert not qwen.keeps_special_tokens and qwen.strip_texts == ()


def test_llama3_style_profile_keeps_its_special_marker() -> None:
    llama = profile("llama3_style.jinja", LLAMA_TOKENS)
    assert llama.family.name == "llama3_json" and llama.has_native_tools
    assert llama.keeps_special_tokens  # <|python_tag|> is a special token the parser needs
    assert "<|eot_id|>" in llama.strip_texts and "<|python_tag|>" not in llama.strip_texts


@pytest.mark.parametrize(
    ("name", "tokenizer", "messages"),
    [
        ("qwen3_style.jinja", QWEN_TOKENS, HISTORY),
        ("llama3_style.jinja", LLAMA_TOKENS, HISTORY[1:]),  # it folds the first user turn in
    ],
)
def test_native_tool_templates_render_like_transformers(
    name: str, tokenizer: Tokenizer, messages: list[Message]
) -> None:
    chat = profile(name, tokenizer)
    ours = chat.render(messages, [WEATHER], {})
    hf_messages = template_messages(messages)
    (assistant,) = [m for m in hf_messages if "tool_calls" in m]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a dict
    expected = transformers_render(chat.template.source, hf_messages, tools=[WEATHER.template_json()])
    assert ours == expected
    assert chat.render(messages[:2], [], {}) == transformers_render(
        chat.template.source, template_messages(messages[:2])
    )


# -- our Hermes tool prompt on SmolLM2 -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> ChatProfile:
    from argosy.models.loader import resolve_model

    source = resolve_model("smollm2")
    assert source.chat_template is not None
    template = ChatTemplate(source.chat_template, bos_token=source.bos_token, eos_token=source.eos_token)
    return ChatProfile(template, source.tokenizer)


TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER.template_json())
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def test_smollm2_gets_our_hermes_tool_prompt(smollm2: ChatProfile) -> None:
    assert not smollm2.has_native_tools
    assert smollm2.call_family is hermes.FAMILY
    text = smollm2.render(HISTORY, [WEATHER], {})
    assert text == (
        "<|im_start|>system\nYou are terse.\n\n" + TOOLS_SECTION + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>user\nThanks. And tomorrow?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_without_a_system_message_the_tools_are_one(smollm2: ChatProfile) -> None:
    text = smollm2.render([Message("user", "Hi")], [WEATHER], {})
    assert text.startswith("<|im_start|>system\n" + TOOLS_SECTION + "<|im_end|>\n<|im_start|>user\nHi")


def test_without_tools_history_is_still_rewritten(smollm2: ChatProfile) -> None:
    text = smollm2.render(HISTORY[1:], [], {})
    assert "<tools>" not in text
    assert "SmolLM" in text  # the template's own default system prompt
    assert '<tool_call>\n{"name": "get_weather"' in text and "<tool_response>" in text


def test_hermes_conversation_merges_tool_results_and_keeps_text() -> None:
    messages = [
        Message("user", "Two cities"),
        Message(
            "assistant",
            "Checking both.",
            tool_calls=[
                ToolCallRecord("get_weather", '{"city": "A"}'),
                ToolCallRecord("get_weather", "not json"),
            ],
        ),
        Message("tool", "1", tool_call_id="a"),
        Message("tool", "2", tool_call_id="b"),
    ]
    rendered: list[dict[str, Any]] = hermes_conversation(messages, [])
    assert rendered[1]["content"] == (
        'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>'
    )
    assert "tool_calls" not in rendered[1]
    assert rendered[2] == {
        "role": "user",
        "content": "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>",
    }
    assert len(rendered) == 3
