"""The HTTP side: a Starlette app speaking OpenAI's API in front of the engine thread.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (stream or
not), `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`; for people and monitoring (`monitor`):
`GET /` (the chat page with its cell map), `GET /cells` (the map's frames,
server-sent events), `GET /cells/at?cell=N`, `GET /stats`, `GET /metrics`. A handler reads and checks the body
(`requests`), hands a ticket to the worker and waits for its events without
ever blocking the event loop; the model runs on the worker's thread. Every
error a client can cause is a KVLayoutError carrying its status (`BadRequest`,
`QueueFull`), answered as OpenAI's error object with the field named (400,
404, 413, 415 for a body not sent as JSON, 429 with Retry-After); anything
else is a 500 of the same shape, and the server goes on. A request whose
Host is not the server's is refused 403 before any route (`hosts`); with API
keys configured, one without a right key is refused 401 next (`auth`). A client
that goes away (its stream closed, or a whole-answer request abandoned) has
its request cancelled at once. A request the shutdown ends (`serve`) is
answered 503, a stream with that error as its last event before [DONE].
CORS headers are sent only for the origins configured (`server.cors_origins`,
`--cors-origin`; Starlette's CORSMiddleware), none by default. Each request
is one line on the ACCESS_LOG logger once answered (`AccessLog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvlayout.engines.shaping import TokenLogprob
from kvlayout.errors import BadRequest, KVLayoutError, one_line
from kvlayout.server import cellmap, monitor, shapes
from kvlayout.server.auth import ApiKeys, isolation_key, tenant_of
from kvlayout.server.hosts import HostCheck
from kvlayout.server.requests import parse_chat, parse_completion
from kvlayout.server.service import Service
from kvlayout.server.tools import ToolCallReader
from kvlayout.server.worker import Event, Ticket, new_ticket, queue_timed_out, shutting_down

FRAME_POLL_S = 0.05  # how often a /cells stream looks for a new frame
KEEPALIVE_S = 15.0
QUEUED_KEEPALIVE_S = 3.0  # a stream still queued hears `: waiting` this often
RETRY_AFTER_S = 1
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
GENERATING = "kvlayout.ticket"  # the scope's key for the ticket of a request that was queued to generate
ACCESS_LOG = "kvlayout.server.access"  # the logger of the access lines (INFO); `serve` writes it to stderr
access_logger = logging.getLogger(ACCESS_LOG)
LOGGED_PATH_CHARS = 200


def build_app(service: Service) -> Starlette:
    """The app serving `service`: its routes, OpenAI-shaped errors, the worker stopped at shutdown."""
    h = Handlers(service)
    routes = [
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/completions", h.text, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", h.model, methods=["GET"]),  # an id may hold a slash ("org/name")
        Route("/health", h.health, methods=["GET"]),
        Route("/stats", h.stats, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
        Route("/cells", h.cells, methods=["GET"]),
        Route("/cells/at", h.cell_at, methods=["GET"]),
        Route("/", h.page, methods=["GET"]),
    ]
    handlers = {KVLayoutError: refused, HTTPException: http_error, ClientDisconnect: left_mid_body,
                Exception: internal_error}
    server = service.cfg.server
    checked = [Middleware(AccessLog),  # outermost: every request logged, refused ones too
               Middleware(HostCheck, allowed=server.allowed_hosts),  # every route: DNS rebinding
               *cors(server.cors_origins),
               Middleware(ApiKeys, keys=server.api_keys)]  # every route but /health and the page
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=h.lifespan, middleware=checked)


def cors(origins: tuple[str, ...]) -> list[Middleware]:
    """Starlette's CORS middleware for `origins` (`server.cors_origins`, `--cors-origin`); none without
    them, so no CORS header is sent unless asked. Outside ApiKeys: a browser's preflight carries no key.
    Keys travel in the Authorization header, never a cookie, so no credentials are allowed."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])]


class AccessLog:
    """ASGI middleware: one line per HTTP request on the ACCESS_LOG logger once it is answered (`access_line`).
    Never a body nor a header: an API key travels in one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), None

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            status = status or 500  # raised past us: Starlette's outermost layer answers it (internal_error)
            raise
        finally:
            if access_logger.isEnabledFor(logging.INFO):
                access_logger.info(access_line(scope, status, time.perf_counter() - started))


def access_line(scope, status: int | None, seconds: float) -> str:
    """`kvlayout: POST /v1/completions 200 prompt_tokens=5 completion_tokens=3 41.2 ms`: the method, the path
    as sent (no query), the status ("-": none was sent, the request was cancelled), the tokens of a request
    that was queued to generate, and the wall time from its head to the end of its answer."""
    path = printable(scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape"))
    tokens = ""
    ticket = scope.get(GENERATING)
    if ticket is not None:
        used = usage_of(ticket)
        tokens = f" prompt_tokens={used['prompt_tokens']} completion_tokens={used['completion_tokens']}"
    return f"kvlayout: {printable(scope['method'].encode())} {path} {status or '-'}{tokens} {seconds * 1e3:.1f} ms"


def printable(raw: bytes) -> str:
    """`raw` percent-encoded wherever it is not printable ASCII, cut at LOGGED_PATH_CHARS: a client's path
    cannot break the log's lines nor make one long."""
    text = "".join(chr(b) if 0x21 <= b <= 0x7E else f"%{b:02X}" for b in raw[:LOGGED_PATH_CHARS])
    return text + ("..." if len(raw) > LOGGED_PATH_CHARS else "")


class Handlers:
    """Each route's handler, over one service (its worker, tokenizer, limits and metrics)."""

    def __init__(self, service: Service):
        self.service, self.worker = service, service.worker
        self.registry = monitor.metrics_registry(service.worker, service)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # The engine thread runs already (it made the model); once every connection is closed or
        # cancelled at shutdown, it is told to stop.
        try:
            yield
        finally:
            self.worker.stop()

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, chat=True)

    async def text(self, request: Request) -> Response:
        return await self.complete(request, chat=False)

    async def complete(self, request: Request, chat: bool) -> Response:
        """Check the body, queue its ticket (QueueFull: a 429), then stream the answer or wait for all of it."""
        service = self.service
        body = await read_json(request, service.cfg.server.max_body_bytes)
        # Encoding a long prompt takes a while (the tokenizer lets go of the GIL meanwhile): on a
        # thread, so other clients' streams and /health go on.
        if chat:
            order = await asyncio.to_thread(parse_chat, body, service.limits, service.tokenizer, service.cfg.plain_chat,
                                            service.grammars)
        else:
            order = await asyncio.to_thread(parse_completion, body, service.limits, service.tokenizer)
        isolation = isolation_key(tenant_of(request), order.cache_salt)  # whose cached prefixes it may share
        ticket = new_ticket(order, service.order_request(order, isolation), service.tokenizer.decode,
                            asyncio.get_running_loop(), service.cfg.server.queue_timeout_s)
        self.worker.submit(ticket)
        request.scope[GENERATING] = ticket  # the access log's token counts, read once the answer is sent
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if order.stream:
            return StreamingResponse(sse(stream(ticket, rid, service), self.worker, ticket),
                                     media_type="text/event-stream", headers=STREAM_HEADERS)
        return await whole(request, ticket, rid, service)

    async def models(self, request: Request) -> Response:
        return JSONResponse(shapes.models(self.service.model_id, self.service.created))

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{id}`: the served model's object, as /v1/models lists it; 404 for any other id."""
        asked, served = request.path_params["model_id"], self.service.model_id
        if asked != served:
            raise BadRequest(f"The model {asked!r} does not exist; this server serves {served!r} (GET /v1/models)",
                             "model", status=404, code="model_not_found")
        return JSONResponse(shapes.models(served, self.service.created)["data"][0])

    async def health(self, request: Request) -> Response:
        service = self.service
        return JSONResponse({**self.worker.snapshot, "model": service.model_id, "layout": service.cfg.layout.key})

    async def stats(self, request: Request) -> Response:
        return JSONResponse(monitor.stats(self.worker, self.service))

    async def metrics(self, request: Request) -> Response:
        return Response(monitor.metrics_text(self.registry), media_type=monitor.METRICS_TYPE)

    async def page(self, request: Request) -> Response:
        return HTMLResponse(monitor.page("index.html"))

    def no_cell_map(self) -> BadRequest:
        return BadRequest(f"the {self.service.cfg.layout.key} layout has no cells to show (a cell layout has)",
                          status=404, code="no_cell_map")

    async def cells(self, request: Request) -> Response:
        if self.worker.view is None:
            raise self.no_cell_map()
        return StreamingResponse(cell_frames(self.worker), media_type="text/event-stream", headers=STREAM_HEADERS)

    async def cell_at(self, request: Request) -> Response:
        snap = self.worker.map
        if snap is None:
            raise self.no_cell_map()
        raw = request.query_params.get("cell", "")
        # ASCII digits only ("²" is a digit to str.isdigit) and short (int() refuses 4300+ digits).
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18) or int(raw) >= snap.capacity:
            raise BadRequest(f"cell={raw!r}: expected a cell number in [0, {snap.capacity})", "cell")
        return JSONResponse(cellmap.cell_info(snap, int(raw)))


async def read_json(request: Request, limit: int):
    """The body as JSON, at most `limit` bytes (413 past it, read no further); 400 when not JSON,
    415 (before reading it) when not sent as application/json."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the request body is {declared} bytes; this server takes at most {limit} "
                         "(server.max_body_bytes)", status=413, code="request_too_large")
    require_json(request.headers.get("content-type"))
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise BadRequest(f"the request body is over {limit} bytes (server.max_body_bytes)", status=413,
                             code="request_too_large")
    try:
        return json.loads(body, parse_constant=not_json)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"the request body is not valid JSON ({one_line(exc)})") from None


def require_json(content_type: str | None) -> None:
    """A body must come as `Content-Type: application/json` (a charset may follow). A web page on
    another site can POST text/plain, a form or a typeless blob without asking the server first
    (a CORS "simple request"); application/json it cannot, so refusing the rest keeps pages out."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        given = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
        raise BadRequest(f"the request body came with {given}; send it as JSON with Content-Type: application/json "
                         "(curl: -H 'Content-Type: application/json')", status=415, code="unsupported_media_type")


def not_json(name: str):
    """json's parse_constant: NaN, Infinity and -Infinity, which Python reads and JSON has not."""
    raise BadRequest(f"the request body is not valid JSON ({name} is not a JSON value)")


async def stream(ticket: Ticket, rid: str, service: Service) -> AsyncIterator[dict]:
    """The chunks of a streamed answer, as OpenAI sends them, then usage when asked for."""
    order, model = ticket.order, service.model_id
    reported = Logprobs(order, service.tokenizer.token_bytes)
    calls = Calls(order)
    if order.chat:  # each choice opens with the assistant's role, as OpenAI's stream does
        for i in range(order.n):
            yield shapes.chunk(True, rid, service.created, model, i, "", None, first=True)
    async for event in events(ticket):
        if event is None:  # still queued
            yield None
            continue
        if event.finish_reason == "error":
            yield shapes.error(f"generation failed: {event.error}", "server_error")
            return
        event = reported.echoed(event, ticket.request)  # a choice's first event opens with the prompt (echo)
        reason = event.finish_reason if event.finish_reason in ("stop", "length") else None
        logprobs = reported.of(event)
        text, new_calls, reason = calls.read(event.index, event.text, reason)
        if text or reason or logprobs or new_calls:
            yield shapes.chunk(order.chat, rid, service.created, model, event.index, text or None, reason,
                               logprobs=logprobs, tool_calls=new_calls)
    refusal = cut_short(ticket)
    if refusal is not None:  # its error event, then [DONE]: the client knows it was cut short, and why
        yield shapes.error(refusal.message, refusal.kind, code=refusal.code)
        return
    if ticket.failed is not None:
        yield shapes.error(ticket.failed, "server_error")
        return
    if order.include_usage:
        yield shapes.usage_chunk(order.chat, rid, service.created, model, usage_of(ticket))


def cut_short(ticket: Ticket) -> BadRequest | None:
    """What a ticket the server ended before its answer was whole is answered: the shutdown's or
    its queue deadline's refusal (503); None for any other."""
    if ticket.shut_down:
        return shutting_down()
    if ticket.timed_out:
        return queue_timed_out()
    return None


async def sse(chunks: AsyncIterator[dict | None], worker, ticket: Ticket) -> AsyncIterator[str]:
    """Server-sent events: `data: {json}` per chunk (a `: waiting` comment for None), then
    `data: [DONE]`; the request is cancelled when the client goes away first (Starlette cancels
    this generator on a disconnect)."""
    try:
        async for chunk in chunks:
            if chunk is None:
                yield ": waiting\n\n"
                continue
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not ticket.done:
            worker.cancel(ticket)


async def cell_frames(worker) -> AsyncIterator[str]:
    """The cell map as server-sent events: the current frame at once, then each new one (the
    worker draws at most five a second); a comment line now and then keeps proxies from closing it."""
    sent, quiet = -1, 0.0
    while not worker.closing:
        if worker.frame_seq != sent and worker.frame is not None:
            sent = worker.frame_seq
            quiet = 0.0
            yield f"data: {json.dumps(worker.frame)}\n\n"
        elif quiet >= KEEPALIVE_S:
            quiet = 0.0
            yield ": idle\n\n"
        await asyncio.sleep(FRAME_POLL_S)
        quiet += FRAME_POLL_S


async def events(ticket: Ticket) -> AsyncIterator[Event | None]:
    """The ticket's events until it is over; None every QUEUED_KEEPALIVE_S while the engine has
    not started it (a queued stream would otherwise hear nothing, and proxies close quiet ones)."""
    while True:
        try:
            event = await asyncio.wait_for(ticket.events.get(), QUEUED_KEEPALIVE_S)
        except TimeoutError:  # Queue.get loses no event to a timeout
            if not ticket.request.started:
                yield None
            continue
        if event is None:
            return
        yield event


async def whole(request: Request, ticket: Ticket, rid: str, service: Service) -> Response:
    """Wait for every sample while watching the client; the answer, or a 500. A client that goes
    away has its request cancelled at once (between two of the engine's steps, as a stream's is)."""
    order = ticket.order
    texts, reasons, error = [""] * order.n, ["length"] * order.n, None
    records: list[list] = [[] for _ in range(order.n)]  # each choice's logprob records
    gone = asyncio.ensure_future(client_gone(request))
    try:
        while True:
            try:
                event = ticket.events.get_nowait()
            except asyncio.QueueEmpty:
                event = await next_event_unless(ticket, gone)
            if gone.done():
                if not ticket.done:
                    service.worker.cancel(ticket)
                return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
            if event is None:
                break
            texts[event.index] += event.text
            records[event.index] += event.logprobs
            if event.finish_reason is not None:
                reasons[event.index] = event.finish_reason
            if event.finish_reason == "error":
                error = event.error
    except asyncio.CancelledError:
        service.worker.cancel(ticket)
        raise
    finally:
        gone.cancel()
    refusal = cut_short(ticket)
    if refusal is not None:
        raise refusal
    if ticket.failed is not None or error is not None:
        raise BadRequest(f"generation failed: {ticket.failed or error}", status=500, kind="server_error")
    reported = Logprobs(order, service.tokenizer.token_bytes)
    echoed = [reported.echoed(Event(i, t, reason, logprobs=tuple(r)), ticket.request) for i, (t, r, reason) in
              enumerate(zip(texts, records, reasons))]
    reasons = [e.finish_reason for e in echoed]
    logprobs = None
    if order.logprobs is not None:
        logprobs = [reported.of(e) or reported.empty() for e in echoed]
    calls = Calls(order)
    read = [calls.read(i, e.text, r) for i, (e, r) in enumerate(zip(echoed, reasons))]
    body = shapes.completion(order.chat, rid, service.created, service.model_id, [t for t, _, _ in read],
                             [r for _, _, r in read], usage_of(ticket), logprobs, calls.made())
    return JSONResponse(body)


class Calls:
    """Each choice's text read for tool calls (server.tools.ToolCallReader) when the chat's tools allow
    them; the text as it is otherwise."""

    def __init__(self, order):
        tools = order.tools
        live = tools is not None and tools.calls_allowed
        self.readers = [ToolCallReader(tools.names) for _ in range(order.n)] if live else None

    def read(self, index: int, text: str, reason: str | None) -> tuple[str, list[dict] | None, str | None]:
        """(content to send, the calls that closed meanwhile as a stream's deltas, each with its index
        among the choice's calls (None: none), finish_reason) for `text`, the next piece of choice
        `index`; `reason` set: its last. A reply that called a tool and stopped ends with
        "tool_calls", as OpenAI's does."""
        if self.readers is None:
            return text, None, reason
        reader = self.readers[index]
        content = reader.feed(text) + (reader.finish() if reason is not None else "")
        fresh = reader.new_calls()
        first = len(reader.calls) - len(fresh)
        if reason == "stop" and reader.calls:
            reason = "tool_calls"
        return content, [{"index": first + k, **call} for k, call in enumerate(fresh)] or None, reason

    def made(self) -> list[list[dict]] | None:
        """Each choice's calls, once its text was read whole (None without tools)."""
        return None if self.readers is None else [reader.calls for reader in self.readers]


class Logprobs:
    """The logprobs objects of one answer's choices, as their records arrive (a stream's events,
    or all at once); a legacy completion's text offsets run on from one event to the next."""

    def __init__(self, order, token_bytes):
        self.order, self.token_bytes = order, token_bytes
        self.offsets = [shapes.TextOffsets() for _ in range(order.n)]  # each choice's text so far (legacy offsets)
        self.opened = [False] * order.n  # echo: the choice's text has opened with the prompt

    def echoed(self, event: Event, request) -> Event:
        """`event` as a choice's first event goes out when the request echoes its prompt: the prompt's
        text before its own, and the prompt's logprobs (its first token has none) before its records.
        An order of max_tokens 0 shows none of the token its engine request generated."""
        if self.order.max_tokens == 0:  # the token the engine drew is nobody's; it ends by length, as OpenAI's
            ended = "length" if event.finish_reason == "stop" else event.finish_reason
            event = attrs.evolve(event, text="", logprobs=(), finish_reason=ended)
        if self.order.echo is None or self.opened[event.index]:
            return event
        self.opened[event.index] = True
        prompt = tuple(request.prompt_logprobs) or (None,) * len(request.prompt)
        records = (TokenLogprob(request.prompt[0], None), *prompt[1:]) + tuple(event.logprobs)
        return attrs.evolve(event, text=self.order.echo + event.text, logprobs=records)

    def of(self, event: Event) -> dict | None:
        """The logprobs object of `event`'s records; None when the request asked for none or it has none."""
        if self.order.logprobs is None or not event.logprobs:
            return None
        if self.order.chat:
            return shapes.chat_logprobs(event.logprobs, self.token_bytes)
        return shapes.text_logprobs(event.logprobs, self.token_bytes, self.offsets[event.index])

    def empty(self) -> dict:
        """A choice with no token (it ended on EOS at once): the object, empty."""
        if self.order.chat:
            return shapes.chat_logprobs((), self.token_bytes)
        return shapes.text_logprobs((), self.token_bytes)


async def client_gone(request: Request) -> None:
    """Returns once the client has disconnected. The body is read already, so the server's next
    message for this request is `http.disconnect` (the ASGI server sends it as the socket closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(FRAME_POLL_S)  # uvicorn sends nothing else; a server that did must not spin the loop


async def next_event_unless(ticket: Ticket, gone: asyncio.Future) -> Event | None:
    """The ticket's next event, or None as soon as `gone` is done first."""
    getter = asyncio.ensure_future(ticket.events.get())
    try:
        await asyncio.wait((getter, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else None


def usage_of(ticket: Ticket) -> dict:
    r = ticket.request
    completion = sum(len(s.generated) for s in r.samples) if ticket.order.max_tokens else 0  # 0: echo only
    return shapes.usage(len(r.prompt), completion, r.cached_tokens)


# -- errors, in OpenAI's shape


async def refused(request: Request, exc: KVLayoutError) -> Response:
    """A KVLayoutError with a status is the answer it carries (a 429 says when to retry). One
    without is no client's doing: raised on, it is the 500 of any other exception (internal_error,
    and the server logs it)."""
    if exc.status is None:
        raise exc
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
    return EchoingJSON(shapes.error(str(exc), exc.kind, exc.param, exc.code), exc.status, headers=headers)


class EchoingJSON(JSONResponse):
    """A JSONResponse whose message may echo a client's text, lone surrogates included (JSON's
    `\\ud800` escapes, which Python reads and UTF-8 cannot write): written back as those same
    escapes, not a 500. Only inside JSON strings can they be, so the text stays valid JSON."""

    def render(self, content) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")


async def http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    text = message.get(exc.status_code, str(exc.detail))
    return JSONResponse(shapes.error(text, "invalid_request_error"), exc.status_code, headers=exc.headers)


async def left_mid_body(request: Request, exc: ClientDisconnect) -> Response:
    """The client went away before its body was whole: nothing to do, nobody to answer, nothing to log."""
    return Response(status_code=499)


async def internal_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(shapes.error(f"internal error: {type(exc).__name__}: {one_line(exc)}", "server_error"), 500)
