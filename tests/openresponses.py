"""The Open Responses OpenAPI document (tests/fixtures/openresponses_openapi.json, version
2026-04-24: public/openapi/openapi.json of github.com/openresponses/openresponses at commit
1e33c10fb3c19480751658eae966dad8e9c91514, unmodified; specification text licensed CC-BY-4.0
by the project's charter) as jsonschema validators (Draft 2020-12, `#/components/schemas/...`
refs resolved against the whole document; OpenAPI's `discriminator` is ignored, the `oneOf`s
decide), with readable reasons: what tests/test_responses_openapi.py and
tests/test_responses_spec.py check the Responses surface's objects and events against."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC = json.loads(
    (Path(__file__).parent / "fixtures" / "openresponses_openapi.json").read_text("utf-8")
)
SPEC_URI = "urn:openresponses:2026-04-24"
REGISTRY: Registry[Any] = Registry().with_resource(
    SPEC_URI, Resource(contents=SPEC, specification=DRAFT202012)
)


def _ref(name: str) -> str:
    return f"{SPEC_URI}#/components/schemas/{name}"


def event_schemas() -> dict[str, str]:
    """Event type -> the schema the `text/event-stream` oneOf names for it."""
    post = SPEC["paths"]["/responses"]["post"]
    stream = post["responses"]["200"]["content"]["text/event-stream"]["schema"]
    names = [branch["$ref"].rsplit("/", 1)[1] for branch in stream["oneOf"]]
    schemas = SPEC["components"]["schemas"]
    return {schemas[n]["properties"]["type"]["enum"][0]: n for n in names}


EVENTS = event_schemas()


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": _ref(name)}, registry=REGISTRY)


def violations(name: str, instance: Any, where: str = "") -> list[str]:
    """Where `instance` breaks the spec's schema `name`: one line per reason."""
    return [line for e in validator(name).iter_errors(instance) for line in _why(e, where)]


def _why(error: ValidationError, where: str) -> list[str]:
    """The leaf reasons of `error`. A failed oneOf/anyOf says only that no branch matched;
    the reasons are those of the branches whose kind (`type` property, or JSON type) did
    match, or of every branch where none did."""
    if not error.context:
        path = "/".join(str(p) for p in error.absolute_path)
        return [f"{where}/{path}: {error.message[:300]}"]
    branches: dict[Any, list[ValidationError]] = {}
    for e in error.context:
        branches.setdefault(e.schema_path[0], []).append(e)
    kinded = [es for es in branches.values() if not any(_wrong_kind(e) for e in es)]
    chosen = kinded or list(branches.values())
    return [line for es in chosen for e in es for line in _why(e, where)]


def _wrong_kind(error: ValidationError) -> bool:
    path = list(error.relative_path)
    if error.validator in ("type", "enum", "const") and not path:
        return True
    return path == ["type"] and error.validator in ("enum", "const")


# The spec names the reasoning text events `response.reasoning.delta` / `.done`; OpenAI's API
# (and so the openai SDK's event union, and Codex) names them `response.reasoning_text.*`,
# which zerohop keeps: such an event is checked against the spec's schema under its name.
SPEC_NAMES = {
    "response.reasoning_text.delta": "response.reasoning.delta",
    "response.reasoning_text.done": "response.reasoning.done",
}


def event_violations(events: list[dict[str, Any]], where: str) -> list[str]:
    found = []
    for n, event in enumerate(events):
        at = f"{where}[{n}] {event.get('type')}"
        kind = SPEC_NAMES.get(event.get("type", ""), event.get("type", ""))
        name = EVENTS.get(kind)
        if name is None:
            found.append(f"{at}: a type the spec's event-stream oneOf does not name")
            continue
        found += violations(name, {**event, "type": kind}, at)
    return found
