"""Which `Host` a request may name, so that a web page cannot reach the server by DNS rebinding.

A page on another site cannot read this server's answers, unless its own
name comes to resolve to this server's address (DNS rebinding): then the
browser sends that name as `Host`. So every request, the page and /health
included, must name this server: the address its connection came in on
(with or without a port), `localhost`, `127.0.0.1` or `[::1]` when that
address is a loopback one, or a name the operator allowed (`--allowed-host`,
`server.allowed_hosts`). A request with no `Host` (HTTP/1.0) is no
browser's, and passes. Anything else is refused 403 in OpenAI's error shape,
before any route runs.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.responses import JSONResponse

from kvlayout.server import shapes

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def host_name(value: str) -> str:
    """The name in a `Host` value, as compared: no port, lower case, no trailing dot ("[::1]:80" -> "[::1]")."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 address, bracketed, maybe with a port after it
        end = value.find("]")
        name = value[: end + 1] if end > 0 else value
    elif value.count(":") == 1:
        name = value.split(":", 1)[0]
    else:
        name = value
    return name.rstrip(".")


def address_names(address: str) -> set[str]:
    """The names a `Host` may give for a connection that came in on `address`."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone ("%eth0") is not the address's
    except ValueError:
        return {host_name(address)}
    names = {f"[{ip}]" if ip.version == 6 else str(ip)}
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket's "::ffff:127.0.0.1"
    if ip.is_loopback or (mapped is not None and mapped.is_loopback):
        names |= LOOPBACK_NAMES
    return names


class HostCheck:
    """ASGI middleware: a request whose `Host` names neither this server nor an allowed name is
    answered 403 and goes no further; lifespan messages pass."""

    def __init__(self, app, allowed: Iterable[str] = ()):
        self.app = app
        self.allowed = frozenset(host_name(name) for name in allowed)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            given = [value.decode("latin-1") for key, value in scope.get("headers") or () if key == b"host"]
            refused = [host for host in given if not self.admits(host, scope.get("server"))]
            if refused:
                await self.refusal(refused[0])(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def admits(self, given: str, server: tuple | None) -> bool:
        name = host_name(given)
        if name in self.allowed:
            return True
        return server is not None and name in address_names(str(server[0]))

    def refusal(self, given: str) -> JSONResponse:
        shown = repr(given[:100])
        name = host_name(given)[:100] or "NAME"
        message = (f"Host {shown} is not a name of this server (refused against DNS rebinding); "
                   f"to serve it, start the server with --allowed-host {name}")
        return JSONResponse(shapes.error(message, "invalid_request_error", code="host_not_allowed"), 403)
