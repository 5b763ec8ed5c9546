"""API keys: who may use the server, and whose cached prefixes a request may share.

With no key configured every route is open, as before. With keys
(`server.api_keys`, `--api-key`, `--api-key-file`, KVLAYOUT_API_KEY) every
route needs `Authorization: Bearer KEY` (what the openai client sends),
except `/health` (for load balancers and probes) and the page at `/` (the
page itself holds nothing; it asks for the key, then sends it on every fetch
it makes). Anything else without a configured key is answered 401 in
OpenAI's error shape (`invalid_request_error`, code `invalid_api_key`, as
OpenAI answers), before any route runs; unknown paths included, so the
answer says nothing about what exists.

Keys are compared in constant time (`hmac.compare_digest`, against every key
each time). A request let in carries its tenant in the ASGI scope: a stable
hash of its key (never the key itself), which keeps its cached prefixes
apart from other keys' (`tenant_of`, `isolation_key`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Iterable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvlayout.errors import ConfigError, os_reason
from kvlayout.server import shapes
from kvlayout.server.config import is_api_key

OPEN_PATHS = frozenset({"/health", "/"})
TENANT = "kvlayout.tenant"  # the scope's key for the request's tenant ("" when no keys are configured)


def key_id(key: str) -> str:
    """A stable name of `key` that does not reveal it (SHA-256, hex)."""
    return hashlib.sha256(key.encode()).hexdigest()


def isolation_key(tenant: str, cache_salt: str | None) -> str:
    """The prefix cache's isolation key (Request.isolation) of a request: "" (shared with every
    request like it) when there is neither a tenant nor a salt; else one string naming both, so
    neither a tenant nor a salt alone can pose as the pair."""
    if not tenant and cache_salt is None:
        return ""
    return hashlib.sha256(json.dumps([tenant, cache_salt]).encode()).hexdigest()


def tenant_of(request: Request) -> str:
    """The tenant the auth middleware let `request` in as: its key's id, or "" with no keys."""
    return request.scope.get(TENANT, "")


class ApiKeys:
    """ASGI middleware: with `keys`, a request to any path but OPEN_PATHS must bear one of them
    (401 otherwise); lifespan messages pass."""

    def __init__(self, app, keys: Iterable[str] = ()):
        self.app = app
        self.keys = tuple(key.encode() for key in keys)

    async def __call__(self, scope, receive, send) -> None:
        if self.keys and scope["type"] in ("http", "websocket") and scope.get("path") not in OPEN_PATHS:
            given = bearer(scope)
            key = self.match(given) if given is not None else None
            if key is None:
                await refusal(given is not None)(scope, receive, send)
                return
            scope[TENANT] = key_id(key.decode())
        await self.app(scope, receive, send)

    def match(self, given: bytes) -> bytes | None:
        """The configured key equal to `given`, compared with every key in constant time."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(key, given):
                found = key
        return found


def bearer(scope) -> bytes | None:
    """The token of the request's `Authorization: Bearer TOKEN` header, or None without one."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def refusal(wrong: bool) -> JSONResponse:
    if wrong:
        message = "Incorrect API key provided; send one of the server's keys as Authorization: Bearer KEY"
    else:
        message = ("You didn't provide an API key; this server needs one as Authorization: Bearer KEY "
                   "(the openai client: api_key=KEY)")
    body = shapes.error(message, "invalid_request_error", code="invalid_api_key")
    return JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})


# -- where the keys come from (kvlayout serve)


def read_keys(given: Iterable[str], files: Iterable[str], env: str | None) -> list[str]:
    """`--api-key`s, the keys of each `--api-key-file` (one a line; blank lines and `#` comments
    skipped) and KVLAYOUT_API_KEY's; ConfigError, one line never showing a key, for an empty or
    malformed key or a file that cannot be read or holds none."""
    keys = []
    for n, key in enumerate(given, 1):
        if not is_api_key(key):
            raise ConfigError(f"--api-key (number {n} given): expected a non-empty key of printable ASCII "
                              "without spaces")
        keys.append(key)
    for path in files:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {path}: cannot read it ({os_reason(exc)})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--api-key-file {path}: not UTF-8 text (expected one key a line)") from None
        found = [(i, line.strip()) for i, line in enumerate(lines, 1) if line.strip() and not line.startswith("#")]
        bad = [i for i, key in found if not is_api_key(key)]
        if bad:
            raise ConfigError(f"--api-key-file {path}: line {bad[0]} is not a key (printable ASCII without spaces)")
        if not found:
            raise ConfigError(f"--api-key-file {path}: holds no key (expected one a line)")
        keys += [key for _, key in found]
    if env is not None:
        if not is_api_key(env.strip()):
            raise ConfigError("KVLAYOUT_API_KEY: expected a non-empty key of printable ASCII without spaces")
        keys.append(env.strip())
    return keys


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
