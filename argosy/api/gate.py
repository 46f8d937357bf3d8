"""The gate in front of every route (SPEC §7): who is asking, and whether they may now.

GateMiddleware, for every HTTP request except `GET /health` (and CORS preflights, which the
CORS middleware outside it answers):
1. the client's address: the peer's, or — when the peer is one of `--trusted-proxies` — the
   right-most address in `X-Forwarded-For` that is not a trusted proxy (a client cannot
   forge its way past the proxy that appended the real one);
2. the per-address token bucket (`--rate-limit-per-minute`, `--burst`; loopback exempt unless
   `--rate-limit-loopback`): 429 + Retry-After;
3. when keys are configured, the key (`Authorization: Bearer KEY` or `x-api-key: KEY`): 401
   when missing, unknown or expired; its name goes on the request's record (events, logs,
   metrics; the key itself never does);
4. the key's limits (argosy/core/keys.py): requests per minute, tokens per minute (spent as the
   request ends), requests in flight: 429 + Retry-After.
Model permission and the QoS ceiling are checked by `Gate.policy`, the pipeline's policy hook,
once a model route has resolved its model (403 for a model or QoS class the key may not use;
a request that names no QoS class gets the key's highest). Every refusal is in the route's
dialect (the app's error renderer) and noted on the request's record.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from argosy.api.errors import APIError
from argosy.api.transport import request_record
from argosy.config import ModelSpec, ServerConfig
from argosy.core.keys import AddressLimits, KeyLimits, KeyPolicy, KeyRing, config_key_ring
from argosy.core.pipeline import RequestContext

# never need a key, never limited (the console's page holds no data: it asks for the key)
OPEN_PATHS = frozenset({"/health", "/console"})
WS_KEY_PROTOCOL = "openai-insecure-api-key."
WS_POLICY_VIOLATION = 1008  # a WebSocket refused before it opens: the key or a limit
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _rate_limited(message: str, wait_s: float) -> APIError:
    return APIError(
        "rate_limited",
        message,
        code="rate_limit_exceeded",
        headers={"retry-after": str(max(1, math.ceil(wait_s)))},
    )


def _unauthorized(message: str) -> APIError:
    return APIError("unauthorized", message, code="invalid_api_key")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class Gate:
    def __init__(
        self,
        keys: KeyRing,
        *,
        address_limits: AddressLimits | None = None,
        limit_loopback: bool = False,
        trusted_proxies: list[str] | None = None,
    ) -> None:
        self.keys = keys
        self.key_limits = KeyLimits()
        self.address_limits = address_limits
        self.limit_loopback = limit_loopback
        self.trusted: list[Network] = [ipaddress.ip_network(p, strict=False) for p in trusted_proxies or []]
        self._by_name = {policy.name: policy for policy in keys.policies}

    @classmethod
    def from_config(cls, config: ServerConfig) -> Gate:
        limits = None
        if config.rate_limit_per_minute is not None:
            limits = AddressLimits(config.rate_limit_per_minute, config.burst)
        return cls(
            config_key_ring(config),
            address_limits=limits,
            limit_loopback=config.rate_limit_loopback,
            trusted_proxies=config.trusted_proxies,
        )

    # -- who -------------------------------------------------------------------------------

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.trusted)

    def client_address(self, peer: str | None, headers: Headers) -> str | None:
        if peer is None or not self._is_trusted(peer):
            return peer
        forwarded = ",".join(headers.getlist("x-forwarded-for"))
        hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
        for hop in reversed(hops):
            if not self._is_trusted(hop):
                return hop
        return hops[0] if hops else peer

    def authenticate(self, headers: Headers) -> KeyPolicy:
        authorization = headers.get("authorization", "")
        scheme, _, token = authorization.partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else ""
        key = key or headers.get("x-api-key", "").strip()
        # a browser's WebSocket cannot set headers: the key rides in a subprotocol, as OpenAI's
        # realtime API takes it ("openai-insecure-api-key.KEY")
        for protocol in headers.get("sec-websocket-protocol", "").split(","):
            if not key and protocol.strip().startswith(WS_KEY_PROTOCOL):
                key = protocol.strip().removeprefix(WS_KEY_PROTOCOL)
        if not key:
            raise _unauthorized(
                "Missing API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'."
            )
        policy = self.keys.find(key)
        if policy is None:
            raise _unauthorized("Invalid API key.")
        if policy.is_expired():
            raise _unauthorized(f"The API key {policy.name!r} has expired.")
        return policy

    # -- the pipeline's policy hook ----------------------------------------------------------

    def policy(self, ctx: RequestContext, spec: ModelSpec) -> None:
        """403 unless the request's key may use this model and QoS class (a request that set
        none gets the key's highest)."""
        policy = self._by_name.get(ctx.key_name) if ctx.key_name is not None else None
        if policy is None:
            return
        if not policy.allows_model(spec.names):
            raise APIError(
                "permission_denied",
                f"The API key {policy.name!r} may not use the model '{spec.id}'.",
                param="model",
                code="model_not_allowed",
            )
        if ctx.qos is not None and not policy.allows_qos(ctx.qos):
            if ctx.qos_is_explicit:
                raise APIError(
                    "permission_denied",
                    f"The API key {policy.name!r} may use QoS classes up to {policy.max_qos!r}, not {ctx.qos!r}.",
                    param="priority",
                    code="qos_not_allowed",
                )
            ctx.qos = policy.max_qos


class GateMiddleware:
    def __init__(self, app: ASGIApp, gate: Gate, render: Callable[[Scope, APIError], JSONResponse]) -> None:
        self.app = app
        self.gate = gate
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        record = request_record(scope)
        peer = scope.get("client")
        address = self.gate.client_address(peer[0] if peer else None, headers)
        if record is not None:
            record.client = address
        policy: KeyPolicy | None = None
        try:
            limits = self.gate.address_limits
            if (
                limits is not None
                and address is not None
                and (self.gate.limit_loopback or not _is_loopback(address))
            ):
                wait = limits.take(address)
                if wait > 0:
                    raise _rate_limited(
                        f"Too many requests from {address}: the limit is {limits.rate_per_minute:g} per minute.",
                        wait,
                    )
            if self.gate.keys:
                policy = self.gate.authenticate(headers)
                if record is not None:
                    record.key_name = policy.name
                refused = self.gate.key_limits.admit(policy)
                if refused is not None:
                    limit, wait = refused
                    policy = None  # not admitted: nothing to give back
                    raise _rate_limited(f"The API key's {limit} limit is reached.", wait)
        except APIError as error:
            await self.render(scope, error)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if policy is not None:
                tokens = 0
                if record is not None:
                    tokens = (record.prompt_tokens or 0) + (record.completion_tokens or 0)
                self.gate.key_limits.done(policy, tokens)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The same key and per-address limits for a WebSocket: one refused is closed before it
        opens (the client sees the handshake fail: 403) with code 1008 and the reason."""
        headers = Headers(scope=scope)
        peer = scope.get("client")
        address = self.gate.client_address(peer[0] if peer else None, headers)
        policy: KeyPolicy | None = None
        try:
            limits = self.gate.address_limits
            if (
                limits is not None
                and address is not None
                and (self.gate.limit_loopback or not _is_loopback(address))
            ):
                wait = limits.take(address)
                if wait > 0:
                    raise _rate_limited(f"Too many requests from {address}.", wait)
            if self.gate.keys:
                policy = self.gate.authenticate(headers)
                refused = self.gate.key_limits.admit(policy)
                if refused is not None:
                    policy = None
                    raise _rate_limited(f"The API key's {refused[0]} limit is reached.", refused[1])
        except APIError as error:
            await receive()  # websocket.connect
            await send(
                {"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": error.message[:120]}
            )
            return
        scope.setdefault("state", {})["key_name"] = policy.name if policy is not None else None
        try:
            await self.app(scope, receive, send)
        finally:
            if policy is not None:
                self.gate.key_limits.done(policy, 0)
