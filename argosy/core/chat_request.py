"""A neutral chat request (ChatInput) -> what the core runs: prompt ids, grammar, channels.

Every chat-shaped dialect calls `prepare_chat` with plain data (argosy/chat/messages.py) and
builds its CoreRequest with `PreparedChat.core_request(...)`: the prompt rendered by the
model's template (with our own tool prompt when the template writes no tools; ending with the
generation prompt, or with a final assistant message left open to be continued), the
constraints of tool_choice / response_format compiled off the event loop, the guide that
holds reasoning to its budget (`reasoning_budget`, on a reasoning model), the channel
parser's options, and the fields it could not honour (`degraded`: `reasoning_budget` where
the model reasons but its markers do not let the guide see the reasoning).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from argosy.chat.messages import ChatInput, check_continuation
from argosy.chat.parsing import prompt_opens_reasoning
from argosy.core.channels import ChannelSpec
from argosy.core.constraints import guide_spec, plan_constraints
from argosy.core.service import ModelService
from argosy.core.stream import CoreRequest
from argosy.core.vision import place_images
from argosy.engine.sequence import ImagePlacement
from argosy.runner.structured import GuideSpec
from argosy.sampling_params import RequestSampling


@dataclass(slots=True)
class PreparedChat:
    prompt_text: str
    prompt_ids: list[int]
    channels: ChannelSpec
    guide: GuideSpec | None = None
    keeps_special_tokens: bool = False  # detokenize with special tokens (markers among them)
    degraded: list[str] = field(default_factory=list)
    images: list[ImagePlacement] | None = None  # a VLM prompt's images (core/vision.py)

    def sampling(self, sampling: RequestSampling) -> RequestSampling:
        """The request's sampling, detokenizing as the channel parser needs."""
        if not self.keeps_special_tokens:
            return sampling
        return dataclasses.replace(sampling, skip_special_tokens=False)

    def core_request(self, sampling: RequestSampling, **fields: Any) -> CoreRequest:
        """The CoreRequest for this chat; `fields` are CoreRequest's other fields (n, route...)."""
        return CoreRequest(
            prompts=[self.prompt_ids],
            sampling=self.sampling(sampling),
            prompt_param=fields.pop("prompt_param", "messages"),
            channels=self.channels,
            guide=self.guide,
            images=self.images,
            **fields,
        )


async def prepare_chat(core: ModelService, chat: ChatInput) -> PreparedChat:
    check_continuation(chat)
    profile = core.chat_profile()
    constraints = plan_constraints(chat, profile.call_family.call_syntax)
    # off the event loop: a template may take up to its render deadline (argosy/chat/template.py)
    prompt_text = await asyncio.to_thread(
        functools.partial(
            profile.render,
            chat.messages,
            constraints.prompt_tools,
            chat.template_kwargs,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
        )
    )
    is_reasoning_open = prompt_opens_reasoning(profile.call_family, prompt_text)
    repair_budget = (
        core.options.tool_repair_budget if chat.tool_repair_budget is None else chat.tool_repair_budget
    )
    options = dataclasses.replace(
        constraints.parser_options,
        has_reasoning=profile.has_reasoning,
        is_reasoning_open=is_reasoning_open,
        can_repair_calls=repair_budget > 0 and constraints.parser_options.call_schemas is not None,
    )
    if constraints.grammar is not None:
        # compiled (and cached) where the engine runs; a schema it cannot take is a 400 now
        await core.compile_grammar(constraints.grammar, constraints.grammar_param)
    may_reason = profile.has_reasoning and chat.template_kwargs.get("enable_thinking") is not False
    guide = guide_spec(
        constraints.grammar,
        start_ids=profile.reasoning_start_ids,
        end_ids=profile.reasoning_end_ids,
        is_reasoning_open=is_reasoning_open,
        may_reason=may_reason,
        max_reasoning_tokens=chat.reasoning_budget if profile.has_reasoning else None,
    )
    degraded = list(constraints.degraded)
    if (
        chat.reasoning_budget is not None
        and (may_reason or is_reasoning_open)
        and (guide is None or guide.max_reasoning_tokens is None)
    ):
        degraded.append("reasoning_budget")  # it reasons, but where is not seen on token ids
    images: list[ImagePlacement] | None = None
    if chat.images:  # the image tokens expanded, the features encoded (each image once)
        prompt_ids, images = await place_images(
            core.require_engine(),
            prompt_text,
            chat.images,
            profile.tokenize,
            core.model_id,
            core.options.max_images_per_request,
        )
    else:
        prompt_ids = profile.tokenize(prompt_text)
    return PreparedChat(
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        images=images,
        channels=ChannelSpec(profile.call_family, options, profile.strip_texts, repair_budget),
        guide=guide,
        keeps_special_tokens=profile.keeps_special_tokens,
        degraded=degraded,
    )
