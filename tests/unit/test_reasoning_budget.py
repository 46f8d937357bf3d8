"""A reasoning budget: once a reasoning block has run `max_reasoning_tokens` tokens, only its
end marker may come, then the answer follows (free, or under a grammar).

The guide by itself (ReasoningBudgetGuide: masks and counts), on the tiny random Llama in the
engine (exact tokens against transformers' greedy run: the free reasoning up to the budget,
the forced marker, then the greedy continuation of that), through AsyncEngine with a GuideSpec
that has no grammar, and prepare_chat on a Qwen3-style template (the guide it builds, and
`reasoning_budget` named where the markers cannot be followed).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from argosy.chat.messages import ChatInput, Message
from argosy.chat.profile import ChatProfile
from argosy.chat.template import ChatTemplate
from argosy.core.chat_request import PreparedChat, prepare_chat
from argosy.core.constraints import guide_spec
from argosy.core.service import ServiceOptions
from argosy.engine.async_engine import AsyncEngine
from argosy.runner.structured import (
    GrammarSpec,
    GuideSpec,
    ReasoningBudgetGuide,
    bitmask_words,
    build_guide,
    unpack_bitmask,
)
from argosy.sampling_params import SamplingParams
from tests.unit.conftest import FakeGuide, TinyModel
from tests.unit.test_chat_profile import FIXTURES, QWEN_TOKENS, tokenizer_with
from tests.unit.test_engine import Result, collect, greedy, prompt

START, END = 40, [41, 42]  # a one-token start marker, a two-token end marker


def allowed(guide: Any, vocab_size: int = 64) -> list[int]:
    mask = torch.zeros(1, bitmask_words(vocab_size), dtype=torch.int32)
    guide.fill_bitmask(mask, 0)
    return unpack_bitmask(mask, vocab_size)[0].nonzero().flatten().tolist()


def feed(guide: Any, token_ids: list[int]) -> None:
    for token_id in token_ids:
        assert guide.accept_token(token_id)


# -- the guide -------------------------------------------------------------------------------


def test_the_budget_forces_the_end_marker_token_by_token() -> None:
    guide = ReasoningBudgetGuide(None, END, max_reasoning_tokens=3)  # the prompt opened it
    feed(guide, [5, 6])
    assert len(allowed(guide)) == 64 and guide.num_reasoning_tokens == 2
    feed(guide, [7])
    assert allowed(guide) == [41]
    feed(guide, [41])
    assert allowed(guide) == [42]
    feed(guide, [42])
    assert len(allowed(guide)) == 64 and guide.num_reasoning_tokens == 3  # the answer: free
    feed(guide, [41, 42, 9])  # a marker in the answer is only text
    assert len(allowed(guide)) == 64 and not guide.is_terminated()


def test_a_marker_the_model_began_is_finished_within_the_budget() -> None:
    guide = ReasoningBudgetGuide(None, END, max_reasoning_tokens=3)
    feed(guide, [5, 6, 41])  # the marker's first token, third: the budget is reached with it
    assert allowed(guide) == [42] and guide.num_reasoning_tokens == 2
    guide = ReasoningBudgetGuide(None, END, max_reasoning_tokens=3)
    feed(guide, [41, 5])  # a broken-off start of the marker is reasoning
    assert guide.num_reasoning_tokens == 2 and len(allowed(guide)) == 64
    feed(guide, [41, 41])  # restarted: the last 41 may still begin the marker
    assert allowed(guide) == [42] and guide.num_reasoning_tokens == 3


def test_reasoning_that_ends_by_itself_is_not_touched() -> None:
    guide = ReasoningBudgetGuide(None, END, max_reasoning_tokens=5)
    feed(guide, [5, 41, 42])
    assert guide.num_reasoning_tokens == 1
    feed(guide, [6] * 10)  # the answer is never held to the budget
    assert len(allowed(guide)) == 64


def test_a_model_that_opens_its_reasoning_itself() -> None:
    guide = ReasoningBudgetGuide(None, END, max_reasoning_tokens=1, start_token_id=START)
    assert len(allowed(guide)) == 64
    feed(guide, [START, 5])  # the marker is not counted
    assert allowed(guide) == [41]
    direct = ReasoningBudgetGuide(None, END, max_reasoning_tokens=1, start_token_id=START)
    feed(direct, [5, 6, 7])  # no marker first: no reasoning, nothing held
    assert len(allowed(direct)) == 64


def test_a_grammar_follows_the_budgeted_reasoning() -> None:
    inner = FakeGuide({3, 4}, terminate_after=2)
    guide = ReasoningBudgetGuide(inner, END, max_reasoning_tokens=2, start_token_id=START)
    assert allowed(guide) == [3, 4, START]  # the grammar's first token or the reasoning marker
    feed(guide, [START, 9, 9])
    assert allowed(guide) == [41]
    feed(guide, [41, 42])
    assert inner.accepted == [] and allowed(guide) == [3, 4]  # the grammar, from its beginning
    feed(guide, [3, 4])
    assert inner.accepted == [3, 4] and guide.is_terminated()


def test_guide_spec_budgets_only_reasoning_it_can_see() -> None:
    def make(**kwargs: Any) -> GuideSpec | None:
        options: dict[str, Any] = {
            "start_ids": [START],
            "end_ids": END,
            "is_reasoning_open": False,
            "may_reason": True,
            "max_reasoning_tokens": 8,
        }
        return guide_spec(None, **{**options, **kwargs})

    optional = make()
    assert optional == GuideSpec(None, "optional", START, tuple(END), max_reasoning_tokens=8)
    assert isinstance(build_guide(optional, None), ReasoningBudgetGuide)
    assert make(is_reasoning_open=True) == GuideSpec(None, "delayed", None, tuple(END), 8)
    assert make(start_ids=[40, 43]) is None  # a start marker of two tokens, not in the prompt
    assert make(may_reason=False) is None
    assert make(end_ids=[]) is None
    assert make(max_reasoning_tokens=None) is None
    with_grammar = guide_spec(
        GrammarSpec("json_object"),
        start_ids=[40, 43],
        end_ids=END,
        is_reasoning_open=False,
        may_reason=True,
        max_reasoning_tokens=8,
    )
    assert with_grammar == GuideSpec(GrammarSpec("json_object"))  # the grammar holds, no budget
    with pytest.raises(ValueError, match="grammar or a reasoning budget"):
        GuideSpec(None, "delayed", end_token_ids=(41,))


# -- in the engine -----------------------------------------------------------------------------


def test_the_engine_ends_reasoning_at_the_budget(tiny_llama: TinyModel) -> None:
    ids = prompt(9, seed=8)
    budget, end = 3, [7, 8]
    free = tiny_llama.greedy(ids, budget)
    assert not set(free) & set(end)  # the greedy reasoning would not have ended by itself
    after = tiny_llama.greedy(ids + free + end, 4)
    spec = GuideSpec(None, "delayed", end_token_ids=tuple(end), max_reasoning_tokens=budget)
    engine = tiny_llama.engine()
    results: dict[str, Result] = {}
    engine.add_request("budget", ids, greedy(budget + len(end) + 4), guide=build_guide(spec, None))
    engine.add_request("free", ids, greedy(budget + len(end) + 4))  # same batch, no guide
    while engine.has_unfinished():
        collect(results, engine.step())
    assert results["budget"].token_ids == free + end + after
    assert results["free"].token_ids == tiny_llama.greedy(ids, budget + len(end) + 4)


def test_async_engine_takes_a_budget_without_a_grammar(tiny_llama: TinyModel) -> None:
    start, end, budget = 5, [7, 8], 2
    # the bias makes the start marker every free token: reasoning opens, runs its two tokens
    # (both the marker's token too), then the end marker is forced and the answer goes on
    params = SamplingParams(
        max_tokens=7, temperature=0.0, ignore_eos=True, detokenize=False, logit_bias={start: 100.0}
    )
    spec = GuideSpec(None, "optional", start, tuple(end), max_reasoning_tokens=budget)
    engine = AsyncEngine(tiny_llama.engine())

    async def main() -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt(9, seed=8), params, guide=spec):
            tokens.extend(out.new_token_ids)
        return tokens

    try:
        assert asyncio.run(main()) == [start, start, start, *end, start, start]
    finally:
        engine.shutdown()


# -- prepare_chat --------------------------------------------------------------------------------

QWEN_THINKING_OPEN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@dataclass
class ProfileCore:
    profile: ChatProfile
    options: ServiceOptions = field(default_factory=ServiceOptions)  # the tool-repair budget's default

    def chat_profile(self) -> ChatProfile:
        return self.profile

    async def compile_grammar(self, spec: GrammarSpec, param: str | None) -> None:
        raise AssertionError("no grammar here")


def prepare(source: str, tokenizer: Tokenizer, **fields: Any) -> PreparedChat:
    core = ProfileCore(ChatProfile(ChatTemplate(source), tokenizer))
    chat_input = ChatInput([Message("user", "Think first.")], **fields)
    return asyncio.run(prepare_chat(core, chat_input))  # type: ignore[arg-type]


def test_prepare_chat_guides_a_budgeted_reasoner() -> None:
    qwen3 = (FIXTURES / "qwen3_style.jinja").read_text()
    think, end_think = QWEN_TOKENS.token_to_id("<think>"), QWEN_TOKENS.token_to_id("</think>")
    prepared = prepare(qwen3, QWEN_TOKENS, reasoning_budget=16)
    assert prepared.guide == GuideSpec(None, "optional", think, (end_think,), max_reasoning_tokens=16)
    assert prepared.degraded == []
    opened = prepare(QWEN_THINKING_OPEN, QWEN_TOKENS, reasoning_budget=16)
    assert opened.channels.options.is_reasoning_open
    assert opened.guide == GuideSpec(None, "delayed", None, (end_think,), max_reasoning_tokens=16)
    assert prepare(qwen3, QWEN_TOKENS).guide is None  # no budget asked: nothing to guide
    off = prepare(qwen3, QWEN_TOKENS, reasoning_budget=16, template_kwargs={"enable_thinking": False})
    assert off.guide is None and off.degraded == []  # thinking switched off: nothing to hold


def test_a_reasoner_whose_start_marker_is_not_one_token_names_the_budget() -> None:
    split = tokenizer_with(["<|im_start|>", "<|im_end|>"], ["<thi", "nk>", "</think>"])
    qwen3 = (FIXTURES / "qwen3_style.jinja").read_text()
    prepared = prepare(qwen3, split, reasoning_budget=16)
    assert prepared.guide is None and prepared.degraded == ["reasoning_budget"]
    # the same markers, but the prompt opens the reasoning: the budget holds
    assert prepare(QWEN_THINKING_OPEN, split, reasoning_budget=16).guide is not None


def test_a_budget_on_a_model_that_does_not_reason_changes_nothing() -> None:
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    prepared = prepare(plain, tokenizer_with([], []), reasoning_budget=16)
    assert prepared.guide is None and prepared.degraded == []
