"""Structured outputs (vLLM's): a request's text held to a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a grammar (Lark, or llama.cpp's GBNF), by
llguidance (vLLM's ``guidance`` backend).

``StructuredOutputsParams`` (vLLM's name and fields) says which; it travels in
``SamplingParams.structured_outputs`` to whichever worker runs the request, and is checked
where it is made (a bad schema, regex or grammar is a ValueError naming the field, so a 400).
The engine keeps one matcher a request (``grammars.py``: ``Grammars.matcher``, made with the
worker's tokenizer; a request resumed from another worker first replays its resumed tokens
into it).
Before each sampled token the tokens the grammar does not allow next get -inf
(``mask_logits``), before ``allowed_token_ids``, bad words, penalties and sampling: vLLM
applies its bitmask to the logits first too, so logprobs are those of the masked logits, as
there. After it the matcher takes the token (the engine's ``_postprocess``). The grammar's end
allows only EOS, which ends the request as usual (under ``ignore_eos`` too); a token the
matcher cannot take (other masks, e.g. ``min_tokens`` holding EOS back, left the grammar no
token) ends it as a stop, and is not in the text.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

import llguidance

MAX_SPEC_CHARS = 64 * 1024  # a schema's JSON text, a regex or a grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
# llguidance's limits, less its lexer's initial fuel (1,000,000: ~0.8 s here before a hostile
# regex such as "(a{1000}){1000}" fails; at 200,000, ~0.12 s). Errors without the parser's
# state (the grammar's text), which the first line of a message would not show anyway.
LIMITS = {"initial_lexer_fuel": 200_000, "verbose_errors": False}
_ANY_OBJECT = '{"type": "object"}'  # vLLM's json_object for the guidance backend


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the text must be: exactly one of ``json`` (a JSON schema, as a dict or its JSON
    text), ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark or GBNF) or
    ``json_object`` (any JSON object). ``disable_any_whitespace`` (vLLM's) makes JSON
    compact; by default a JSON answer may put whitespace where JSON allows it, as in vLLM,
    unless the schema's own ``"x-guidance": {"whitespace_flexible": false}`` (llguidance's
    options) says otherwise. A small model may fill a flexible answer with whitespace.
    Bounds: 64 KiB of schema, regex or grammar; 1,024 choices of 1,024 characters."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # key order kept: it is the order the JSON is written
            object.__setattr__(self, "json", _dump(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        """The one constraint given: "json", "regex", "choice", "grammar" or "json_object"."""
        return self._given()[0]

    def _given(self) -> list[str]:
        """The constraints given (validate: exactly one)."""
        return [
            f.name
            for f in fields(self)
            if f.name != "disable_any_whitespace" and getattr(self, f.name) not in (None, False)
        ]

    def validate(self) -> None:
        def bad(why: str) -> ValueError:
            return ValueError(f"structured_outputs: {why}")

        given = self._given()
        if len(given) != 1:
            raise bad(
                "give exactly one of json, regex, choice, grammar or json_object, got "
                + (", ".join(given) or "none")
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise bad("disable_any_whitespace must be a boolean")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json_object":
            if value is not True:
                raise bad("json_object must be true")
        elif kind == "choice":
            if not (
                isinstance(value, tuple)
                and 0 < len(value) <= MAX_CHOICES
                and all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in value)
            ):
                raise bad(
                    f"choice must be 1 to {MAX_CHOICES} non-empty strings of at most "
                    f"{MAX_CHOICE_CHARS} characters"
                )
        elif not (isinstance(value, str) and value.strip()):
            raise bad(f"{kind} must be a non-empty string" + (" or object" * (kind == "json")))
        elif len(value) > MAX_SPEC_CHARS:
            raise bad(f"{kind} is {len(value)} characters; at most {MAX_SPEC_CHARS}")
        error = _check(self.llguidance_grammar())
        if error:
            raise bad(f"{kind}: {error}")

    def llguidance_grammar(self) -> str:
        """The constraint as llguidance's grammar (ValueError naming the field for a schema
        that is not a JSON object)."""
        return _grammar(self.kind, self._spec(), not self.disable_any_whitespace)

    def _spec(self) -> str:
        kind = self.kind
        if kind == "json_object":
            return _ANY_OBJECT
        if kind == "choice":
            return _dump(list(self.choice or ()))
        return getattr(self, kind)


def _dump(value: Any) -> str:
    try:
        return jsonlib.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        raise ValueError("structured_outputs: json is nested too deeply") from None
    except (TypeError, ValueError) as e:  # a value JSON has no form for
        raise ValueError(f"structured_outputs: json is not JSON: {brief(e)}") from None


@lru_cache(maxsize=256)
def _grammar(kind: str, spec: str, whitespace_flexible: bool) -> str:
    if kind in ("json", "json_object"):
        try:
            schema = jsonlib.loads(spec)
        except ValueError:
            raise ValueError(f"structured_outputs: {kind} is not valid JSON") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs: {kind} must be a JSON schema object")
        # A schema's own "x-guidance" options win over the default, not over
        # disable_any_whitespace (llguidance applies defaults, then x-guidance, then overrides).
        options = {"whitespace_flexible": whitespace_flexible}
        kw = {"defaults": options} if whitespace_flexible else {"overrides": options}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec, **kw)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {kind}: {brief(e)}") from None
    try:
        return llguidance.grammar_from(kind, spec)  # regex, choice, grammar (Lark or GBNF)
    except ValueError as e:
        raise ValueError(f"structured_outputs: {kind}: {brief(e)}") from None


@lru_cache(maxsize=256)
def _check(grammar: str) -> str:
    """llguidance's error for ``grammar`` (its first line), or "" when it is valid."""
    limits = llguidance.LLParserLimits(**LIMITS)
    error = brief(llguidance.LLMatcher.validate_grammar(grammar, limits=limits))
    return "" if error.startswith("WARNING") else error


def brief(error: object, limit: int = 300) -> str:
    """An error's first line, and the cause a regex error puts under its caret diagram ("error:
    unclosed group"), cut to ``limit`` characters: a message never echoes a grammar back."""
    lines = str(error).strip().splitlines() or [""]
    causes = [ln.removeprefix("error:").strip() for ln in lines[1:] if ln.startswith("error:")]
    text = " ".join([lines[0].strip(), *causes])
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
