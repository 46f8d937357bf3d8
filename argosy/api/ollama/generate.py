"""Ollama `POST /api/chat` and `POST /api/generate`: NDJSON streams (the default) or one
object, over the one core.

Chat: `messages` (system, user, assistant with `thinking` and `tool_calls`, tool results
with `tool_name`; a final assistant message with text is continued, as Ollama does), `tools` (the reply's `message.tool_calls`, arguments as an object),
`tool_choice` (an Argosy extension, OpenAI's shapes: a forced call is held to its schema),
`format` ("json" or a JSON schema: constrained decoding), `think`, `options` (wire.py),
`logprobs` / `top_logprobs`, `keep_alive`. Generate: `prompt` rendered as one user turn by
the model's chat template (with `system`), or sent as is with `raw`; `template` replaces the
chat template with an Ollama (Go) template of the common forms (ollama_template.py);
`context` (the token ids a generate reply returned) is put before the new prompt. Both stream
lines of `{model, created_at, message | response, done: false}` and end with the `done: true`
line: `done_reason`, `total_duration`, `load_duration`, `prompt_eval_count`,
`prompt_eval_duration`, `eval_count`, `eval_duration` (nanoseconds) and generate's `context`.

An empty `messages` / `prompt` only loads the model (`done_reason: "load"`), or with
`keep_alive: 0` unloads it (`"unload"`; the registry unloads it once its requests are done).
`suffix` asks for fill-in-the-middle in the model's own FIM tokens (argosy/chat/fim.py): a
400 naming it on a model without them; `system`, `think` and `format` do not apply to it and
are named degraded. It runs on the model's satellite where the models file names one (the
lines still name the requested model; the done line's `fim.served_by` names the one that
generated), and without `num_predict` stops after 128 tokens (the FIM default). Refused
with a 400 naming the field: `images` on a model without a vision encoder (or with `raw`,
`template`, `suffix` or `context`: an image is placed by the chat template), `width` /
`height` / `steps` (no image model is configured), `think` on a model that does not reason. What is learned only while
streaming (a request timeout) is listed in the last line's `x_argosy_degraded`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from pydantic import Field, PrivateAttr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.errors import ollama_error_body
from argosy.api.framing import NDJSONResponse, ndjson_lines
from argosy.api.ollama.template import render_ollama_template
from argosy.api.ollama.wire import (
    ChatMessage,
    GenerationFields,
    OllamaRoute,
    apply_keep_alive,
    nanoseconds,
    neutral_messages,
    sampling,
    timestamp,
    tool_call_json,
    tool_choice_of,
    tool_definitions,
)
from argosy.api.openapi import NDJSON, takes
from argosy.api.route import RouteCall, run_route
from argosy.api.wire import respond, token_logprob_json
from argosy.chat.events import (
    Finish,
    LogprobsDelta,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from argosy.chat.fim import fim_max_tokens
from argosy.chat.images import IMAGE_SENTINEL, ImagePart, image_from_base64
from argosy.chat.messages import ChatInput, Message
from argosy.core.admission import QOS_HEADER
from argosy.core.chat_request import PreparedChat, prepare_chat
from argosy.core.constraints import check_chat_options
from argosy.core.conversation import message_events
from argosy.core.recording import SessionSpec
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelService
from argosy.core.stream import CollectedChoice, CoreRequest, CoreStream, collect
from argosy.errors import InvalidRequestError
from argosy.sessions.events import MessageAppended

router = APIRouter()

# what the chat layer names (OpenAI's words) -> this dialect's field
_DEGRADED_NAMES = {"response_format": "format"}


class ChatRequest(GenerationFields):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[Any] | None = None
    tool_choice: Any = None  # an Argosy extension (wire.tool_choice_of)
    # an Argosy extension: calls failing their schema repaired per request (None: the server's)
    tool_repair_budget: int | None = Field(None, ge=0)
    _chat: ChatInput | None = PrivateAttr(default=None)
    _images: list[ImagePart] = PrivateAttr(default_factory=list)

    def check(self) -> None:
        super().check()
        for position, message in enumerate(self.messages):
            if message.images:  # read; each stands before its message's text, as Ollama puts it
                if not isinstance(message.images, list):
                    raise InvalidRequestError(
                        f"Invalid 'messages[{position}].images': expected a list.",
                        f"messages[{position}].images",
                    )
                for j, data in enumerate(message.images):
                    self._images.append(image_from_base64(data, f"messages[{position}].images[{j}]"))
                message.content = IMAGE_SENTINEL * len(message.images) + (message.content or "")
                message.images = None
        if self.messages:
            chat = self.chat_input()
            check_chat_options(chat.tools, chat.tool_choice, chat.output_format)

    def chat_input(self) -> ChatInput:
        if self._chat is None:
            tools = tool_definitions(self.tools)
            # a conversation ending with an assistant's text is continued, as Ollama does
            final = self.messages[-1]
            prefill = final.role == "assistant" and bool(final.content) and not final.tool_calls
            self._chat = ChatInput(
                messages=neutral_messages(self.messages),
                tools=tools,
                tool_choice=tool_choice_of(self.tool_choice, tools),
                output_format=self.output_format(),
                template_kwargs=self.think_kwargs(),
                add_generation_prompt=not prefill,
                continue_final_message=prefill,
                tool_repair_budget=self.tool_repair_budget,
                images=self._images,
            )
        return self._chat

    @property
    def is_load_only(self) -> bool:
        return not self.messages


class GenerateRequest(GenerationFields):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    _images: list[ImagePart] = PrivateAttr(default_factory=list)

    def check(self) -> None:
        super().check()
        if self.images:
            self._read_images()
        for name in ("width", "height", "steps"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(
                    f"Invalid '{name}': image generation needs an image model, and this server has none configured.",
                    name,
                )
        if self.suffix and self.template is not None:
            raise InvalidRequestError(
                "Invalid 'template': a fill-in-the-middle prompt ('suffix') is written in the model's own "
                "FIM tokens, not through a template.",
                "template",
            )
        if self.context is not None and any(t < 0 for t in self.context):
            raise InvalidRequestError("Invalid 'context': token ids are non-negative integers.", "context")
        if self.raw and self.template is not None:
            raise InvalidRequestError(
                "Invalid 'template': a raw prompt is sent as is, with no template.", "template"
            )
        if self.template is not None:
            render_ollama_template(self.template, system=self.system, prompt=self.prompt)  # checks it

    @property
    def is_load_only(self) -> bool:
        return not self.prompt and not self.context

    @property
    def uses_chat_template(self) -> bool:
        return not self.raw and self.template is None

    def _read_images(self) -> None:
        """`images` read and checked (each stands before the prompt's text, as Ollama puts
        them); only through the model's chat template, and without `context` (whose tokens
        would move the images' places)."""
        if not isinstance(self.images, list):
            raise InvalidRequestError("Invalid 'images': expected a list of base64 images.", "images")
        for name, given in (("raw", self.raw), ("template", self.template), ("suffix", self.suffix)):
            if given:
                raise InvalidRequestError(
                    f"Invalid 'images': images are placed by the model's chat template, which '{name}' skips.",
                    "images",
                )
        if self.context:
            raise InvalidRequestError("Invalid 'images': images with 'context' are not supported.", "images")
        self._images = [image_from_base64(data, f"images[{j}]") for j, data in enumerate(self.images)]

    def chat_input(self) -> ChatInput:
        prompt = IMAGE_SENTINEL * len(self._images) + self.prompt
        messages = ([Message("system", self.system)] if self.system is not None else []) + [
            Message("user", prompt)
        ]
        return ChatInput(
            messages=messages,
            output_format=self.output_format(),
            template_kwargs=self.think_kwargs(),
            images=self._images,
        )


# -- to the core -------------------------------------------------------------------------------


def _refuse_thinking(body: GenerationFields, service: ModelService) -> None:
    if body.asks_thinking and not service.chat_profile().has_reasoning:
        raise InvalidRequestError(
            f"Invalid 'think': model \"{body.model}\" does not support thinking.", "think"
        )


async def _prepared(
    body: GenerationFields, chat: ChatInput, service: ModelService
) -> tuple[PreparedChat, list[str]]:
    _refuse_thinking(body, service)
    prepared = await prepare_chat(service, chat)
    return prepared, [_DEGRADED_NAMES.get(name, name) for name in prepared.degraded]


async def chat_to_core(body: ChatRequest, service: ModelService) -> tuple[CoreRequest, list[str]]:
    prepared, degraded = await _prepared(body, body.chat_input(), service)
    return prepared.core_request(sampling(body.options, logprobs=body.num_logprobs)), degraded


async def generate_to_core(body: GenerateRequest, service: ModelService) -> tuple[CoreRequest, list[str]]:
    context = list(body.context or [])
    request_sampling = sampling(body.options, logprobs=body.num_logprobs)
    if body.suffix:  # fill in the middle (Ollama's "insert"): the model's own FIM tokens
        ids, stops = service.encode_fim(body.prompt, body.suffix)
        request_sampling.stop_token_ids = [*(request_sampling.stop_token_ids or []), *stops]
        if body.options is None or body.options.num_predict is None:
            request_sampling.max_tokens = fim_max_tokens(
                service.options.operator_sampling.max_tokens,
                service.description.context_length,
                len(context) + len(ids),
            )
        degraded = [name for name in ("system", "think") if getattr(body, name) is not None]
        if body.output_format() is not None:
            degraded.append("format")
        return CoreRequest(
            prompts=[context + ids], sampling=request_sampling, prompt_param="prompt"
        ), degraded
    if body.uses_chat_template:
        prepared, degraded = await _prepared(body, body.chat_input(), service)
        prepared.prompt_ids = context + prepared.prompt_ids
        return prepared.core_request(request_sampling, prompt_param="prompt"), degraded
    # raw, or the request's own template: the text as is, no channels (no reasoning or calls
    # are parsed out of it); `format` still constrains it
    text = (
        body.prompt
        if body.raw
        else render_ollama_template(body.template or "", system=body.system, prompt=body.prompt)
    )
    degraded = ["think"] if body.think is not None else []
    if body.output_format() is not None:
        degraded.append("format")
    prompt_ids = context + (service.encode_rendered(text) if context else service.encode_text(text))
    return CoreRequest(prompts=[prompt_ids], sampling=request_sampling, prompt_param="prompt"), degraded


# -- rendering ---------------------------------------------------------------------------------


class Reply:
    """The lines of one reply: `key` is `message` (chat) or `response` (generate)."""

    def __init__(self, body: GenerationFields, call: RouteCall, stream: CoreStream, served_at: float) -> None:
        self.body = body
        self.model = body.model
        self.call = call
        self.stream = stream
        self.served_at = served_at
        self.is_chat = isinstance(body, ChatRequest)

    def line(self, content: str = "", thinking: str | None = None, **fields: Any) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        if self.is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if "tool_calls" in fields:
                message["tool_calls"] = fields.pop("tool_calls")
            line["message"] = message
        else:
            line["response"] = content
            if thinking:
                line["thinking"] = thinking
        return line | fields

    def done(
        self, finish_reason: str | None, logprobs: list[TokenLogprobs] | None = None, **fields: Any
    ) -> dict[str, Any]:
        now = time.perf_counter()
        usage = self.stream.usage
        timing = self.stream.timing
        first = timing.first_output_time if timing.first_output_time is not None else now
        line = self.line(**fields)
        if logprobs is not None:
            line["logprobs"] = [token_logprob_json(e) for e in logprobs]
        line |= {
            "done": True,
            "done_reason": "length" if finish_reason == "length" else "stop",
            "total_duration": nanoseconds(now - self.call.ctx.started),
            "load_duration": nanoseconds(self.served_at - self.call.ctx.started),
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": nanoseconds(first - timing.arrival_time),
            "eval_count": usage.completion_tokens,
            "eval_duration": nanoseconds(now - first),
        }
        if not self.is_chat:
            choice = self.stream.choices[0]
            line["context"] = list(choice.prompt_ids) + choice.output_ids
        if isinstance(self.body, GenerateRequest) and self.body.suffix:
            line["fim"] = {"served_by": self.call.model_id}  # the satellite, where one served it
        if self.stream.degraded:
            line["x_argosy_degraded"] = list(self.stream.degraded)
        return line

    async def lines(self) -> AsyncIterator[dict[str, Any]]:
        wants_logprobs = self.body.num_logprobs is not None
        pending: list[TokenLogprobs] = []
        calls: dict[int, list[str]] = {}  # call index -> [id, name, arguments so far]
        async with self.stream:
            async for event in self.stream:
                if isinstance(event, LogprobsDelta):
                    pending.extend(event.logprobs)
                    continue
                if isinstance(event, TextDelta) and event.logprobs:
                    pending.extend(event.logprobs)
                line: dict[str, Any] | None = None
                if isinstance(event, TextDelta) and event.text:
                    line = self.line(event.text)
                elif isinstance(event, ReasoningDelta) and event.text:
                    line = self.line("", event.text)
                elif isinstance(event, ToolCallStart):
                    calls[event.call_index] = [event.call_id, event.name, ""]
                elif isinstance(event, ToolCallArgsDelta):
                    calls[event.call_index][2] += event.fragment
                elif isinstance(event, ToolCallEnd):
                    call_id, name, arguments = calls.pop(event.call_index)
                    call = tool_call_json(call_id, event.call_index, name, arguments)
                    line = self.line("", tool_calls=[call]) if call is not None else self.line(arguments)
                elif isinstance(event, Finish):
                    yield self.done(event.reason, pending if wants_logprobs else None)
                    return
                if line is not None:
                    if wants_logprobs:
                        line["logprobs"], pending = [token_logprob_json(e) for e in pending], []
                    yield line

    async def complete(self) -> dict[str, Any]:
        async with self.stream:
            results = await collect(self.stream)
        result: CollectedChoice = results[0]
        logprobs = result.logprobs if self.body.num_logprobs is not None else None
        if isinstance(self.body, GenerateRequest) and not self.body.uses_chat_template:
            return self.done(result.finish_reason, logprobs, content=result.text)
        parsed = result.channels.result()
        fields: dict[str, Any] = {"content": parsed.content, "thinking": parsed.reasoning or None}
        calls = [
            call_json
            for index, call in enumerate(parsed.tool_calls)
            if (call_json := tool_call_json(call.call_id, index, call.name, call.arguments)) is not None
        ]
        if calls and self.is_chat:
            fields["tool_calls"] = calls
        return self.done(result.finish_reason, logprobs, **fields)


# -- routes ------------------------------------------------------------------------------------


def _load_only(body: GenerationFields, call: RouteCall) -> Response:
    """An empty prompt: the model is loaded (it is, by now); with keep_alive 0, unloaded."""
    unloads = body.keep_alive_s() == 0
    line: dict[str, Any] = {"model": body.model, "created_at": timestamp()}
    if isinstance(body, ChatRequest):
        line["message"] = {"role": "assistant", "content": ""}
    else:
        line["response"] = ""
    line |= {"done": True, "done_reason": "unload" if unloads else "load"}
    return JSONResponse(line)


async def _serve(body: ChatRequest | GenerateRequest, service: ModelService, call: RouteCall) -> Response:
    served_at = time.perf_counter()
    apply_keep_alive(body.keep_alive, call)
    if body.is_load_only:
        return _load_only(body, call)
    if isinstance(body, ChatRequest):
        core_request, model_degraded = await chat_to_core(body, service)
        inputs = message_events(body.chat_input().messages)
        kind = "ollama.chat"
    else:
        core_request, model_degraded = await generate_to_core(body, service)
        inputs = (
            message_events(body.chat_input().messages)
            if body.uses_chat_template
            else [MessageAppended("prompt", body.prompt)]
        )
        kind = "ollama.generate"
    core_request.session = SessionSpec(
        inputs=[inputs], metadata={"kind": kind, "model": call.model_id, "request_id": call.request_id}
    )
    stream = call.start(core_request)
    reply = Reply(body, call, stream, served_at)
    degraded = body.degraded_fields(service.description.context_length) + model_degraded
    return await respond(
        call.request,
        stream,
        degraded,
        is_streaming=body.stream,
        frames=lambda: ndjson_lines(reply.lines(), ollama_error_body),
        complete=reply.complete,
        stream_type=NDJSONResponse,
    )


class ChatRoute(OllamaRoute[ChatRequest]):
    route = "POST /api/chat"
    body_type = ChatRequest

    async def serve(self, body: ChatRequest, service: ModelService, call: RouteCall) -> Response:
        return await _serve(body, service, call)


class GenerateRoute(OllamaRoute[GenerateRequest]):
    route = "POST /api/generate"
    body_type = GenerateRequest

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def model_name(self, body: GenerateRequest) -> str | None:
        name = super().model_name(body)
        # fill in the middle goes to the model's satellite where the models file names one
        return self.registry.fim_model(name) if body.suffix else name

    def qos(self, body: GenerateRequest, request: Request) -> str:
        if body.suffix and getattr(body, "priority", None) is None and QOS_HEADER not in request.headers:
            return "inline"
        return super().qos(body, request)

    def log_tags(self, body: GenerateRequest) -> tuple[str, ...]:
        return ("fim", *super().log_tags(body)) if body.suffix else super().log_tags(body)

    async def serve(self, body: GenerateRequest, service: ModelService, call: RouteCall) -> Response:
        return await _serve(body, service, call)


@router.post("/api/chat")
@takes(ChatRequest, streams=NDJSON, errors="OllamaError")
async def chat(request: Request) -> Response:
    return await run_route(request, ChatRoute())


@router.post("/api/generate")
@takes(GenerateRequest, streams=NDJSON, errors="OllamaError")
async def generate(request: Request) -> Response:
    return await run_route(request, GenerateRoute(request.app.state.registry))
