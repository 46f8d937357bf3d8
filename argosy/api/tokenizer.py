"""vLLM's tokenizer routes, in its shapes: `POST /tokenize`, `POST /detokenize`,
`GET /tokenizer_info`. They are OpenAI-family routes (OpenAI's error envelope), and model
routes like any other (api/route.py: the model is resolved, loaded on request and leased;
request events name it); nothing is generated.

- `/tokenize` takes `model` (default: the first chat model) and either `prompt` — tokenized as
  /v1/completions tokenizes it: with `add_special_tokens` (default true) the BOS the model's
  tokenizer config asks for — or `messages` in OpenAI chat's shape (with `tools`,
  `chat_template_kwargs`, `add_generation_prompt` (true), `continue_final_message` (false)),
  rendered by the model's chat template exactly as /v1/chat/completions renders them
  (core/chat_request.prepare_chat); `add_special_tokens` (default false: the template writes
  its own) adds the BOS on top. `return_token_strs` lists each token's vocabulary string.
  Answer: `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` null unless
  asked). So `count` is what /v1/completions (a prompt) or /v1/chat/completions (messages)
  report as `usage.prompt_tokens` for the same input.
- `/detokenize` takes `model` and `tokens` (ids) and answers `{"prompt": text}`, special
  tokens included (what the model would read); an id the tokenizer does not know is a 400
  naming it (`tokens[3]`).
- `/tokenizer_info` (`?model=`) answers the tokenizer's facts as vLLM's does (the tokenizer's
  configuration, `tokenizer_class` first): `tokenizer_class` (PreTrainedTokenizerFast: what
  transformers builds from a tokenizer.json), `model_max_length` (the served context
  length), `add_bos_token`, `bos_token` / `bos_token_id`, `eos_token` / `eos_token_id` (and
  every end-of-sequence id in `eos_token_ids`), `vocab_size` (added tokens included),
  `added_tokens_decoder`, `chat_template` (when the model has one), and the served `model`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field, PrivateAttr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.openai.chat import ChatMessage, check_chat_input, read_chat_messages, wire_chat_input
from argosy.api.openapi import query, takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import WireModel, degraded_headers
from argosy.chat.messages import ChatInput
from argosy.core.chat_request import prepare_chat
from argosy.core.service import ModelService
from argosy.errors import InvalidRequestError

router = APIRouter()

# what transformers' AutoTokenizer builds from a tokenizer.json (the only kind served here)
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
MAX_NAMED_IDS = 8  # unknown token ids listed in a /detokenize refusal


class TokenizeRequest(WireModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body: `prompt` or
    `messages`, never both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    return_token_strs: bool = False
    _chat: ChatInput | None = PrivateAttr(default=None)

    def check(self) -> None:
        if self.prompt is None and self.messages is None:
            raise InvalidRequestError("Send 'prompt' (a string) or 'messages' (a chat).", param="prompt")
        if self.prompt is not None and self.messages is not None:
            raise InvalidRequestError("Send 'prompt' or 'messages', not both.", param="messages")
        if self.messages is not None:
            read_chat_messages(self.messages, self.chat_template_kwargs)
            check_chat_input(self.chat_input())

    def chat_input(self) -> ChatInput:
        """The messages in neutral terms, as chat completions reads them."""
        assert self.messages is not None
        if self._chat is None:
            self._chat = wire_chat_input(
                self.messages,
                template_kwargs=dict(self.chat_template_kwargs or {}),
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                tools=self.tools,
            )
        return self._chat


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        for position, token_id in enumerate(self.tokens):
            if token_id < 0:
                raise InvalidRequestError(
                    f"Token ids are non-negative integers; tokens[{position}] is {token_id}.",
                    param=f"tokens[{position}]",
                )


class TokenizerInfoQuery(WireModel):
    """GET /tokenizer_info's query: the model (default: the first chat model)."""

    model: str | None = None


class TokenizeRoute(ModelRoute[TokenizeRequest]):
    route = "POST /tokenize"
    body_type = TokenizeRequest

    async def serve(self, body: TokenizeRequest, service: ModelService, call: RouteCall) -> Response:
        degraded: list[str] = []
        if body.messages is not None:
            prepared = await prepare_chat(service, body.chat_input())
            degraded = prepared.degraded
            token_ids = (
                service.encode_text(prepared.prompt_text) if body.add_special_tokens else prepared.prompt_ids
            )
        else:
            assert body.prompt is not None
            adds_special = body.add_special_tokens is not False
            token_ids = (
                service.encode_text(body.prompt) if adds_special else service.encode_rendered(body.prompt)
            )
        tokenizer = service.description.tokenizer
        result = {
            "count": len(token_ids),
            "max_model_len": service.description.context_length,
            "tokens": token_ids,
            "token_strs": [tokenizer.id_to_token(t) for t in token_ids] if body.return_token_strs else None,
        }
        return JSONResponse(result, headers=degraded_headers(degraded))


class DetokenizeRoute(ModelRoute[DetokenizeRequest]):
    route = "POST /detokenize"
    body_type = DetokenizeRequest

    async def serve(self, body: DetokenizeRequest, service: ModelService, call: RouteCall) -> Response:
        tokenizer = service.description.tokenizer
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        # the size first: the tokenizer cannot even look up an id past 32 bits
        unknown = [(i, t) for i, t in enumerate(body.tokens) if t >= size or tokenizer.id_to_token(t) is None]
        if unknown:
            named = ", ".join(str(t) for _, t in unknown[:MAX_NAMED_IDS])
            more = f" and {len(unknown) - MAX_NAMED_IDS} more" if len(unknown) > MAX_NAMED_IDS else ""
            raise InvalidRequestError(
                f"Token ids out of the vocabulary of {call.model_id!r} ({size} tokens): {named}{more}.",
                param=f"tokens[{unknown[0][0]}]",
            )
        return JSONResponse({"prompt": service.decode(body.tokens)})


class TokenizerInfoRoute(ModelRoute[TokenizerInfoQuery]):
    route = "GET /tokenizer_info"
    body_type = TokenizerInfoQuery

    async def read(self, request: Request) -> TokenizerInfoQuery:
        return TokenizerInfoQuery(model=request.query_params.get("model"))

    async def serve(self, body: TokenizerInfoQuery, service: ModelService, call: RouteCall) -> Response:
        return JSONResponse(tokenizer_info(service, call.model_id))


def tokenizer_info(service: ModelService, model_id: str) -> dict[str, Any]:
    """The tokenizer's configuration as vLLM's /tokenizer_info lists it (plus ids and sizes)."""
    description = service.description
    tokenizer = description.tokenizer
    added = tokenizer.get_added_tokens_decoder()
    info: dict[str, Any] = {
        "tokenizer_class": TOKENIZER_CLASS,
        "model": model_id,
        "model_max_length": description.context_length,
        "add_bos_token": description.add_bos_token,
        "bos_token": description.bos_token,
        "bos_token_id": description.bos_token_id,
        "eos_token": description.eos_token,
        "eos_token_id": description.eos_token_ids[0] if description.eos_token_ids else None,
        "eos_token_ids": list(description.eos_token_ids),
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "added_tokens_decoder": {
            str(token_id): {
                "content": token.content,
                "lstrip": token.lstrip,
                "normalized": token.normalized,
                "rstrip": token.rstrip,
                "single_word": token.single_word,
                "special": token.special,
            }
            for token_id, token in sorted(added.items())
        },
    }
    if description.chat_template:
        info["chat_template"] = description.chat_template
    return info


@router.post("/tokenize")
@takes(TokenizeRequest)
async def tokenize(request: Request) -> Response:
    return await run_route(request, TokenizeRoute())


@router.post("/detokenize")
@takes(DetokenizeRequest)
async def detokenize(request: Request) -> Response:
    return await run_route(request, DetokenizeRoute())


@router.get(
    "/tokenizer_info",
    openapi_extra={
        "parameters": [query("model", {"type": "string"}, "The model (default: the first chat model).")]
    },
)
@takes(None)
async def tokenizer_info_route(request: Request) -> Response:
    return await run_route(request, TokenizerInfoRoute())
