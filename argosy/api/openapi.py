"""The server's own OpenAPI document, served at GET /openapi.json.

Every route the app registers is in it (FastAPI lists them), with what FastAPI cannot see
because the model routes read their bodies themselves (argosy/api/route.py):
- the request body of each route marked with `takes(Model)`: the pydantic model's JSON schema
  (all models' definitions in components/schemas, names made unique by pydantic);
- the media types it answers with: JSON, and an SSE stream where `streams=True` (Ollama's
  routes: an NDJSON stream, `streams=NDJSON`);
- the error envelope on every 4xx and 5xx (`{"error": {"message", "type", "param", "code"}}`,
  Anthropic's `{"type": "error", "error": {"type", "message"}}` or Ollama's `{"error": "…"}`
  on theirs);
- query parameters the handler reads, from `query(...)` in the route's `openapi_extra`.

tests/faults/test_fuzz.py fuzzes the server against this document (and the OpenAI routes
against OpenAI's published one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from argosy import __version__

EndpointT = TypeVar("EndpointT", bound=Callable[..., Any])

_BODY = "__argosy_body__"
_SCHEMAS = "#/components/schemas/"
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
OLLAMA_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}
ERROR_SCHEMAS = {
    "Error": ERROR_SCHEMA,
    "AnthropicError": ANTHROPIC_ERROR_SCHEMA,
    "OllamaError": OLLAMA_ERROR_SCHEMA,
}
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


# one server-sent event, as schemathesis checks each event of a stream
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
}


def takes(
    body: type[BaseModel] | None,
    *,
    streams: bool | str = False,
    errors: str = "Error",
    upload: str | None = None,
    answers: str | None = None,
) -> Callable[[EndpointT], EndpointT]:
    """Mark an endpoint as reading a JSON body of type `body` (None: no body); `streams`: it
    answers with an SSE stream (or one of this media type) when the body asks for one;
    `errors`: its error envelope (a key of ERROR_SCHEMAS); `upload`: the body is
    multipart/form-data, `body`'s fields plus this required file part; `answers`: the media
    type of its successful answer when that is not JSON (audio)."""
    if errors not in ERROR_SCHEMAS:
        raise ValueError(f"unknown error envelope {errors!r}")

    def mark(endpoint: EndpointT) -> EndpointT:
        setattr(endpoint, _BODY, (body, streams, errors, upload, answers))
        return endpoint

    return mark


def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """One query parameter, for a route's `openapi_extra={"parameters": [...]}`."""
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def openapi_document(app: FastAPI, routers: list[APIRouter]) -> dict[str, Any]:
    """The document of `app`, whose routes are those of `routers` (included without prefix)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = get_openapi(title="Argosy", version=__version__, routes=app.routes)
    routes = [route for router in routers for route in router.routes if isinstance(route, APIRoute)]
    marked = [(route, getattr(route.endpoint, _BODY)) for route in routes if hasattr(route.endpoint, _BODY)]
    refs, definitions = models_json_schema(
        [(body, "validation") for _, (body, *_) in marked if body is not None],
        ref_template=_SCHEMAS + "{model}",
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(definitions.get("$defs", {}))
    schemas.update(ERROR_SCHEMAS)
    bodies = {
        id(route): (refs[(body, "validation")] if body is not None else None, *rest)
        for route, (body, *rest) in marked
    }
    for route in routes:
        if not route.include_in_schema:
            continue
        for method in route.methods or ():
            operation = document["paths"][route.path_format][method.lower()]
            schema, streams, errors, upload, answers = bodies.get(
                id(route), (None, False, "Error", None, None)
            )
            if schema is not None and upload is not None:
                form = {
                    "allOf": [schema],
                    "properties": {upload: {"type": "string", "format": "binary"}},
                    "required": [upload],
                }
                operation["requestBody"] = {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": form}},
                }
            elif schema is not None:
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                }
            _document_responses(operation, streams=streams, errors=errors, answers=answers)
    app.openapi_schema = document
    return document


def _document_responses(
    operation: dict[str, Any], *, streams: bool | str, errors: str, answers: str | None = None
) -> None:
    responses = operation.setdefault("responses", {})
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if answers is not None:
        ok["content"] = {answers: {"schema": {"type": "string", "format": "binary"}}}
    content = ok.setdefault("content", {"application/json": {"schema": {}}})
    if streams is True or streams == SSE:
        content[SSE] = {"schema": SSE_EVENT}
    elif streams:
        content[str(streams)] = {"schema": {}}
    responses.pop("422", None)  # FastAPI's validation error: this server answers 400 instead
    error = {"content": {"application/json": {"schema": {"$ref": _SCHEMAS + errors}}}}
    responses.setdefault("4XX", {"description": "The request is refused", **error})
    responses.setdefault("5XX", {"description": "The server could not serve it", **error})
