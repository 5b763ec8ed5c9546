"""`kvlayout serve`: an OpenAI-compatible server over one engine, continuously batched.

Parts, each importing downward only (the server sits above the runner,
whose model loading, cache building and stop-string texts it reuses):

- `config`: the TOML config (`run`'s sections plus [server] limits).
- `requests`: a request body checked field by field into an `Order`.
- `shapes`: OpenAI's response objects, stream chunks, usage and errors.
- `worker`: the engine thread; tickets in, events out.
- `service`: what a running server holds, prepared before a port is bound.
- `hosts`: the Host check every request passes (DNS rebinding kept out).
- `app`: the Starlette routes; `serve`: binding, uvicorn, signals.
- `connections`: what one connection may hold: deadlines on a request, a cap on how many.
"""
