"""OpenAI's tools on chat: ``tool_choice`` "required" or a named function, made by structured
outputs, as vLLM makes them without a tool-call parser.

- A named function (``{"type": "function", "function": {"name": "f"}}``): the answer is
  f's arguments, held to its ``parameters`` schema; one call of f.
- ``"required"``: the answer is a JSON list of ``{"name": ..., "parameters": {...}}``, each
  item one of the tools with its own schema (vLLM's format); one or more calls, at most one
  with ``parallel_tool_calls: false``.
- ``"none"``: no call; the tools still go to the chat template (vLLM's default).
- ``"auto"`` (the default when tools are given) needs a parser that finds calls in free text,
  model by model: refused with a 400 saying what to send instead, as vLLM refuses it when
  started without one.

The JSON is compact (no whitespace beyond what JSON needs): a small model given freedom of
whitespace can spend its tokens on it. The arguments are the model's own text, so a stream's
argument deltas join to exactly the response's ``arguments``.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema

from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.generate_body import Body
from kvmesh.workers.structured_output import StructuredOutputsParams

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit
# A function given no parameters takes none: its arguments are "{}".
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class FunctionDefinition(Body):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments; absent: none."
    )
    strict: bool | None = Field(None, description="Accepted: the schema is always enforced.")


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str = Field(pattern=NAME_PATTERN)  # a name no tool can have is refused as such


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


# "auto" is parsed, to be refused with what to send instead; the schema declares what is
# answered.
ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice | None,
    WithJsonSchema(
        {
            "anyOf": [
                {"enum": ["none", "required"]},
                {
                    "type": "object",
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "properties": {"name": {"type": "string", "pattern": NAME_PATTERN}},
                            "required": ["name"],
                        },
                    },
                    "required": ["type", "function"],
                },
                {"type": "null"},
            ]
        }
    ),
]
# Tools without a tool_choice ask for "auto": the schema says a tool_choice comes with them.
TOOLS_NEED_A_CHOICE = {
    "anyOf": [
        {"properties": {"tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}}},
        {"properties": {"tool_choice": {"not": {"type": "null"}}}, "required": ["tool_choice"]},
    ]
}


class CalledFunction(Body):
    name: str
    arguments: str


class MessageToolCall(Body):
    """A call in an earlier assistant message of the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


@dataclass(frozen=True)
class ToolCall:
    """A call as far as the answer's text goes."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCalling:
    """What a chat body's tools ask the answer to be: calls of ``tools``, all of ``named``
    when one is named."""

    tools: tuple[FunctionDefinition, ...]
    named: str | None = None
    parallel: bool = True

    def structured_outputs(self) -> StructuredOutputsParams:
        """The constraint on the answer; a 400 naming the tool whose schema is not an
        object's or does not compile."""
        params = {f.name: _parameters(f, i) for i, f in enumerate(self.tools)}
        if self.named is not None:
            i = next(i for i, f in enumerate(self.tools) if f.name == self.named)
            return _compiled(params[self.named], f"tools[{i}].function.parameters")
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return _compiled(schema, "tools")

    def reader(self) -> Callable[[str], list[ToolCall]]:
        """Reads an answer's text as it comes, piece by piece: every call so far, the last
        one's arguments as far as they go."""
        return _CallList().feed if self.named is None else _Named(self.named).feed

    def calls(self, text: str) -> list[ToolCall]:
        """The calls in a whole answer (a call cut by ``max_tokens`` has the arguments so
        far)."""
        return self.reader()(text)

    def finish_reason(self, reason: str) -> str:
        """OpenAI's: "tool_calls" when the model ended its calls itself, and "stop" for a
        named function, which the request forced; "length" and the rest as they are."""
        return "tool_calls" if reason == "stop" and self.named is None else reason


def tool_calling(
    tools: list[Tool] | None, choice: ToolChoice, parallel: bool | None
) -> ToolCalling | None:
    """What ``tools`` and ``tool_choice`` ask for (None: no calls); a 400 naming the field
    for a choice kvmesh cannot serve or a name the tools lack."""
    functions = tuple(t.function for t in tools or ())
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ApiError(400, f"tools: two functions are named {dup!r}", param="tools")
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if not functions:
        raise ApiError(400, "tool_choice: needs tools", param="tool_choice")
    if choice == "auto":
        raise ApiError(
            400,
            'tool_choice: "auto" needs a parser of the model\'s tool calls, which kvmesh does '
            'not have; send "required", a named function, or "none"',
            param="tool_choice",
        )
    if choice == "required":
        return ToolCalling(functions, parallel=parallel is not False)
    assert isinstance(choice, NamedToolChoice)
    if choice.function.name not in names:
        raise ApiError(
            400,
            f"tool_choice: no tool is named {choice.function.name!r}",
            param="tool_choice",
        )
    return ToolCalling(functions, named=choice.function.name)


class ToolCallDeltas:
    """A stream's tool calls, as OpenAI streams them: a call's first delta has its ``index``,
    ``id``, type and name, the later ones more of its arguments."""

    def __init__(self, calling: ToolCalling) -> None:
        self.read = calling.reader()
        self.ids: list[str] = []
        self.sent: list[int] = []  # characters of arguments sent, per call

    def add(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text``, the answer's next piece, makes."""
        deltas = []
        for k, call in enumerate(self.read(text)):
            if k == len(self.ids):
                self.ids.append(call_id())
                self.sent.append(len(call.arguments))
                head = {"index": k, "id": self.ids[k], "type": "function"}
                deltas.append(head | {"function": dataclasses.asdict(call)})
            elif len(call.arguments) > self.sent[k]:
                more = call.arguments[self.sent[k] :]
                self.sent[k] = len(call.arguments)
                deltas.append({"index": k, "function": {"arguments": more}})
        return deltas


def tools_refusal(e: ApiError) -> ApiError:
    """A worker's refusal of the calls' grammar (past llguidance's limits: the engine names
    it ``structured_outputs``, its own field) as the field the client sent, ``tools``."""
    if e.body["error"]["param"] != "structured_outputs":
        return e
    return ApiError(e.status, f"tools: {_why(e.body['error']['message'])}", param="tools")


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template gets them (transformers' ``tools``)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_tool_calls(calling: ToolCalling, text: str) -> list[dict[str, Any]]:
    """A whole answer's calls as the response's ``message.tool_calls`` (a call cut by
    ``max_tokens`` has the arguments so far)."""
    return [
        {"id": call_id(), "type": "function", "function": dataclasses.asdict(c)}
        for c in calling.calls(text)
    ]


def _parameters(f: FunctionDefinition, i: int) -> dict[str, Any]:
    """The schema of a function's arguments: an object's, as OpenAI has them (a schema that
    names no type gets "object")."""
    if f.parameters is None:
        return NO_PARAMETERS
    if f.parameters.get("type", "object") != "object":
        raise ApiError(
            400,
            f'tools[{i}].function.parameters: must describe an object ("type": "object"): '
            "a function's arguments are one",
            param=f"tools[{i}].function.parameters",
        )
    return {"type": "object", **f.parameters}


def _compiled(schema: dict[str, Any], where: str) -> StructuredOutputsParams:
    """The schema compiled; a 400 naming ``where`` with llguidance's reason when it does not."""
    try:
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    except ValueError as e:
        raise ApiError(400, f"{where}: {_why(str(e))}", param=where) from None


def _why(message: str) -> str:
    """A refusal of the calls' schema (``StructuredOutputsParams``': "structured_outputs:
    json: ...") as said of the tools."""
    why = message.removeprefix("structured_outputs: ").removeprefix("json: ")
    return f"the schema{why.removeprefix('json')}" if why.startswith("json is ") else why


_ITEM_HEAD = '{"name":"'
_ITEM_MID = ',"parameters":'


class _Named:
    """A named function's call: the whole answer is its arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.text = name, ""

    def feed(self, more: str) -> list[ToolCall]:
        self.text += more
        return [ToolCall(self.name, self.text)]


class _CallList:
    """The calls in ``[{"name":"f","parameters":{...}},...]``, compact, as the grammar writes
    it, read as the text comes: each character is looked at once, so a long stream costs no
    more than its text. Names match ``NAME_PATTERN``: no escapes."""

    def __init__(self) -> None:
        self.text = ""
        self.at = 1  # where the next item starts: after "[", then after "},"
        self.closed: list[ToolCall] = []
        self.open: tuple[str, int] | None = None  # the open call's name, where its arguments start
        self.scan = _ValueEnd(0)

    def feed(self, more: str) -> list[ToolCall]:
        """Every call so far, the last one's arguments as far as they go."""
        self.text += more
        t = self.text
        while True:
            if self.open is None:
                if not t.startswith(_ITEM_HEAD, self.at):  # not yet, or the list's end
                    break
                name_end = t.find('"', self.at + len(_ITEM_HEAD))
                if name_end < 0 or not t.startswith(_ITEM_MID, name_end + 1):
                    break
                start = name_end + 1 + len(_ITEM_MID)
                self.open = (t[self.at + len(_ITEM_HEAD) : name_end], start)
                self.scan = _ValueEnd(start)
            end = self.scan.feed(t)
            if end is None:
                break
            name, start = self.open
            self.closed.append(ToolCall(name, t[start:end]))
            self.open, self.at = None, end + 2  # past the item's "}" and the ","
        if self.open is None:
            return list(self.closed)
        name, start = self.open
        return [*self.closed, ToolCall(name, t[start:])]


@dataclass
class _ValueEnd:
    """Where the JSON object or list opened at ``pos`` closes, fed the text as it grows."""

    pos: int
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> int | None:
        """The index after the value's end, or None while it is open."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None
