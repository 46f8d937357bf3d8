"""Stored responses: a response is a session (SPEC §5), and its JSON is rebuilt from it.

The response id is `resp_` + the session id. The session's metadata holds what the response
echoes (model, instructions, tools, sampling...) plus `prompt_ids` (the prompt as the model
saw it, which a continuation extends) and where this turn starts in the log: events
`input_from_seq` .. `output_from_seq - 1` are its new input, events from `output_from_seq` on
its output. A response created with `store: false` is an ephemeral session: it is recorded
(every generation runs in a session) but never found by id.

Status from the log: a Finished "stop"/"tool_calls" is completed, "length" incomplete
(max_output_tokens), "abort" cancelled (the client went away), "error" failed; no Finished
is in_progress while this process still generates it, else failed: the server stopped
(crashed) mid-generation, and the session ends at its last committed event.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from argosy.api.openai.responses.items import output_items
from argosy.errors import NotFoundError
from argosy.sessions.events import Finished, SessionEvent, SpanGenerated
from argosy.sessions.store import Session, SessionStore, StoredEvent

RESPONSE_KIND = "response"
_RESPONSE_ID = re.compile(r"^resp_([0-9a-f]{32})$")
_STATUS_OF_FINISH = {
    "stop": "completed",
    "tool_calls": "completed",
    "length": "incomplete",
    "abort": "cancelled",
    "error": "failed",
}


def response_id_of(session_id: str) -> str:
    return f"resp_{session_id}"


def not_found(response_id: str, param: str | None = None) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param=param)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    session: Session
    events: list[StoredEvent]

    @property
    def key(self) -> str:
        return self.session.id

    @property
    def metadata(self) -> dict[str, Any]:
        return self.session.metadata

    @property
    def output_events(self) -> list[SessionEvent]:
        start = int(self.metadata.get("output_from_seq", 1))
        return [e.event for e in self.events if e.seq >= start]

    @property
    def prior_events(self) -> list[StoredEvent]:
        """Everything before this turn's output: earlier turns and this turn's input."""
        start = int(self.metadata.get("output_from_seq", 1))
        return [e for e in self.events if e.seq < start]

    @property
    def finish(self) -> Finished | None:
        return next((e for e in self.output_events if isinstance(e, Finished)), None)


def load_response(store: SessionStore, response_id: str, param: str | None = None) -> StoredResponse:
    """The stored response `response_id` (blocking: run it on a worker thread)."""
    match = _RESPONSE_ID.match(response_id)
    session = store.get(match.group(1)) if match else None
    if session is None or session.is_ephemeral or session.metadata.get("kind") != RESPONSE_KIND:
        raise not_found(response_id, param)
    try:
        events = store.read(session.id)
    except NotFoundError:  # deleted in between
        raise not_found(response_id, param) from None
    return StoredResponse(session, events)


def usage_json(usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    completion_tokens = int(usage.get("completion_tokens", 0))
    body: dict[str, Any] = {
        "input_tokens": prompt_tokens,
        # cache_write_tokens (required by the spec) counts writes a client asks for; here the
        # prefix cache fills itself, so there are none to report
        "input_tokens_details": {
            "cached_tokens": int(usage.get("cached_tokens", 0)),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if "spec_proposed_tokens" in usage:  # speculative decoding was on (an extension)
        body["speculative"] = {
            "proposed_tokens": int(usage["spec_proposed_tokens"]),
            "accepted_tokens": int(usage.get("spec_accepted_tokens", 0)),
        }
    return body


def reasoning_tokens(events: list[SessionEvent]) -> int:
    return sum(len(e.token_ids) for e in events if isinstance(e, SpanGenerated) and e.channel == "reasoning")


def response_json(
    response_id: str,
    echo: dict[str, Any],
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object; `echo` holds the request fields it repeats (see the module doc).
    `usage` (none until it finishes) and `user` (none asked) are left out when absent: the spec
    makes neither nullable nor required."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    body: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": echo.get("created_at", int(time.time())),
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "model": echo.get("model"),
        "output": output,
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
        "store": echo.get("store", True),
        "temperature": echo.get("temperature"),
        "text": echo.get("text", {"format": {"type": "text"}}),
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": [tool_json(tool) for tool in echo.get("tools", [])],
        "top_p": echo.get("top_p"),
        "top_logprobs": echo.get("top_logprobs"),
        "truncation": "disabled",
        "metadata": echo.get("metadata") or {},
        "background": bool(echo.get("background", False)),
    }
    if usage is not None:
        body["usage"] = usage
    if echo.get("user") is not None:
        body["user"] = echo["user"]
    return body


def tool_json(tool: dict[str, Any]) -> dict[str, Any]:
    """A request's tool as the response repeats it. A function tool states the `parameters`
    and `strict` it ran with (the spec requires both): no parameters is null, and `strict` is
    true only when asked (request.tool_definitions reads it so)."""
    if tool.get("type") != "function":
        return tool
    return {**tool, "parameters": tool.get("parameters"), "strict": tool.get("strict") is True}


def finished_response_json(
    response_id: str, echo: dict[str, Any], output_events: list[SessionEvent], output: list[dict[str, Any]]
) -> dict[str, Any]:
    """A response whose generation ended (`output_events` end with its Finished)."""
    finish = next((e for e in output_events if isinstance(e, Finished)), None)
    reason = finish.reason if finish is not None else "error"
    status = _STATUS_OF_FINISH.get(reason, "completed")
    error = None
    if status == "failed":
        error = {"code": "server_error", "message": "The generation failed before it finished."}
    usage = usage_json(finish.usage, reasoning_tokens(output_events)) if finish is not None else None
    return response_json(response_id, echo, status=status, output=output, usage=usage, error=error)


def stored_response_json(
    stored: StoredResponse, *, is_in_flight: bool, status_in_flight: str = "in_progress"
) -> dict[str, Any]:
    response_id = response_id_of(stored.key)
    echo = stored.metadata.get("response", {})
    events = stored.output_events
    output = output_items(events, stored.key) if events else []
    if stored.finish is not None:
        return finished_response_json(response_id, echo, events, output)
    if is_in_flight:  # in_progress, or queued (a background response not yet started)
        return response_json(response_id, echo, status=status_in_flight, output=output, usage=None)
    error = {
        "code": "server_error",
        "message": "The server stopped while this response was generated; it ends at its last committed event.",
    }
    return response_json(response_id, echo, status="failed", output=output, usage=None, error=error)
