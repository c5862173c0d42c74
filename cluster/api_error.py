"""The API's errors: ``ApiError`` (an OpenAI error body and its status) and how a
"field: why" ValueError of the engine or ``SamplingParams`` becomes a 400 naming the field."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
# "field: why" -> field; the engine and SamplingParams name the field this way.
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class ApiError(Exception):
    """An error answered with OpenAI's error body and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles what a handle call raises; the default rebuilds from ``args`` alone,
        # which this __init__ (and a subclass's) does not take.
        return _rebuilt, (type(self), self.args, self.__dict__)

    @classmethod
    def bad_input(cls, e: ValueError, rename: dict[str, str] | None = None) -> ApiError:
        """A "field: why" ValueError -> 400 with param = field (renamed per ``rename``)."""
        message = str(e)
        m = _FIELD_PREFIX.match(message)
        if m is None:
            return cls(400, message)
        param = (rename or {}).get(m.group(1), m.group(1))
        return cls(400, f"{param}: {message[m.end() :]}", param=param)


class BadRequest(ApiError, ValueError):
    """A Python caller's bad request to ``handle.generate``: a ``ValueError`` naming the
    field, as that method documents, and the 400 ``ApiError`` (``status``, OpenAI's ``body``)
    that ``chat`` and ``completions`` raise; logged as the caller's error, not the server's
    (``replica_logs``)."""


def valid(fn: Callable[[], T], rename: dict[str, str] | None = None) -> T:
    """Run a validating call; its ValueError becomes a 400 naming the field."""
    try:
        return fn()
    except ValueError as e:
        raise ApiError.bad_input(e, rename) from None


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _rebuilt(cls: type[ApiError], args: tuple[Any, ...], state: dict[str, Any]) -> ApiError:
    e = cls.__new__(cls)
    Exception.__init__(e, *args)
    e.__dict__.update(state)
    return e
