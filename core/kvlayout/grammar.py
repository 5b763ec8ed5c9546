"""Structured output: OpenAI's `response_format` (`json_object`, `json_schema`) as grammars a sample obeys.

A served model gets one `Grammars`, made from its tokenizer. It compiles a
request's JSON schema into a `Grammar` (once per distinct schema: an LRU
cache), and each constrained sample gets its own `Matcher` from it, the
engine's `Constraint` (engines.shaping): `fill` writes the ids allowed next
as a bitmask row, `accept` tells it the id kept, `complete` says whether the
output so far is a whole match. `fill_all` fills a batch's rows at once.

Why llguidance (bench/grammar_engines.py measured it beside xgrammar and
outlines-core): it compiles a schema in about a millisecond, needs nothing
beyond its own 7 MB wheel, keeps a matcher per sample with `rollback(k)`
(speculative decoding), and fills a batch's masks in parallel off the GIL.

Choices, and why:
- Whitespace: allowed between tokens (a model that writes `{"a": 1}` or
  pretty-prints with indentation is not forced off its habits), but each gap
  is bounded to one optional newline and at most 32 spaces or tabs
  (`WHITESPACE`): llguidance's default, any run of whitespace, lets a
  weak model pad forever without ever finishing its object.
- `strict` (OpenAI's strict mode): every object schema is closed and every
  property required, as OpenAI's rules demand of a strict schema: where the
  schema leaves `additionalProperties` out it becomes false, and `required`
  becomes every property, in order. A schema that already follows the rules
  is unchanged; one that does not is tightened (OpenAI would refuse it),
  except an explicit `additionalProperties` other than false, which is
  refused (BadRequest): tightening it would contradict what was written.
  Non-strict: the schema as written (an object without
  `additionalProperties: false` admits other keys too, as JSON Schema says).
- Properties come out in the schema's order (llguidance's rule, OpenAI's habit).
- The compile options are llguidance's `defaults`: a schema's own
  `x-guidance` (llguidance's extension, e.g. `{"lenient": true}` to ignore
  keywords it does not implement) overrides them. Without it an unsupported
  keyword or value is refused, naming what llguidance said.
- A complete top-level object allows only the EOS ids (llguidance stops
  there: no trailing whitespace). A scalar schema (`{"type": "integer"}`)
  may be complete and still extendable: then EOS and the continuations are
  both allowed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from kvlayout.errors import BadRequest, ConfigError, ShapeError, one_line
from kvlayout.models.tokenizer import ByteTokenizer

SCHEMA_PARAM = "response_format.json_schema.schema"
# One optional line break, then at most 32 spaces or tabs, in each gap between JSON tokens.
WHITESPACE = r"(?:\r?\n)?[ \t]{0,32}"
COMPILE_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE}
CACHE_SIZE = 64  # compiled schemas kept per model
MESSAGE_LIMIT = 300  # characters of llguidance's message a client is told


def tokenizer_json(tokenizer: Any) -> str | None:
    """The text of `tokenizer`'s tokenizer.json, or None when it offers none: a public `json_text`
    (kvlayout's HFTokenizer), or a `tokenizers.Tokenizer`'s `to_str()`."""
    text = getattr(tokenizer, "json_text", None)
    if isinstance(text, str):
        return text
    to_str = getattr(tokenizer, "to_str", None)
    return to_str() if callable(to_str) else None


class ByteVocabulary:
    """ByteTokenizer's vocabulary as llguidance's TokenizerWrapper reads it: id b < 256 is byte b,
    every id from 256 to `size` a special token (never text)."""

    def __init__(self, size: int, eos_id: int):
        self.eos_token_id = eos_id
        self.bos_token_id = None
        self.tokens = [bytes([b]) for b in range(256)] + [f"<|special_{i}|>".encode() for i in range(256, size)]
        self.special_token_ids = list(range(256, size))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def build_lltokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer` (about a second for a real vocabulary): padded to
    `vocab_size` ids where the model's logits are wider than the vocabulary (the padding never allowed)."""
    if isinstance(tokenizer, ByteTokenizer):
        wrapper = llguidance.TokenizerWrapper(ByteVocabulary(max(vocab_size, 256), eos_ids[0]))
        return llguidance.LLTokenizer(wrapper, eos_token=eos_ids)
    text = tokenizer_json(tokenizer)
    if text is None:
        raise ConfigError(f"structured output needs the tokenizer's tokenizer.json text, which a "
                          f"{type(tokenizer).__name__} does not give (no public `json_text`)")
    try:
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_ids)
    except Exception:  # the vocabulary is wider than the logits: no padding, rows are cut to the logits instead
        pass
    try:
        return llguidance.LLTokenizer(text, eos_token=eos_ids)
    except Exception as exc:  # llguidance raises bare ValueErrors / RuntimeErrors for a tokenizer it cannot read
        raise ConfigError(f"structured output: llguidance cannot read the tokenizer ({one_line(exc)})") from None


def set_ids(words: np.ndarray, ids: Iterable[int]) -> None:
    """Set the bits of `ids` in the bitmask row `words`."""
    view = words.view(np.uint32)
    for i in ids:
        view[i // 32] |= np.uint32(1 << (i % 32))


class Matcher:
    """One sample's place in its grammar: the engine's Constraint (engines.shaping), plus `rollback`."""

    def __init__(self, ll: llguidance.LLMatcher, grammars: Grammars):
        self.ll = ll
        self.vocab_size = grammars.vocab_size
        self.width = -(-grammars.vocab_size // 32)
        self.eos_ids = grammars.eos_ids
        self.own_width = -(-grammars.llg_vocab_size // 32)  # llguidance's row: wider when the vocabulary is
        self.tokens: list[int] = []  # the ids accepted (EOS aside): llguidance breaks on a rollback past its start
        self.ended = False  # the last id accepted was an EOS (llguidance's stop, which it does not count)

    def fill(self, words: np.ndarray) -> None:
        """Write the ids allowed next into `words`, an int32 row [ceil(V/32)], V the logits' width
        (bit t % 32 of word t // 32: id t). Ids past the vocabulary are never allowed; a complete
        object allows only the EOS ids; a broken matcher (it accepted an id it refused) only them."""
        self.check_row(words)
        if self.own_width == self.width:
            llguidance.numpy.fill_next_token_bitmask(self.ll, words.reshape(1, -1))
        else:
            own = np.zeros((1, self.own_width), dtype=np.int32)
            llguidance.numpy.fill_next_token_bitmask(self.ll, own)
            shared = min(self.width, self.own_width)
            words[:shared] = own[0, :shared]
            words[shared:] = 0
        self.finish(words)

    def check_row(self, words: np.ndarray) -> None:
        """ShapeError unless `words` is a row `fill` can write: contiguous int32 [ceil(V/32)]."""
        if words.dtype != np.int32 or words.shape != (self.width,) or not words.flags["C_CONTIGUOUS"]:
            raise ShapeError(f"a grammar mask row must be contiguous int32 [{self.width}] for {self.vocab_size} "
                             f"logits, not {words.dtype} {list(words.shape)}")

    def finish(self, words: np.ndarray) -> None:
        """After llguidance's fill: clear the ids past the logits' width, and allow only EOS where
        nothing is allowed or the matcher is broken."""
        spare = self.width * 32 - self.vocab_size
        if spare:
            words.view(np.uint32)[-1] &= np.uint32((1 << (32 - spare)) - 1)
        if self.ll.is_error() or not words.any():
            words[:] = 0
            set_ids(words, self.eos_ids)

    def accept(self, token: int) -> None:
        """The sample keeps `token` (one `fill` allowed, or an EOS). An id the grammar refused
        breaks the matcher for good: from then on only EOS is allowed."""
        token = int(token)
        if not self.ll.consume_token(token):
            return
        if token in self.eos_ids:
            self.ended = True
        else:
            self.tokens.append(token)

    @property
    def complete(self) -> bool:
        """The output so far is a complete match (EOS allowed)."""
        return self.ll.is_accepting() and not self.ll.is_error()

    def rollback(self, k: int) -> bool:
        """Forget the last `k` accepted ids, a final EOS counted as one (speculative decoding's rejected
        drafts). False, the state unchanged, for more than were accepted or a broken matcher."""
        ended = int(self.ended)
        if k < 0 or k > len(self.tokens) + ended or self.ll.is_error():
            return False
        if k == 0:
            return True
        real = k - ended
        if real:
            ok = self.ll.rollback(real)  # after an EOS, llguidance takes back its stop with the ids
        elif self.tokens:  # the EOS alone: llguidance cannot, so take back the id before it and give it again
            ok = self.ll.rollback(1) and self.ll.consume_token(self.tokens[-1])
        else:
            ok = self.ll.reset()
        if ok:
            del self.tokens[len(self.tokens) - real:]
            self.ended = False
        return bool(ok)


class Grammar:
    """A compiled schema: hands each constrained sample a fresh Matcher. `source` is the schema
    text llguidance compiled (after `strict`'s tightening)."""

    def __init__(self, template: llguidance.LLMatcher, source: str, grammars: Grammars):
        self.template = template  # compiled, never advanced: matchers are copies of it
        self.source = source
        self.grammars = grammars
        self.lock = threading.Lock()  # deep_copy borrows the template: one thread at a time

    def matcher(self) -> Matcher:
        """A new sample's matcher, at the grammar's start (a copy: microseconds, no recompile)."""
        with self.lock:
            ll = self.template.deep_copy()
        return Matcher(ll, self.grammars)


class Grammars:
    """The grammars of one served model: `Grammars(tokenizer, vocab_size, eos_ids)`.

    `tokenizer`: kvlayout's HFTokenizer (its tokenizer.json through `tokenizer_json`) or
    ByteTokenizer; `vocab_size`: the width V of the model's logits (may exceed the vocabulary);
    `eos_ids`: the ids that end a sample (those >= V dropped). llguidance's view of the
    tokenizer is built on the first compile, once, whichever thread gets there first.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_ids = sorted({int(i) for i in eos_ids if 0 <= int(i) < self.vocab_size})
        if not self.eos_ids:
            raise ConfigError(f"structured output needs an end-of-sequence id below the vocabulary size "
                              f"{self.vocab_size}; none was given")
        self.lock = threading.Lock()
        self.lltokenizer: llguidance.LLTokenizer | None = None
        self.cache: OrderedDict[str, Grammar] = OrderedDict()  # schema text compiled -> its grammar

    @property
    def llg_vocab_size(self) -> int:
        """The ids llguidance's tokenizer knows (at least V where it could be padded to the logits)."""
        return self.ll_tokenizer().vocab_size

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built on first use (about a second), once."""
        if self.lltokenizer is None:
            with self.lock:
                if self.lltokenizer is None:
                    self.lltokenizer = build_lltokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
        return self.lltokenizer

    def any_json(self) -> Grammar:
        """OpenAI's `json_object`: any JSON object."""
        return self.json_schema({"type": "object"}, strict=False, param="response_format")

    def json_schema(self, schema: dict, strict: bool, param: str = SCHEMA_PARAM) -> Grammar:
        """`schema` compiled (from the cache when it was seen); `strict`: OpenAI's strict mode (the
        module's docstring). BadRequest(message, param) for a schema llguidance cannot compile."""
        if not isinstance(schema, dict):
            raise BadRequest(f"the JSON schema must be a JSON object, not {type(schema).__name__}", param)
        tightened = strict_schema(schema, param) if strict else schema
        try:  # the key order is kept: the order of properties is the order they are written in
            source = json.dumps(tightened, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except ValueError as exc:  # NaN, Infinity: Python's json reads them, llguidance does not
            raise BadRequest(f"invalid JSON schema: {shorten(exc)} (NaN and Infinity are not JSON)", param) from None
        except TypeError as exc:  # a value no JSON has (the server never passes one)
            raise BadRequest(f"invalid JSON schema: {shorten(exc)}", param) from None
        # strict or not, the same text is the same grammar
        return self.cached(source, lambda: Grammar(self.compile(source, param), source, self))

    def lark(self, source: str, param: str) -> Grammar:
        """A grammar in llguidance's Lark syntax (a forced tool call: server.tools), compiled (from the
        cache when it was seen); BadRequest(message, param) when llguidance cannot compile it."""
        return self.cached("lark:" + source, lambda: Grammar(self.compile(source, param, lark=True), source, self))

    def cached(self, key: str, make: Callable[[], Grammar]) -> Grammar:
        """The grammar cached under `key`, else `make()`'s, kept (least recently used ones go)."""
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        grammar = make()  # outside the lock: others go on meanwhile
        with self.lock:
            grammar = self.cache.setdefault(key, grammar)  # a thread that compiled it first wins
            self.cache.move_to_end(key)
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return grammar

    def compile(self, source: str, param: str, lark: bool = False) -> llguidance.LLMatcher:
        """A matcher at the start of `source`'s grammar (a JSON schema's text, or Lark's with `lark`);
        BadRequest saying what llguidance said."""
        tokenizer = self.ll_tokenizer()
        what = "grammar" if lark else "JSON schema"
        try:
            grammar = (llguidance.LLMatcher.grammar_from_lark(source) if lark
                       else llguidance.LLMatcher.grammar_from_json_schema(source, defaults=COMPILE_OPTIONS))
        except ValueError as exc:
            raise BadRequest(f"invalid {what}: {shorten(exc)}", param) from None
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise BadRequest(f"invalid {what}: {shorten(template.get_error())}", param)
        return template


def shorten(reason: BaseException | str) -> str:
    """llguidance's message in one line, at most MESSAGE_LIMIT characters."""
    line = one_line(reason)
    return line if len(line) <= MESSAGE_LIMIT else line[: MESSAGE_LIMIT - 3] + "..."


# Keywords whose value is a schema, a list of schemas, or a map of name -> schema (JSON Schema 2020-12 and draft 7).
SCHEMA_KEYWORDS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                   "unevaluatedItems", "unevaluatedProperties", "additionalProperties")
LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any, param: str = SCHEMA_PARAM, at: str = "") -> Any:
    """`schema` under OpenAI's strict rules (a copy; the module's docstring): every object schema
    closed (`additionalProperties: false`) with every property required. BadRequest naming the
    place (a JSON pointer) where `additionalProperties` is explicitly something else."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for word in SCHEMA_KEYWORDS:
        if isinstance(out.get(word), dict):
            out[word] = strict_schema(out[word], param, f"{at}/{word}")
    for word in LIST_KEYWORDS:
        if isinstance(out.get(word), list):
            out[word] = [strict_schema(s, param, f"{at}/{word}/{i}") for i, s in enumerate(out[word])]
    for word in MAP_KEYWORDS:
        if isinstance(out.get(word), dict):
            out[word] = {k: strict_schema(s, param, f"{at}/{word}/{k}") for k, s in out[word].items()}
    kinds = out.get("type")
    if "properties" in out or kinds == "object" or (isinstance(kinds, list) and "object" in kinds):
        if out.setdefault("additionalProperties", False) is not False:
            raise BadRequest(f"strict mode needs additionalProperties false at {at or '/'}: every object "
                             f"of a strict schema is closed", param)
        properties = out.get("properties")
        out["required"] = list(properties) if isinstance(properties, dict) else []
    return out


EXECUTOR: llguidance.LLExecutor | None = None
EXECUTOR_LOCK = threading.Lock()


def executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for batch fills, made on first use."""
    global EXECUTOR
    with EXECUTOR_LOCK:
        if EXECUTOR is None:
            EXECUTOR = llguidance.LLExecutor()
        return EXECUTOR


def fill_all(matchers: Sequence[Matcher | None], words: np.ndarray) -> None:
    """Fill row i of `words` (int32 [B, ceil(V/32)], C-contiguous) for `matchers[i]`, as each
    Matcher.fill would; a None leaves its row as it is. Several rows are filled in parallel by
    llguidance's threads, off the GIL."""
    rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if words.ndim != 2 or words.shape[0] < len(matchers):
        raise ShapeError(f"grammar masks for {len(matchers)} samples need a [B >= {len(matchers)}, W] array, "
                         f"not {list(words.shape)}")
    direct = all(m.own_width == m.width == words.shape[1] for _, m in rows)
    if len(rows) < 2 or not direct or words.dtype != np.int32 or not words.flags["C_CONTIGUOUS"]:
        for i, m in rows:
            m.fill(words[i])  # checks the row, and cuts llguidance's wider row to it
        return
    llguidance.numpy.fill_next_token_bitmask_par(executor(), [(m.ll, i) for i, m in rows], words)
    for i, m in rows:
        m.finish(words[i])
