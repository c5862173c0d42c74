"""The fields of both OpenAI bodies that ask for structured outputs, and the
``StructuredOutputsParams`` they make (``workers/structured_output.py``):

- OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` (a schema left
  out is ``{}``: any JSON value); ``{"type": "text"}`` asks for nothing. vLLM takes it on
  completions too, and so does kvmesh.
- vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``, ``disable_any_whitespace``) and its older ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``.

One of them at most: two are a 400 naming the second, as vLLM refuses several kinds of
guided decoding. A bad schema, regex or grammar is a 400 naming the field it came in.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from kvmesh.cluster.api_error import ApiError, valid
from kvmesh.cluster.generate_body import Body
from kvmesh.cluster.unsupported_fields import only
from kvmesh.workers.structured_output import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_SPEC_CHARS,
    StructuredOutputsParams,
)

_SPEC = {"type": "string", "minLength": 1, "maxLength": MAX_SPEC_CHARS}
_CHOICES = {
    "type": "array",
    "items": {"type": "string", "minLength": 1, "maxLength": MAX_CHOICE_CHARS},
    "minItems": 1,
    "maxItems": MAX_CHOICES,
}
SpecString = Annotated[str | None, only(_SPEC)]
ChoiceList = Annotated[list[str] | None, only(_CHOICES)]
SchemaField = Annotated[dict[str, Any] | str | None, only({"type": "object"}, _SPEC)]


class JsonSchemaFormat(Body):
    """OpenAI's ``response_format.json_schema``; ``name``, ``description`` and ``strict`` are
    accepted and unused (the schema is always enforced, as ``strict: true`` asks)."""

    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: the alias is the JSON name.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(Body):
    """vLLM's ``structured_outputs`` object: one constraint."""

    # "json" would shadow a BaseModel method: the alias is the JSON name.
    json_: SchemaField = Field(None, alias="json")
    regex: SpecString = None
    choice: ChoiceList = None
    grammar: SpecString = Field(None, description="Lark, or llama.cpp's GBNF.")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(
        None, description="Compact JSON: no whitespace beyond what JSON needs."
    )
    structural_tag: Annotated[Any, only()] = Field(
        None, description="Not supported by kvmesh: only null is accepted, else a 400."
    )


class StructuredOutputFields(Body):
    """The structured-output fields of both bodies (the module docstring)."""

    STRUCTURED_FIELDS: ClassVar[tuple[str, ...]] = (
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    )

    response_format: ResponseFormat | None = Field(
        None,
        description='{"type": "json_object"} for any JSON object, {"type": "json_schema", '
        '"json_schema": {"name": ..., "schema": {...}}} for JSON that a schema allows; '
        '{"type": "text"} or null for none. "structural_tag" is refused.',
    )
    structured_outputs: StructuredOutputsBody | None = Field(
        None, description="vLLM's extension: one of json, regex, choice, grammar, json_object."
    )
    guided_json: SchemaField = Field(None, description="vLLM's extension: a JSON schema.")
    guided_regex: SpecString = Field(None, description="vLLM's extension: a regular expression.")
    guided_choice: ChoiceList = Field(
        None, description="vLLM's extension: the answer is one of these strings."
    )
    guided_grammar: SpecString = Field(
        None, description="vLLM's extension: a grammar, Lark or llama.cpp's GBNF."
    )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the body's structured-output field asks for (None: nothing); ApiError 400
        naming the field for two of them, or a bad schema, regex or grammar. Compiling a
        grammar is CPU work: callers on the event loop run this in a thread."""
        asked = {name: kw for name in self.STRUCTURED_FIELDS if (kw := self._asked(name))}
        if len(asked) > 1:
            first, second = list(asked)[:2]
            raise ApiError(
                400,
                f"{second}: give one kind of structured output; {first} is given too",
                param=second,
            )
        if not asked:
            return None
        ((name, kw),) = asked.items()
        return valid(lambda: StructuredOutputsParams(**kw), {"structured_outputs": name})

    def _asked(self, name: str) -> dict[str, Any] | None:
        """The field's StructuredOutputsParams arguments, or None when it asks for nothing."""
        value = getattr(self, name)
        if value is None:
            return None
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            kw = {
                "json": value.json_,
                "regex": value.regex,
                "choice": value.choice,
                "grammar": value.grammar,
                "json_object": value.json_object,
                "disable_any_whitespace": bool(value.disable_any_whitespace),
            }
            if value.structural_tag is not None:
                raise _structural_tag("structured_outputs")
            return kw
        return {name.removeprefix("guided_"): value}


def _response_format(fmt: ResponseFormat) -> dict[str, Any] | None:
    if fmt.type == "text":
        return None
    if fmt.type == "structural_tag":
        raise _structural_tag("response_format")
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None:
        raise ApiError(
            400,
            'response_format: "json_schema" needs a json_schema object: {"name": ..., '
            '"schema": {...}}',
            param="response_format",
        )
    schema = fmt.json_schema.json_schema
    return {"json": schema if schema is not None else {}}


def _structural_tag(field: str) -> ApiError:
    return ApiError(
        400,
        f"{field}: kvmesh does not support structural tags; send a JSON schema, a regex, a "
        "choice or a grammar",
        param=field,
    )
