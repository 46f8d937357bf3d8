"""OpenAI's published OpenAPI spec as a validator for the JSON the server emits.

`validate("CreateChatCompletionResponse", body)` checks `body` against
`#/components/schemas/CreateChatCompletionResponse` of openai/openai-openapi at f85dbe2 (the
copy in `tests/fixtures/openai-openapi.schemas.json`: the component schemas the OpenAI routes
answer with and everything they reference, plus the operations the server implements for
tests/faults/test_fuzz.py, verbatim, so a clean clone needs no 3 MB spec file) and raises SchemaViolation naming the path of
the failing field (`$.choices[0].message`) and the rule it breaks.

The spec is OpenAPI 3.1 (JSON Schema 2020-12), checked by `jsonschema`'s 2020-12 validator
with a `referencing` registry holding the spec, so `#/components/schemas/X` refs resolve.
OpenAPI-only keywords are read as OpenAPI means them:
- `discriminator`, `x-*`, `example`: annotations, ignored (as JSON Schema ignores them).
- `nullable: true`, an OpenAPI 3.0 keyword some 3.1 schemas here still carry
  (`CreateChatCompletionStreamResponse.choices[].finish_reason`, `.usage`): the schema or null.
  A 2020-12 validator ignores it, which would reject the null the spec's authors allow.
- `format` is not asserted (2020-12's default; `unixtime` is no JSON Schema format anyway).

Regenerate the fixture from a full spec file with
`python -m tests.openai_schema path/to/openai-openapi.json` (ROOTS lists what it keeps).
"""

from __future__ import annotations

import copy
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PATH = Path(__file__).resolve().parent / "fixtures" / "openai-openapi.schemas.json"
SPEC_URI = "urn:openai-openapi"
SCHEMAS = "#/components/schemas/"
# The schemas the OpenAI routes answer with; the fixture keeps these and all they reference.
ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "Model",
    "Response",
    "ResponseStreamEvent",
    "ResponseItemList",
    "ErrorResponse",
    "CreateTranscriptionResponseJson",
    "CreateTranscriptionResponseVerboseJson",
    "TranscriptTextDeltaEvent",
    "TranscriptTextDoneEvent",
)

# The operations the server implements, kept (verbatim) for fuzzing: tests/faults/test_fuzz.py
# generates requests from their request schemas and checks the answers against their responses.
OPERATIONS = {
    "/chat/completions": ("post",),
    "/completions": ("post",),
    "/embeddings": ("post",),
    "/models": ("get",),
    "/models/{model}": ("get",),
    "/responses": ("post",),
    "/responses/{response_id}": ("get", "delete"),
    "/responses/{response_id}/cancel": ("post",),
    "/responses/{response_id}/input_items": ("get",),
}
RESPONSES = "#/components/responses/"


class SchemaViolation(AssertionError):
    """An instance that does not validate; the message names each failing path."""


def with_nullable(node: Any) -> Any:
    """A copy of `node` where every schema with `nullable: true` becomes `anyOf [it, null]`."""
    if isinstance(node, list):
        return [with_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: with_nullable(value) for key, value in node.items()}
    if converted.get("nullable") is True:
        del converted["nullable"]
        return {"anyOf": [converted, {"type": "null"}]}
    converted.pop("nullable", None)  # `nullable: false` says nothing a schema does not
    return converted


@cache
def _registry() -> Registry[Any]:
    spec = with_nullable(json.loads(SPEC_PATH.read_text()))
    resource = Resource.from_contents(spec, default_specification=DRAFT202012)
    return Registry().with_resource(SPEC_URI, resource)


@cache
def _validator(schema_name: str) -> jsonschema.protocols.Validator:
    spec = _registry().contents(SPEC_URI)
    if schema_name not in spec["components"]["schemas"]:
        raise KeyError(f"{schema_name!r} is not in {SPEC_PATH.name}; add it to ROOTS and regenerate")
    schema = {"$ref": f"{SPEC_URI}{SCHEMAS}{schema_name}"}
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def _leaves(error: jsonschema.ValidationError) -> list[jsonschema.ValidationError]:
    """The failures that explain `error`. For a failed anyOf/oneOf, the failures inside the one
    arm the instance was meant for: the arm whose root type and `type` property (the
    discriminator of events and items) it has, when only one does; otherwise the best match."""
    if not error.context:
        return [error]
    arms: dict[Any, list[jsonschema.ValidationError]] = {}
    for sub in error.context:
        arms.setdefault(sub.relative_schema_path[0], []).append(sub)
    meant = [errors for errors in arms.values() if not any(_is_kind_mismatch(sub) for sub in errors)]
    if len(meant) == 1:
        return [leaf for sub in meant[0] if sub.parent is error for leaf in _leaves(sub)]
    if not meant:
        return [error]  # no arm of this kind: the union itself is what fails
    return [jsonschema.exceptions.best_match(error.context)]


def _is_kind_mismatch(error: jsonschema.ValidationError) -> bool:
    """A wrong JSON type for the whole instance, or a wrong `type` property."""
    path = list(error.relative_path)
    return (not path and error.validator == "type") or path == ["type"]


def _describe(error: jsonschema.ValidationError) -> str:
    shown = json.dumps(error.instance, ensure_ascii=False)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return f"{error.json_path}: {error.message[:300]} (value {shown})"


def violations(schema_name: str, instance: Any) -> list[str]:
    """Each failure of `instance` against the named component schema (empty: it validates)."""
    errors = _validator(schema_name).iter_errors(instance)
    leaves = [leaf for error in errors for leaf in _leaves(error)]
    return [_describe(leaf) for leaf in sorted(leaves, key=lambda e: e.json_path)]


def validate(schema_name: str, instance: Any) -> None:
    """Raise SchemaViolation naming every failing path unless `instance` validates."""
    found = violations(schema_name, instance)
    if found:
        listed = "\n  ".join(found)
        raise SchemaViolation(f"{schema_name}: {len(found)} violation(s):\n  {listed}")


# -- the fixture ---------------------------------------------------------------------------------


def referenced_schemas(schemas: dict[str, Any], roots: tuple[str, ...]) -> list[str]:
    """`roots` and every component schema they reach through `$ref`, sorted."""
    seen: set[str] = set()
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        stack: list[Any] = [schemas[name]]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith(SCHEMAS):
                    pending.append(ref.removeprefix(SCHEMAS))
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return sorted(seen)


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return own.union(*(_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node))
    return set()


def extract(full_spec: dict[str, Any]) -> dict[str, Any]:
    """ROOTS and OPERATIONS (with every schema and response they reference), verbatim."""
    paths = {
        path: {method: copy.deepcopy(full_spec["paths"][path][method]) for method in methods}
        for path, methods in OPERATIONS.items()
    }
    responses = {
        ref.removeprefix(RESPONSES): copy.deepcopy(
            full_spec["components"]["responses"][ref.removeprefix(RESPONSES)]
        )
        for ref in _refs(paths)
        if ref.startswith(RESPONSES)
    }
    reached = {ref.removeprefix(SCHEMAS) for ref in _refs([paths, responses]) if ref.startswith(SCHEMAS)}
    schemas = full_spec["components"]["schemas"]
    kept = {
        name: copy.deepcopy(schemas[name]) for name in referenced_schemas(schemas, (*ROOTS, *sorted(reached)))
    }
    return {
        "openapi": full_spec["openapi"],
        "info": {
            "title": full_spec["info"]["title"],
            "version": full_spec["info"]["version"],
            "license": full_spec["info"].get("license"),
            "x-argosy": (
                "openai/openai-openapi at f85dbe2: the operations in tests/openai_schema.py OPERATIONS and "
                "the components/schemas they and ROOTS reach, verbatim"
            ),
        },
        "paths": paths,
        "components": {"schemas": kept, "responses": responses},
    }


if __name__ == "__main__":
    subset = extract(json.loads(Path(sys.argv[1]).read_text()))
    SPEC_PATH.parent.mkdir(parents=True, exist_ok=True)
    SPEC_PATH.write_text(json.dumps(subset, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"{SPEC_PATH}: {len(subset['paths'])} paths, {len(subset['components']['schemas'])} schemas")
