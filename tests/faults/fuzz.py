"""Schema-driven fuzzing of a real server with schemathesis (used by test_fuzz.py and `make fuzz`).

Two documents drive it: the server's own (GET /openapi.json: every route it registers, with
the request bodies its pydantic models accept) and OpenAI's published one for the routes the
server implements (tests/fixtures/openai-openapi.schemas.json, `paths`). For every operation,
in both generation modes (positive: bodies the document allows; negative: bodies it forbids),
hypothesis generates `examples` requests from a fixed seed; each answer is checked with
schemathesis' `not_a_server_error`, `response_schema_conformance` and
`content_type_conformance`. A failed check is recorded (with the request as a curl command)
and the run goes on, so one run reports every kind of failure at once; no shrinking, so the
time stays what the budget says.

Generated token budgets above MAX_TOKENS (or absent) are set to it (a fuzzed `max_tokens` of
10^9 would only make the run slow, and `max_tokens` limits have their own tests); everything
else goes to the server as generated.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance
from schemathesis.core.errors import UnsupportedSchema
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.schemas import OpenApiSchema

from argosy.api.openapi import SSE_EVENT
from tests.openai_schema import SPEC_PATH, with_nullable

CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
MAX_TOKENS = 4
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
REQUEST_TIMEOUT_S = 120


@dataclass
class FuzzReport:
    cases: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    per_operation: dict[str, int] = field(default_factory=dict)
    refusals: Counter[str] = field(default_factory=Counter)  # of valid-looking cases, by message

    def summary(self) -> str:
        statuses = " ".join(f"{status}:{count}" for status, count in sorted(self.by_status.items()))
        return f"{self.cases} cases, {len(self.failures)} failures; statuses {statuses}"


def _message(response: requests.Response) -> str:
    try:
        return str(response.json()["error"]["message"])[:100]
    except (ValueError, KeyError, TypeError):
        return response.text[:100]


def own_schema(base_url: str, headers: dict[str, str] | None = None) -> OpenApiSchema:
    document = requests.get(f"{base_url}/openapi.json", headers=headers, timeout=30).json()
    return schemathesis.openapi.from_dict(document)


def openai_schema() -> OpenApiSchema:
    """OpenAI's operations, read as OpenAI's API behaves where the document says otherwise:
    - `nullable: true` as OpenAPI 3.0 meant it (the spec is 3.1, where the keyword is ignored,
      but its authors still use it: see tests/openai_schema.py);
    - an error answer documented as a bare `Error` (the 404s of DELETE /responses/{id} and
      POST /responses/{id}/cancel) as the `ErrorResponse` envelope `{"error": Error}` that the
      API sends on every error and the openai SDK reads (`body["error"]`);
    - an embedding as a list of floats or, with `encoding_format: "base64"`, the base64 string
      the API sends (the document lists only the floats);
    - a completion's legacy logprobs with `echo`: the first prompt token's logprob and top
      logprobs are null, as the API sends them (nothing precedes that token; the document says
      a number and an object; tests/e2e/test_openai_schema.py strips that entry the same way);
    - the SSE streams the API sends where the document lists only JSON (a streamed completion,
      GET /responses/{id}?stream=true). Schemathesis checks each event of a stream as the
      object {event, data, id} against the documented schema, where OpenAI's document names the
      JSON inside `data`: every stream is checked here as events with a string `data`, and the
      JSON chunks and events themselves against OpenAI's schemas in tests/e2e/test_openai_schema.py."""
    document = with_nullable(json.loads(SPEC_PATH.read_text()))
    paths = document["paths"]
    for operation in (
        paths["/chat/completions"]["post"],
        paths["/completions"]["post"],
        paths["/responses"]["post"],
        paths["/responses/{response_id}"]["get"],
    ):
        operation["responses"]["200"]["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    embedding = document["components"]["schemas"]["Embedding"]["properties"]
    embedding["embedding"] = {"anyOf": [embedding["embedding"], {"type": "string"}]}
    choice = document["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]["items"]
    legacy = choice["properties"]["logprobs"]["anyOf"][0]["properties"]
    for key in ("token_logprobs", "top_logprobs"):
        legacy[key]["items"] = {"anyOf": [legacy[key]["items"], {"type": "null"}]}
    for operations in document["paths"].values():
        for operation in operations.values():
            for status, answer in operation.get("responses", {}).items():
                schema = answer.get("content", {}).get("application/json", {}).get("schema", {})
                if status[0] in "45" and schema.get("$ref") == "#/components/schemas/Error":
                    schema["$ref"] = "#/components/schemas/ErrorResponse"
    return schemathesis.openapi.from_dict(document)


def _bad_image_urls() -> list[str]:
    """data: URLs of images a server must refuse with a 400 naming the part: corrupt bytes, a
    truncated PNG, a format it does not read (TIFF), too many pixels (49M one-bit pixels in a
    few KB), no ;base64, characters that are not base64; and a remote URL (never fetched)."""
    import base64
    import io

    from PIL import Image

    def data_url(image: Any, kind: str, cut: int | None = None) -> str:
        out = io.BytesIO()
        image.save(out, format=kind)
        return "data:image/png;base64," + base64.b64encode(out.getvalue()[:cut]).decode()

    small = Image.new("RGB", (16, 16), (200, 30, 30))
    return [
        "data:image/png;base64," + base64.b64encode(b"no image format reads this" * 8).decode(),
        data_url(small, "PNG", cut=40),
        data_url(small, "TIFF"),
        data_url(Image.new("1", (7000, 7000)), "PNG"),
        "data:image/png,not-base64",
        "data:image/png;base64,@@@@",
        "https://example.com/cat.png",
    ]


BAD_IMAGE_URLS = _bad_image_urls()
_image_turns = itertools.count()


def _with_bad_images(body: dict[str, Any]) -> None:
    """Every image part a generated chat body holds gets one of BAD_IMAGE_URLS in turn (a
    generated url is nearly never a data: URL, so the image readers would go unfuzzed)."""
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        parts = message.get("content") if isinstance(message, dict) else None
        for part in parts if isinstance(parts, list) else []:
            if (
                isinstance(part, dict)
                and part.get("type") == "image_url"
                and isinstance(part.get("image_url"), dict)
            ):
                part["image_url"]["url"] = BAD_IMAGE_URLS[next(_image_turns) % len(BAD_IMAGE_URLS)]


def bounded(body: Any, model: str | None, path: str) -> Any:
    """`body` with its token budget at most MAX_TOKENS (set when absent: a chat completion
    without one may run to the end of the context), its image parts' urls bad images
    (_with_bad_images) and, where `model` is given, a model this server serves (a generated
    model name only ever meets the 404 for an unknown model)."""
    if isinstance(body, dict):
        _with_bad_images(body)
        if model is not None and "model" in body:
            body["model"] = model
        budget = "max_output_tokens" if path.endswith("/responses") else "max_tokens"
        if not path.endswith("/embeddings") and not any(key in body for key in TOKEN_FIELDS):
            body[budget] = MAX_TOKENS
        for key in TOKEN_FIELDS:
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                body[key] = MAX_TOKENS
            elif value is None and key in body:
                body[key] = MAX_TOKENS  # null is "the default": the rest of the context
    return body


def fuzz(
    schema: OpenApiSchema,
    base_url: str,
    report: FuzzReport,
    *,
    examples: int,
    seed: int,
    path_parameters: dict[str, list[str]] | None = None,
    models: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    only: str | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Fuzz every operation of `schema` against `base_url` (the prefix its paths go under).
    `path_parameters`: real values (e.g. stored response ids) that half the cases of an
    operation with that parameter use instead of generated ones. `models`: path suffix -> the
    model its positive cases name (e.g. "/embeddings" -> an embedding model). `headers`: sent
    with every case (an API key). `only`: a regular expression; the operations whose path it
    does not match are left out (a run of a few routes)."""
    session = requests.Session()
    session.headers.update(headers or {})
    for result in schema.get_all_operations():
        operation = result.ok()
        if only is not None and re.search(only, operation.path) is None:
            continue
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            strategies = [operation.as_strategy(generation_mode=mode)]
            for name, values in (path_parameters or {}).items():
                if f"{{{name}}}" in operation.path:
                    strategies += [
                        operation.as_strategy(generation_mode=mode, path_parameters={name: value})
                        for value in values
                    ]
            model = None
            if mode == schemathesis.GenerationMode.POSITIVE:
                model = next(
                    (m for suffix, m in (models or {}).items() if operation.path.endswith(suffix)), None
                )
            before = report.cases
            label = f"{operation.label} [{mode.value}]"
            try:
                with contextlib.suppress(hypothesis.errors.Unsatisfiable):  # nothing to make invalid
                    _fuzz_operation(
                        st.one_of(strategies), base_url, session, report, examples, seed, model, mode
                    )
            except UnsupportedSchema as exc:
                # the generator's limit, not the server's: OpenAI's document has `not` schemas that
                # schemathesis cannot negate below the root; which draws reach one varies with the
                # stored ids used as path parameters. The cases sent before it still count.
                log(f"fuzz {label}: schemathesis stopped generating: {str(exc)[:160]}")
            report.per_operation[label] = report.cases - before
            log(f"fuzz {label}: {report.cases - before} cases; {report.summary()}")


def _fuzz_operation(
    strategy: st.SearchStrategy[schemathesis.Case],
    base_url: str,
    session: requests.Session,
    report: FuzzReport,
    examples: int,
    seed: int,
    model: str | None,
    mode: schemathesis.GenerationMode,
) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis.seed(seed)
    @hypothesis.given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        case.body = bounded(case.body, model, case.operation.path)
        report.cases += 1
        try:
            response = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            report.failures.append(
                f"{case.operation.label}: transport error {exc!r}\n  {case.as_curl_command()}"
            )
            return
        report.by_status[response.status_code] = report.by_status.get(response.status_code, 0) + 1
        if mode == schemathesis.GenerationMode.POSITIVE and response.status_code >= 400:
            report.refusals[f"{case.operation.label} {response.status_code} {_message(response)}"] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, FailureGroup) as exc:  # a failed check, or several at once
            shown = str(exc).strip()[:1500]
            report.failures.append(f"{case.operation.label} -> {response.status_code}: {shown}")

    run()
