"""The one admit step both front ends (gRPC Generate, OpenAI HTTP) run on a request.

`Admission.admit` runs, off the event loop in one `asyncio.to_thread` hop: `build()` (HTTP:
decode and translate the body; gRPC: the decoded protobuf), routing headers
(gateway/admit/routing_headers.py: they fill only what the request leaves unset, before the
key's rights are checked), the key's rights, then `validation.validate`. A refusal is
logged and counted once, whichever API, and re-raised for the front end to map; anything
else raised is the client's input too (gateway/admit/parse_guard.py: a 400).

Off the loop because a 4 MiB body takes ~0.1 s to parse and a long prompt milliseconds
to render and tokenize (json's C parser holds the GIL: the body limit bounds that)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import grpc
import structlog

from gateway.admit import routing_headers
from gateway.admit.auth import Principal, resolve_tenant, tier_names
from gateway.admit.parse_guard import parse_guard
from gateway.metrics import GatewayMetrics
from gateway.text.tokenizer import Tokenizer
from gateway.validation import RequestError, UndecodableRequest, ValidatedRequest, validate
from protos import tiers
from protos.continuum.v1 import generation_pb2

_log = structlog.get_logger("gateway")
T = TypeVar("T")
Built = tuple[generation_pb2.GenerateRequest | UndecodableRequest, T]


def check_tier(principal: Principal, priority: int) -> None:
    """PERMISSION_DENIED if the key may not use the request's priority tier."""
    tier = tiers.from_priority(priority)
    if tier is None or tier in principal.tiers:
        return  # an unknown Priority value is validation's INVALID_ARGUMENT
    raise RequestError(
        f"this API key may not use priority {tiers.name(tier)!r}; it may use "
        f"{', '.join(tier_names(principal.tiers))} (ask for a key with that tier, or send "
        "another priority)",
        grpc.StatusCode.PERMISSION_DENIED,
        param="priority",
    )


class Admission:
    """Turns what a client sent into a `ValidatedRequest`, or refuses it (RequestError)."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, metrics: GatewayMetrics,
                 objective_tiers=routing_headers.DEFAULT_OBJECTIVE_TIERS):
        self._tokenizer = tokenizer
        # For keys granted `special_tokens` (gateway/admit/auth.py): their chats' control tokens.
        self._trusting = tokenizer.trusting_content()
        self._model_name = model_name
        self._metrics = metrics
        self._objective_tiers = objective_tiers

    async def admit(self, principal: Principal, build: Callable[[], Built[T]], *,
                    api: str, request_id: str = "",
                    headers: Callable[[str], str | None] | None = None
                    ) -> tuple[ValidatedRequest, T]:
        """`build()` returns the request and whatever the front end needs to answer it;
        `request_id` is the caller's id as far as it is known, for the log; `headers`
        reads the call's headers / metadata (an inference gateway's tenant and tier:
        gateway/admit/routing_headers.py)."""
        try:
            return await asyncio.to_thread(self._admit, principal, build, headers, api)
        except RequestError as exc:
            _log.info("request rejected", api=api, request_id=request_id[:128],
                      code=exc.code.name, param=exc.param, reason=exc.message)
            self._metrics.error(exc.code.name)
            raise

    def _admit(self, principal: Principal, build: Callable[[], Built[T]], headers,
               api: str) -> tuple[ValidatedRequest, T]:
        with parse_guard(api, self._metrics):
            request, extra = build()
            if not isinstance(request, UndecodableRequest):
                if headers is not None:
                    routing_headers.apply(request, headers, self._objective_tiers)
                request.tenant = resolve_tenant(principal, request.tenant)
                check_tier(principal, request.priority)
            return validate(request, self.tokenizer_for(principal), self._model_name), extra

    def tokenizer_for(self, principal: Principal) -> Tokenizer:
        """The tokenizer ``principal``'s requests are encoded with: a key granted
        special_tokens keeps control tokens in its chats (gateway/admit/auth.py)."""
        return self._trusting if principal.special_tokens else self._tokenizer
