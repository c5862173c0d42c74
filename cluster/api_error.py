"""The API's errors: ``ApiError`` (an OpenAI error body and its status) and how a
"field: why" ValueError of the engine or ``SamplingParams`` becomes a 400 naming the field."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def checked(cls: type[ApiError] = ApiError, rename: dict[str, str] | None = None) -> Iterator[None]:
    """Inside, a ValueError (a check's "field: why"; also one a Ray task raised) becomes
    ``cls``'s 400 naming the field."""
    try:
        yield
    except ValueError as e:
        raise cls.bad_input(root_cause(e), rename) from None  # type: ignore[arg-type]


def valid(fn: Callable[[], T], rename: dict[str, str] | None = None) -> T:
    """Run a validating call; its ValueError becomes a 400 naming the field."""
    with checked(ApiError, rename):
        return fn()


def root_cause(e: BaseException) -> BaseException:
    """``e`` itself, or the cause that a Ray task error wraps (``RayTaskError.cause``; its own
    message holds the remote traceback, pid and actor id, so the cause's is the one to show)."""
    for _ in range(8):  # RayTaskError(RayTaskError(ValueError)): a task that called a task
        cause = getattr(e, "cause", None)
        if not isinstance(cause, BaseException) or cause is e:
            break
        e = cause
    return e


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
