"""The last resort of the edge: whatever parsing a request raises is the client's 400.

Wraps where client input is read (JSON body, dialects, validation, chat template,
tokenization, /tokenize), so an input no check foresaw is INVALID_ARGUMENT / 400 "could not
parse the request", logged with its traceback and counted
(`continuum_gateway_request_parse_errors_total{api}`): a gap to close in the checks. A
compile with no free CPU in time (``CompileBusy``) is overload: 429 / RESOURCE_EXHAUSTED.
A failure while serving an admitted request stays INTERNAL / 500."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import grpc
import structlog

from gateway.metrics import GatewayMetrics
from gateway.structured.guided_check import CompileBusy
from gateway.validation import RequestError
from protos.echo import shorten

_log = structlog.get_logger("gateway")
# The innermost frames of a traceback are where it failed; a RecursionError's would
# otherwise fill the log line with a thousand of them.
_TRACEBACK_FRAMES = 24


@contextlib.contextmanager
def parse_guard(api: str, metrics: GatewayMetrics) -> Iterator[None]:
    """Turns any exception but a `RequestError` raised inside into a RequestError (400)."""
    try:
        yield
    except RequestError:
        raise
    except CompileBusy as exc:  # overload, not the client's fault: 429 / RESOURCE_EXHAUSTED
        raise RequestError(str(exc), grpc.StatusCode.RESOURCE_EXHAUSTED,
                           param="response_format") from exc
    except Exception as exc:
        raise unexpected(exc, api, metrics) from exc


def unexpected(exc: Exception, api: str, metrics: GatewayMetrics) -> RequestError:
    """The 400 for ``exc``, logged (traceback, message bounded) and counted."""
    reason = f"{type(exc).__name__}: {shorten(str(exc), 200)}"
    frames = traceback.format_tb(exc.__traceback__, limit=-_TRACEBACK_FRAMES)
    _log.error("unexpected error while parsing a request", api=api, error=reason,
               traceback="".join(frames))
    metrics.parse_error(api)
    return RequestError(f"could not parse the request: {reason}")
