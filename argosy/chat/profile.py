"""ChatProfile: what the chat layer knows of one model, worked out once when it loads.

Its template and the variables the template reads; its chat family (detected from the
template text and the vocabulary); whether the template writes tools itself or gets our own
Hermes tool prompt (argosy/chat/tool_prompt.py), and so which call syntax its output uses;
the token ids of its reasoning markers (to start a grammar after reasoning); and which
special tokens to keep in the text given to the channel parser.

Special tokens: detokenizing with `skip_special_tokens` drops every special token, markers
included (`<|python_tag|>`, `[TOOL_CALLS]` are special tokens). When one of the family's
markers is a special token, the output is detokenized with special tokens kept, and the
other special tokens' text (`<|eot_id|>`...) is removed before parsing (`strip_texts`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenizers import Tokenizer

from argosy.chat.families import ChatFamily, detect_family, hermes
from argosy.chat.messages import Message, ToolDefinition, template_messages
from argosy.chat.template import ChatTemplate
from argosy.chat.tool_prompt import hermes_conversation

# OpenAI's reasoning_effort values (what a template that writes the value as given is asked for)
REASONING_EFFORT_LEVELS = ("low", "medium", "high")


class _Vocabulary:
    """`token in vocabulary`, asked of the tokenizer: get_vocab() builds a dict of every token
    (262k for Gemma 3: ~0.4 s of a start) for the few markers detect_family looks up."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def __contains__(self, token: object) -> bool:
        return isinstance(token, str) and self._tokenizer.token_to_id(token) is not None


class ChatProfile:
    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template = template
        self._tokenizer = tokenizer
        self.family = detect_family(template.source, _Vocabulary(tokenizer))
        self.has_native_tools = "tools" in template.variables
        # Our tool prompt asks for Hermes calls, whatever the family writes natively.
        is_hermes = self.family.call_syntax == hermes.CALL_SYNTAX
        self.call_family: ChatFamily = (
            self.family
            if self.has_native_tools or is_hermes
            else dataclasses.replace(self.family, call_syntax=hermes.CALL_SYNTAX)
        )
        markers = self.call_family.reasoning_markers
        self.reasoning_start_ids = self._ids(markers[0]) if markers else []
        self.reasoning_end_ids = self._ids(markers[1]) if markers else []
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        marker_strings = set(self.call_family.marker_strings)
        self.keeps_special_tokens = bool(special & marker_strings)
        self.strip_texts = tuple(sorted(special - marker_strings)) if self.keeps_special_tokens else ()

    @property
    def has_reasoning(self) -> bool:
        return self.call_family.reasoning_markers is not None

    def reasoning_effort_levels(self) -> tuple[str, ...] | None:
        """The `reasoning_effort` values this template takes: those it compares the variable
        with, or OpenAI's low / medium / high where it writes the value as given; None where
        it does not read it (a request's `reasoning_effort` is then named degraded)."""
        if not self.reads("reasoning_effort"):
            return None
        return self.template.compared_strings.get("reasoning_effort") or REASONING_EFFORT_LEVELS

    def reads(self, variable: str) -> bool:
        """Whether the template reads `variable` (a kwarg it does not read is not honoured)."""
        return variable in self.template.variables

    def render(
        self,
        messages: list[Message],
        tools: list[ToolDefinition],
        template_kwargs: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text: the template's own rendering, with our tool prompt when the
        template writes no tools (and for any calls / tool results in the history); it ends
        with the generation prompt, or with the final message left open to be continued."""
        kwargs = dict(template_kwargs or {})
        kwargs["add_generation_prompt"] = add_generation_prompt and not continue_final_message
        kwargs["continue_final_message"] = continue_final_message
        if self.has_native_tools:
            conversation = template_messages(messages)
            tool_list = [tool.template_json() for tool in tools] or None
            return self.template.render(conversation, tools=tool_list, **kwargs)
        return self.template.render(hermes_conversation(messages, tools), **kwargs)

    def tokenize(self, prompt_text: str) -> list[int]:
        """Token ids of rendered text; none added: the template writes its own."""
        ids: list[int] = self._tokenizer.encode(prompt_text, add_special_tokens=False).ids
        return ids

    def _ids(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids
