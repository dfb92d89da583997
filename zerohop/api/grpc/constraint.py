"""GenerateRequest's `constraint` as the grammar the output is decoded by."""

from __future__ import annotations

from collections.abc import Callable

from zerohop.api.errors import ApiError
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.structured import grammar as g
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb

_BUILDERS: dict[str, Callable[[pb.Constraint], str]] = {
    "json_schema": lambda c: g.json_schema_grammar(c.json_schema),
    "regex": lambda c: g.regex_grammar(c.regex),
    "choice": lambda c: g.choice_grammar(list(c.choice.choices)),
    "grammar": lambda c: g.lark_grammar(c.grammar),
    "json_object": lambda c: g.json_object_grammar(),
}


def constraint_grammar(request: pb.GenerateRequest) -> str | None:
    """The grammar of `constraint`, or None; a constraint that cannot compile is a 400."""
    if not request.HasField("constraint"):
        return None
    constraint = request.constraint
    kind = constraint.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not constraint.json_object):
        message = "constraint: set one of json_schema, regex, choice, grammar or json_object"
        raise ApiError(400, message, "constraint")
    try:
        return _BUILDERS[kind](constraint)
    except InvalidRequestError as exc:
        raise ApiError(400, f"constraint.{kind}: {exc}", "constraint") from None
