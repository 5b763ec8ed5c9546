"""`kvlayout serve`'s TOML config: `run`'s sections, meaning what they mean there, plus [server].

`[layout]`, `[cache]`, `[model]` and `[engine]` are read by the runner's
own records (`runner.config.SECTIONS`); `[sampling]` gives the defaults a
request overrides (`temperature`, `top_p`, `seed`; `ServeSampling`: a
temperature or top_p left out is the model's generation_config.json's, else
OpenAI's 1.0). There are no
`[[requests]]`: clients send them. `[server]` holds the limits a client
meets as errors (429, 400, 413), each named by its key in the message.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvlayout.checks import finite_number, int_scalar, reject_unknown
from kvlayout.errors import ConfigError
from kvlayout.runner.config import (
    SECTIONS,
    CacheSection,
    EngineSection,
    LayoutAndModel,
    LayoutSection,
    ModelSection,
    SamplingSection,
    read_section,
    read_toml,
)

DEFAULT_HOST = "127.0.0.1"  # reachable from this machine only, unless the user says otherwise
DEFAULT_PORT = 8080


def is_host_name(name) -> bool:
    """A name a `Host` header can carry, without a port: "kv.example.org", "10.0.0.2", "[::1]"."""
    if not isinstance(name, str) or not 0 < len(name) <= 255:
        return False
    if name.startswith("[") and name.endswith("]"):  # an IPv6 address: its colons are no port
        return all(c in string.hexdigits or c in ":." for c in name[1:-1])
    return not any(c.isspace() or c in "/@:?#[]" for c in name)


def is_cors_origin(origin) -> bool:
    """An origin a browser sends as `Origin` ("http://app.example.org", "https://[::1]:5173"), or `*` for any:
    a scheme, a host and maybe a port, nothing after them (a browser's Origin has no path, not even "/")."""
    if origin == "*":
        return True
    if not isinstance(origin, str):
        return False
    m = re.fullmatch(r"https?://(\[[^\]]*\]|[^:]*)(?::(\d{1,5}))?", origin)
    return m is not None and is_host_name(m[1]) and (m[2] is None or 0 < int(m[2]) <= 65535)


def is_api_key(key) -> bool:
    """A key a client can send as `Authorization: Bearer KEY`: printable ASCII, no spaces."""
    return isinstance(key, str) and 0 < len(key) <= 4096 and all("!" <= c <= "~" for c in key)


@attrs.frozen
class ServerSection:
    """The server's limits.

    `max_sequences`: requests generating at once (a request's n samples
    count n); the rest wait in the server's queue, up to `queue` of them,
    and a request past that is answered 429 with Retry-After. `queue_timeout_s`:
    a request still waiting this long is dropped and answered 503 (a stream:
    an error event, then [DONE]); a waiting stream gets a `: waiting` comment
    every few seconds meanwhile. `max_tokens`:
    the most a request may ask for (and what it gets when it asks for none,
    less where the cache is smaller). `max_body_bytes`: a larger body is
    answered 413. `shutdown_grace_s`: on SIGINT/SIGTERM the server stops
    admitting, answers the queued requests 503 at once and lets the generating
    ones finish this long, then answers them 503 too (a stream: an error event).
    `prefix_cache`: keep finished requests' cells for later prompts that start
    with the same tokens (a cell layout only; engines.prefixes).
    `allowed_hosts`: names a request's `Host` may give besides the server's
    own address (and loopback names on a loopback one); others get 403
    (`server.hosts`, against DNS rebinding). `--allowed-host` adds to them.
    `header_timeout_s`: a request head must be whole this long after its
    first byte (408 when part came; a connection that sends nothing is
    closed). `idle_timeout_s`: a body pausing this long (408), a client not
    reading its answer, or a connection idle between requests is closed.
    `max_connections`: connections open at once; one more is answered 503
    and closed (lowered, with a warning, to what `ulimit -n` allows).
    `api_keys`: when any is given, every route but /health and the page
    itself needs `Authorization: Bearer KEY` (401 otherwise; `server.auth`),
    and each key's requests share cached prefixes only among themselves.
    `--api-key`, `--api-key-file` and KVLAYOUT_API_KEY add to them. Never
    shown: not in the record's repr, not in an error message.
    `cors_origins`: origins whose web pages may call the server from the
    browser (`*`: any); none by default, and then no CORS header is sent.
    `--cors-origin` adds to them.
    `prefix_store`: a directory kept prefixes are written to when the cells
    evict them and when the server stops, and loaded from when a prompt
    starts with one (engines.prefix_store; a relative path is the config
    file's; `--prefix-store` sets it); None: they live in the cells only.
    `prefix_store_bytes`: its budget, least recently used entries going first.
    """

    queue: int = 64
    max_sequences: int = 32
    queue_timeout_s: float = 300.0
    max_tokens: int = 1024
    max_body_bytes: int = 1 << 20
    shutdown_grace_s: float = 10.0
    prefix_cache: bool = True
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=lambda v: tuple(v) if isinstance(v, list) else v)
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_connections: int = 256
    api_keys: tuple[str, ...] = attrs.field(default=(), repr=False,
                                            converter=lambda v: tuple(v) if isinstance(v, list) else v)
    cors_origins: tuple[str, ...] = attrs.field(default=(),
                                                converter=lambda v: tuple(v) if isinstance(v, list) else v)
    prefix_store: str | None = None
    prefix_store_bytes: int = 4 << 30  # 4 GiB: SmolLM2-135M's float32 K/V is 45 KiB a token, ~93k tokens

    def __attrs_post_init__(self):
        int_scalar("server.queue", self.queue, ConfigError, 0, numpy=False)
        int_scalar("server.max_sequences", self.max_sequences, ConfigError, 1, numpy=False)
        int_scalar("server.max_tokens", self.max_tokens, ConfigError, 1, numpy=False)
        int_scalar("server.max_body_bytes", self.max_body_bytes, ConfigError, 64, numpy=False)
        if not isinstance(self.prefix_cache, bool):
            raise ConfigError(f"server.prefix_cache={self.prefix_cache!r}: expected true or false")
        if not (isinstance(self.allowed_hosts, tuple) and all(map(is_host_name, self.allowed_hosts))):
            shown = list(self.allowed_hosts) if isinstance(self.allowed_hosts, tuple) else self.allowed_hosts
            raise ConfigError(f"server.allowed_hosts={shown!r}: expected a list of host names without ports, "
                              "e.g. [\"kv.example.org\"]")
        if finite_number("server.shutdown_grace_s", self.shutdown_grace_s, ConfigError) < 0:
            raise ConfigError(f"server.shutdown_grace_s={self.shutdown_grace_s!r}: expected a number of seconds >= 0")
        for key in ("header_timeout_s", "idle_timeout_s", "queue_timeout_s"):
            value = getattr(self, key)
            if finite_number(f"server.{key}", value, ConfigError) <= 0:
                raise ConfigError(f"server.{key}={value!r}: expected a number of seconds > 0")
        int_scalar("server.max_connections", self.max_connections, ConfigError, 1, numpy=False)
        if self.prefix_store is not None and not (isinstance(self.prefix_store, str) and self.prefix_store.strip()):
            raise ConfigError(f"server.prefix_store={self.prefix_store!r}: expected a directory's path")
        int_scalar("server.prefix_store_bytes", self.prefix_store_bytes, ConfigError, 1, numpy=False)
        if not (isinstance(self.api_keys, tuple) and all(is_api_key(k) for k in self.api_keys)):
            raise ConfigError("server.api_keys: expected a list of non-empty strings of printable ASCII without "
                              "spaces (the keys are not shown here)")
        if not (isinstance(self.cors_origins, tuple) and all(map(is_cors_origin, self.cors_origins))):
            shown = list(self.cors_origins) if isinstance(self.cors_origins, tuple) else self.cors_origins
            raise ConfigError(f"server.cors_origins={shown!r}: expected a list of origins, each "
                              "http(s)://host[:port] or \"*\", e.g. [\"http://localhost:5173\"]")


@attrs.frozen
class ServeSampling:
    """[sampling] of `kvlayout serve`: the defaults of a request that names none. A temperature or
    top_p left out is the model's (generation_config.json's, as vLLM reads it), else OpenAI's (1.0):
    clients wanting greedy output send `temperature: 0`, or the server is given `temperature = 0`."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int = 0

    def __attrs_post_init__(self):
        SamplingSection(**{k: v for k, v in attrs.asdict(self).items() if v is not None})  # run's checks

    def resolved(self, model_defaults: Mapping[str, float]) -> ServeSampling:
        """The defaults in force, every one set: these, else the model's, else OpenAI's."""
        return ServeSampling(
            temperature=pick(self.temperature, model_defaults.get("temperature"), OPENAI_TEMPERATURE),
            top_p=pick(self.top_p, model_defaults.get("top_p"), OPENAI_TOP_P),
            seed=self.seed,
        )


OPENAI_TEMPERATURE = OPENAI_TOP_P = 1.0  # OpenAI's defaults when neither the config nor the model gives one


def pick(*values):
    """The first value that is not None."""
    return next(v for v in values if v is not None)


@attrs.frozen
class ServeConfig(LayoutAndModel):
    """What `kvlayout serve` runs: a layout, a cache, a model, default sampling, the engine, limits.

    Duck-compatible with `RunConfig` where the runner reads a config to load
    a model and build a cache (`model`, `model_dir()`, `cache`, `layout`).
    """

    layout: LayoutSection = LayoutSection()
    cache: CacheSection = CacheSection(capacity=16384, max_seqs=64)
    model: ModelSection = ModelSection(preset="smollm2", fallback="tiny")
    sampling: ServeSampling = ServeSampling()
    engine: EngineSection = EngineSection(prefill_chunk=256)
    server: ServerSection = ServerSection()
    source: str = attrs.field(default="<default>", eq=False)
    base_dir: Path = attrs.field(factory=Path.cwd, eq=False, repr=False)
    # Chat messages go to a model without a template as plain text (the tiny preset); said at start.
    plain_chat: bool = attrs.field(default=True, eq=False)
    # None: clients send the requests (runner.job.prepare reads a config's requests, to check them).
    requests: tuple = attrs.field(default=(), init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        if self.server.max_sequences > self.cache.max_seqs:
            raise ConfigError(
                f"{self.source}: server.max_sequences={self.server.max_sequences} is more than "
                f"cache.max_seqs={self.cache.max_seqs} (the ids the cache has); lower it or raise cache.max_seqs"
            )

    def with_allowed_hosts(self, names) -> ServeConfig:
        """`--allowed-host NAME`s, added to `server.allowed_hosts`."""
        server = attrs.evolve(self.server, allowed_hosts=(*self.server.allowed_hosts, *names))
        return attrs.evolve(self, server=server)

    def with_api_keys(self, keys) -> ServeConfig:
        """`--api-key`, `--api-key-file` and KVLAYOUT_API_KEY's keys, added to `server.api_keys`."""
        server = attrs.evolve(self.server, api_keys=(*self.server.api_keys, *keys))
        return attrs.evolve(self, server=server)

    def with_prefix_store(self, directory: str | None) -> ServeConfig:
        """`--prefix-store DIR` in place of `server.prefix_store` (None: the config's stays)."""
        if directory is None:
            return self
        return attrs.evolve(self, server=attrs.evolve(self.server, prefix_store=directory))

    def prefix_store_dir(self) -> Path | None:
        """The prefix store's directory; a relative path is taken from the config file's directory."""
        if self.server.prefix_store is None:
            return None
        return (self.base_dir / Path(self.server.prefix_store).expanduser()).resolve()

    def with_cors_origins(self, origins) -> ServeConfig:
        """`--cors-origin ORIGIN`s, added to `server.cors_origins`."""
        server = attrs.evolve(self.server, cors_origins=(*self.server.cors_origins, *origins))
        return attrs.evolve(self, server=server)

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], source: str = "<mapping>", base_dir: Path | None = None
    ) -> ServeConfig:
        sections = {**SECTIONS, "sampling": ServeSampling, "server": ServerSection}
        reject_unknown(data, list(sections), f"{source}: config")
        kwargs = {
            name: read_section(section, data[name], name, source) for name, section in sections.items() if name in data
        }
        return cls(**kwargs, source=source, base_dir=base_dir or Path.cwd())


def load_serve_config(path: str | Path | None = None) -> ServeConfig:
    """The config at `path` (ConfigError naming the file when it is not one), or the defaults."""
    if path is None:
        return ServeConfig(source="<default>")
    path = Path(path)
    base_dir = path.resolve().parent if path.is_file() else Path.cwd()
    return ServeConfig.from_mapping(read_toml(path), source=str(path), base_dir=base_dir)
