"""Exceptions raised by rolloutcore, one class per status code of the C++ core.

The compiled core (``rolloutcore._core``) and the HTTP clients raise the same classes: a C++
``rc::Status`` becomes the class for its code, and an HTTP error answer becomes the class for the
``code`` the server sent (or for its HTTP status). Each class also derives from the closest
built-in exception, so ``except ValueError`` catches bad input and ``except LookupError`` catches
a missing version.
"""

from __future__ import annotations

from typing import Dict, Optional, Type


class RolloutcoreError(RuntimeError):
    """Base class. ``code`` is the status code name (``"InvalidArgument"``, ``"NotFound"``, ...)."""

    code: str = "Internal"

    def __init__(self, message: str, *, code: Optional[str] = None, http_status: Optional[int] = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.http_status = http_status


class InvalidArgumentError(RolloutcoreError, ValueError):
    """Bad input: wrong dtype, a box outside the tensor, a non-contiguous array, a malformed body."""

    code = "InvalidArgument"


class NotFoundError(RolloutcoreError, LookupError):
    """An unknown or released version, model, update or rollout."""

    code = "NotFound"


class FailedPreconditionError(RolloutcoreError):
    """A state conflict: publishing a version twice, installing while serving, a STAGING manifest."""

    code = "FailedPrecondition"


class UnavailableError(RolloutcoreError, ConnectionError):
    """A peer cannot be reached, or no engine is READY (retry later)."""

    code = "Unavailable"


class DeadlineExceededError(RolloutcoreError, TimeoutError):
    """An operation did not finish in time."""

    code = "DeadlineExceeded"


class AbortedError(RolloutcoreError):
    code = "Aborted"


class DataLossError(RolloutcoreError):
    """Bytes differ from what was published (a digest mismatch)."""

    code = "DataLoss"


class InternalError(RolloutcoreError):
    code = "Internal"


class AlreadyExistsError(RolloutcoreError):
    code = "AlreadyExists"


class UnimplementedError(RolloutcoreError, NotImplementedError):
    code = "Unimplemented"


class UnauthenticatedError(RolloutcoreError, PermissionError):
    """No API key, or not the server's (HTTP 401): set ROLLOUTCORE_API_KEY or pass ``api_key``."""

    code = "Unauthenticated"


class PermissionDeniedError(RolloutcoreError, PermissionError):
    """Authenticated, but not allowed (HTTP 403)."""

    code = "PermissionDenied"


_BY_CODE: Dict[str, Type[RolloutcoreError]] = {
    c.code: c
    for c in (
        InvalidArgumentError,
        NotFoundError,
        FailedPreconditionError,
        UnavailableError,
        DeadlineExceededError,
        AbortedError,
        DataLossError,
        InternalError,
        AlreadyExistsError,
        UnimplementedError,
        UnauthenticatedError,
        PermissionDeniedError,
    )
}

_BY_HTTP: Dict[int, Type[RolloutcoreError]] = {
    400: InvalidArgumentError,
    401: UnauthenticatedError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: FailedPreconditionError,
    503: UnavailableError,
    504: DeadlineExceededError,
}


def error_class(code: str) -> Type[RolloutcoreError]:
    """The exception class for a status code name (RolloutcoreError for unknown names)."""
    return _BY_CODE.get(code, RolloutcoreError)


def from_http(status: int, code: Optional[str], message: str) -> RolloutcoreError:
    """The exception for an HTTP error answer: by the body's code when it has one, else by status."""
    cls = _BY_CODE.get(code or "") or _BY_HTTP.get(status) or RolloutcoreError
    return cls(message, code=code or cls.code, http_status=status)
