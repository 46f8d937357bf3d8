"""Ollama's wire shapes: `options`, `keep_alive`, `format`, `think`, messages and tools, and
the pieces every /api/* route shares (model names, timestamps, the route base class).

`options`: honoured are num_predict (-1 and -2: until a stop or the context is full),
temperature, top_k, top_p, min_p, seed, stop, repeat_penalty, presence_penalty and
frequency_penalty. Named in `x-argosy-degraded` (`options.<name>`): `num_ctx` when it is not
the model's context length (the context is fixed when the model loads), `repeat_last_n`
other than -1 (the penalties here look at the whole context), the load-time options (numa,
num_batch, num_gpu, main_gpu, low_vram, f16_kv, logits_all, vocab_only, use_mmap, use_mlock,
embedding_only, num_thread, num_keep), the samplers this server has not (tfs_z, typical_p,
mirostat, mirostat_tau, mirostat_eta, penalize_newline) and any option it does not know.

Model names: Ollama's `name:tag`; `:latest` is the tag a bare name means, so `smollm2:latest`
names the model `smollm2`.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from argosy.api.function_tools import call_from_wire, tool_choice_from_wire, tools_from_wire
from argosy.api.route import BodyT, ModelRoute, RouteCall
from argosy.api.wire import StopField, WireModel, named_unknown
from argosy.chat.messages import (
    Message,
    OutputFormat,
    ToolChoice,
    ToolDefinition,
)
from argosy.core.registry import ModelRegistry
from argosy.errors import InvalidRequestError
from argosy.sampling_params import RequestSampling

LATEST = ":latest"
MAX_TOP_LOGPROBS = 20  # Ollama's range for top_logprobs
THINK_LEVELS = ("low", "medium", "high")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
# Options Ollama knows that change nothing here: load-time settings and samplers we have not.
NOT_HONOURED_OPTIONS = (
    "numa",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "embedding_only",
    "num_thread",
    "num_keep",
    "tfs_z",
    "typical_p",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "penalize_newline",
)
_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid '{param}': {message}.", param)


def core_model_name(name: str | None) -> str | None:
    """The model a `name:tag` means (`:latest` is a bare name's tag)."""
    return name.removesuffix(LATEST) if name is not None else None


def wire_model_name(model_id: str) -> str:
    """Our model id as Ollama lists one: `name:tag` (a bare id gets `:latest`)."""
    return model_id if ":" in model_id else model_id + LATEST


def timestamp(when: datetime | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes `created_at`."""
    return (when or datetime.now(UTC)).isoformat().replace("+00:00", "Z")


def in_seconds(seconds: float) -> str:
    return timestamp(datetime.now(UTC) + timedelta(seconds=seconds))


def nanoseconds(seconds: float | None) -> int:
    return max(0, round((seconds or 0.0) * 1e9))


def parse_keep_alive(value: Any, param: str = "keep_alive") -> float | None:
    """Seconds a model stays loaded after this request (negative: forever), from a number of
    seconds or a Go duration string ("5m", "1h30m", "-1s", "0"); None when not sent."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise _refuse(param, "expected a number of seconds or a duration such as '5m'")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise _refuse(param, "expected a finite number of seconds")
        return float(value)
    if not isinstance(value, str):
        raise _refuse(param, "expected a number of seconds or a duration such as '5m'")
    text = value.strip()
    try:
        return float(text)  # "300" and "-1": seconds, as a number would be
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _GO_DURATION.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise _refuse(param, f"{value!r} is not a duration (such as '30s', '5m', '1h30m')")
    return sign * sum(float(number) * _GO_UNITS[unit] for number, unit in parts)


def apply_keep_alive(value: Any, call: RouteCall) -> None:
    """A request's `keep_alive` for the model it runs on, through the registry."""
    seconds = parse_keep_alive(value)
    if seconds is not None:
        registry: ModelRegistry = call.request.app.state.registry
        registry.set_keep_alive(registry.resolve(call.model_id), seconds)


# -- options -----------------------------------------------------------------------------------


class Options(WireModel):
    """Ollama's `options`: the sampling it honours checked strictly (a 400 names
    `options.<field>`); the others accepted and named as degraded."""

    model_config = ConfigDict(extra="allow", strict=True)

    num_predict: int | None = Field(None, ge=-2)
    num_ctx: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: StopField = None
    repeat_penalty: float | None = Field(None, ge=0.0)  # 0: off (as 1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repeat_last_n: int | None = Field(None, ge=-1)

    def check(self) -> None:
        if self.num_predict == 0:
            raise _refuse(
                "options.num_predict", "expected a positive number of tokens, or -1 / -2 for no limit"
            )

    def max_tokens(self) -> int | None:
        return None if self.num_predict is None or self.num_predict < 0 else self.num_predict

    def degraded(self, context_length: int | None) -> list[str]:
        extra = self.model_extra or {}
        named = [f"options.{name}" for name in NOT_HONOURED_OPTIONS if extra.get(name) is not None]
        unknown = [name for name in extra if name not in NOT_HONOURED_OPTIONS]
        if self.num_ctx is not None and self.num_ctx != context_length:
            named.append("options.num_ctx")
        if self.repeat_last_n is not None and self.repeat_last_n != -1:
            named.append("options.repeat_last_n")
        return named + [f"options.{name}" for name in named_unknown(unknown)]


def sampling(options: Options | None, *, logprobs: int | None) -> RequestSampling:
    options = options or Options.model_validate({})
    return RequestSampling(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        seed=options.seed,
        stop=options.stop,
        repetition_penalty=options.repeat_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        max_tokens=options.max_tokens(),
        logprobs=logprobs,
    )


# -- what generate and chat share ------------------------------------------------------------


class GenerationFields(WireModel):
    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    options: Options | None = None
    format: Any = None  # "json" or a JSON schema
    keep_alive: Any = None
    think: Any = None  # true / false / "low" / "medium" / "high"
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def check(self) -> None:
        if self.options is not None:
            self.options.check()
        self.keep_alive_s()
        self.output_format()
        self.think_kwargs()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true.", "top_logprobs")

    def keep_alive_s(self) -> float | None:
        return parse_keep_alive(self.keep_alive)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_format(self) -> OutputFormat | None:
        """`format`: "json" (any JSON object) or a JSON schema (held to it); "" is none."""
        value = self.format
        if value is None or value == "":
            return None
        if value == "json":
            return OutputFormat(kind="json_object")
        if isinstance(value, dict):
            return OutputFormat(kind="json_schema", schema=value, name="format", strict=True)
        raise _refuse("format", 'expected "json" or a JSON schema object')

    def think_kwargs(self) -> dict[str, Any]:
        """`think` as template variables: true/false switch `enable_thinking`; a level also
        sets `reasoning_effort`."""
        think = self.think
        if think is None:
            return {}
        if isinstance(think, bool):
            return {"enable_thinking": think}
        if isinstance(think, str) and think in THINK_LEVELS:
            return {"enable_thinking": True, "reasoning_effort": think}
        raise _refuse("think", f"expected true, false or one of {', '.join(THINK_LEVELS)}")

    @property
    def asks_thinking(self) -> bool:
        return self.think is not None and self.think is not False

    def degraded_fields(self, context_length: int | None) -> list[str]:
        options = self.options.degraded(context_length) if self.options is not None else []
        return options + named_unknown(self.model_extra or {})


class OllamaRoute(ModelRoute[BodyT]):
    """An /api/* model route: `name:latest` names the model `name`."""

    kind: ClassVar[str | tuple[str, ...] | None] = "chat"

    def model_name(self, body: BodyT) -> str | None:
        return core_model_name(getattr(body, "model", None))


# -- messages and tools ------------------------------------------------------------------------


class ChatMessage(WireModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an assistant turn's reasoning, handed back
    images: list[Any] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None  # a tool result: the tool that produced it
    tool_call_id: str | None = None


def neutral_messages(messages: list[ChatMessage]) -> list[Message]:
    """The messages in neutral terms; a malformed tool call is a 400 naming it."""
    neutral = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        calls = [
            call_from_wire(call, f"{where}.tool_calls[{index}]")
            for index, call in enumerate(message.tool_calls or [])
        ]
        neutral.append(
            Message(
                role=message.role,
                content=message.content,
                name=message.tool_name if message.role == "tool" else None,
                reasoning=message.thinking if message.role == "assistant" else None,
                tool_calls=calls,
                tool_call_id=message.tool_call_id,
            )
        )
    return neutral


def tool_choice_of(value: Any, tools: list[ToolDefinition]) -> ToolChoice:
    """`tool_choice`, an Argosy extension Ollama has not (it always leaves the choice to the
    model), in OpenAI's shapes — a forced call is held to its tool's schema; a named tool
    must be one of `tools`."""
    choice = tool_choice_from_wire(value)
    if choice.mode == "named" and choice.name not in {tool.name for tool in tools}:
        raise _refuse("tool_choice.function.name", f"no tool named {choice.name!r} is in 'tools'")
    return choice


def tool_definitions(tools: list[Any] | None) -> list[ToolDefinition]:
    """`tools` in OpenAI's shape (Ollama takes names of up to 128 characters)."""
    return tools_from_wire(tools, max_name_chars=128)


def tool_call_json(call_id: str, call_index: int, name: str, arguments: str) -> dict[str, Any] | None:
    """A call as Ollama answers one (arguments an object); None if its arguments are not one."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {"id": call_id, "function": {"index": call_index, "name": name, "arguments": value}}
