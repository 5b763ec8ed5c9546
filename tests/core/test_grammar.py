"""kvlayout.grammar: JSON schemas compiled by llguidance into per-sample matchers, checked against oracles of
their own: real token sequences of valid JSON (the model's tokenizer, SmolLM2's byte-level BPE, and bytes), each
token's bytes read from the vocabulary here (GPT-2's byte alphabet), the mask's bits unpacked here, `json.loads`
and a small schema checker written here for the test schemas."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from tokenizers import Tokenizer

from kvlayout.errors import BadRequest, ConfigError
from kvlayout.grammar import Grammars, fill_all, tokenizer_json
from kvlayout.models import smollm2
from kvlayout.models.tokenizer import ByteTokenizer, HFTokenizer

SMOL_VOCAB, SMOL_EOS = 49152, [2, 0]  # <|im_end|>, <|endoftext|>
BYTE_EOS = 257
PARAM = "response_format.json_schema.schema"


def gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character a byte is written as in the vocabulary -> the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


class Vocab:
    """A tokenizer under test with what the oracle needs: its ids' bytes (b"" for a special id) and how it encodes."""

    def __init__(self, name, tokenizer, pieces: list[bytes], logits: int, eos: list[int]):
        self.name, self.tokenizer, self.pieces, self.logits, self.eos = name, tokenizer, pieces, logits, eos
        self.grammars = Grammars(tokenizer, logits, eos)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8")  # strict: a broken character fails here


@pytest.fixture(scope="module")
def smol_path():
    return smollm2.smollm2_dir(progress=lambda line: None) / "tokenizer.json"  # fetched and converted once, cached


@pytest.fixture(scope="module")
def smol_pieces(smol_path) -> list[bytes]:
    raw = Tokenizer.from_file(str(smol_path))
    special = {i for i, t in raw.get_added_tokens_decoder().items() if t.special}
    alphabet = gpt2_bytes()
    pieces = [b""] * SMOL_VOCAB
    for piece, i in raw.get_vocab(with_added_tokens=True).items():
        if i not in special:
            pieces[i] = bytes(alphabet[c] for c in piece)
    return pieces


@pytest.fixture(scope="module")
def smol(smol_path, smol_pieces) -> Vocab:
    """SmolLM2's tokenizer under logits 64 ids wider than its vocabulary (padding that must never be allowed)."""
    return Vocab("smol", HFTokenizer(smol_path, SMOL_EOS), smol_pieces, SMOL_VOCAB + 64, SMOL_EOS)


def byte_vocab(logits: int = 258) -> Vocab:
    return Vocab("bytes", ByteTokenizer(), [bytes([b]) for b in range(256)] + [b""] * (logits - 256), logits,
                 [BYTE_EOS])


@pytest.fixture(scope="module", params=["smol", "bytes"])
def vocab(request) -> Vocab:
    if request.param == "bytes":
        return byte_vocab(258 + 50)  # padding up to a width that is no multiple of 32
    return request.getfixturevalue("smol")


def allowed(matcher, vocab: Vocab) -> np.ndarray:
    """The ids `matcher` allows next, as a bool [V]; checks the row's width and that nothing past the
    vocabulary, or past V within the last word, is ever set."""
    words = np.zeros(-(-vocab.logits // 32), dtype=np.int32)
    matcher.fill(words)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
    stray = np.nonzero(bits)[0]
    stray = stray[(stray >= vocab.logits) | (stray >= len(vocab.pieces))]
    assert not stray.size, f"ids past the vocabulary allowed: {stray[:5]}"
    assert bits.any(), "nothing allowed"
    return bits[: vocab.logits]


def walk(matcher, vocab: Vocab, text: str) -> tuple[bool, int, list[np.ndarray]]:
    """Feed `text` to `matcher`: at each step its plain tokenization's next token when allowed and aligned, else
    the longest allowed token spelling what comes next (llguidance may insist on canonical tokens). Returns
    (whole text accepted, bytes accepted, the masks seen)."""
    data, plain = text.encode("utf-8"), vocab.encode(text)
    offsets = np.cumsum([0] + [len(vocab.pieces[t]) for t in plain])
    starts = {int(offset): token for offset, token in zip(offsets, plain)}  # byte offset -> plain token there
    done, masks = 0, []
    while done < len(data):
        bits = allowed(matcher, vocab)
        masks.append(bits)
        token = starts.get(done)
        if token is None or not bits[token]:
            spelled = [i for i in np.nonzero(bits)[0] if vocab.pieces[i] and data.startswith(vocab.pieces[i], done)]
            if not spelled:
                return False, done, masks
            token = max(spelled, key=lambda i: len(vocab.pieces[i]))
        matcher.accept(int(token))
        done += len(vocab.pieces[token])
    return True, done, masks


def assert_walks_to_the_end(grammar, vocab: Vocab, text: str) -> None:
    matcher = grammar.matcher()
    whole, done, _ = walk(matcher, vocab, text)
    assert whole, f"refused {text.encode()[done:done + 20]!r} after {text.encode()[:done]!r}"
    assert matcher.complete
    assert set(np.nonzero(allowed(matcher, vocab))[0]) == set(vocab.eos)  # a whole object: only EOS follows


def random_walk(grammar, vocab: Vocab, seed: int, limit: int = 400) -> str:
    """Draw the argmax of seeded random logits under the mask until an EOS is drawn; the text drawn."""
    rng, matcher, ids = np.random.default_rng(seed), grammar.matcher(), []
    for _ in range(limit):
        logits = np.where(allowed(matcher, vocab), rng.standard_normal(vocab.logits), -np.inf)
        token = int(np.argmax(logits))
        if token in vocab.eos:
            assert matcher.complete
            return vocab.text(ids)
        matcher.accept(token)
        ids.append(token)
    raise AssertionError(f"no EOS after {limit} tokens: {vocab.text(ids)!r}")


TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None),
         "array": list, "object": dict}


def conforms(value, schema: dict, at: str = "$") -> None:
    """Assert `value` matches `schema` (the keywords the test schemas use; objects are read as closed)."""
    if "enum" in schema:
        assert value in schema["enum"], f"{at}: {value!r} not in {schema['enum']}"
    kinds = schema.get("type", [])
    kinds = kinds if isinstance(kinds, list) else [kinds]
    matching = [k for k in kinds if isinstance(value, TYPES[k]) and not (k != "boolean" and isinstance(value, bool))]
    assert matching or not kinds, f"{at}: {value!r} is none of {kinds}"
    kind = matching[0] if matching else None
    if kind == "string":
        assert len(value) <= schema.get("maxLength", len(value)), f"{at}: {value!r} too long"
    if kind in ("integer", "number"):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{at}: {value} out of range"
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), f"{at}: {len(value)}"
        for i, item in enumerate(value):
            conforms(item, schema["items"], f"{at}[{i}]")
    if kind == "object":
        properties = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), f"{at}: missing {set(schema['required']) - set(value)}"
        assert set(value) <= set(properties), f"{at}: unexpected {set(value) - set(properties)}"
        for key, item in value.items():
            conforms(item, properties[key], f"{at}.{key}")


def closed(**properties) -> dict:
    """An object schema as OpenAI's strict rules write it: every property required, no others."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


STATUS = {"enum": ["pending", "shipped", "délivré"]}
ITEM = closed(sku={"type": "string", "maxLength": 6}, qty={"type": "integer", "minimum": 0, "maximum": 99},
              status=STATUS)
# Bounded everywhere, so a random walk ends: short strings, small integers, few items.
ORDER = closed(order_id={"type": "integer", "minimum": 1, "maximum": 9999}, rush={"type": "boolean"},
               note={"type": ["string", "null"], "maxLength": 8},
               items={"type": "array", "items": ITEM, "minItems": 1, "maxItems": 3})
ORDER_INSTANCES = [
    {"order_id": 1042, "rush": True, "note": None, "items": [{"sku": "AB-12", "qty": 3, "status": "shipped"}]},
    {"order_id": 7, "rush": False, "note": "fragile", "items": [{"sku": "é\"x", "qty": 0, "status": "délivré"},
                                                                 {"sku": "", "qty": 99, "status": "pending"}]},
]


@pytest.mark.parametrize("instance", ORDER_INSTANCES)
@pytest.mark.parametrize("style", ["compact", "spaced", "pretty"])
def test_every_step_of_a_valid_instance_is_allowed_and_only_eos_follows(vocab, instance, style):
    grammar = vocab.grammars.json_schema(ORDER, strict=True)
    dumps = {"compact": {"separators": (",", ":")}, "spaced": {}, "pretty": {"indent": 2}}[style]
    assert_walks_to_the_end(grammar, vocab, json.dumps(instance, ensure_ascii=False, **dumps))


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_give_json_that_matches_the_schema(vocab, seed):
    text = random_walk(vocab.grammars.json_schema(ORDER, strict=False), vocab, seed)
    conforms(json.loads(text), ORDER)


OPEN = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                         "tags": {"type": "array", "items": STATUS, "maxItems": 2},
                                         "inner": {"type": "object", "properties": {"n": {"type": "boolean"}}}}}
OPEN_AS_STRICT = closed(name=OPEN["properties"]["name"], tags=OPEN["properties"]["tags"],
                        inner=closed(n={"type": "boolean"}))


@pytest.mark.parametrize("seed", range(4))
def test_strict_closes_every_object_and_requires_every_property(vocab, seed):
    text = random_walk(vocab.grammars.json_schema(OPEN, strict=True), vocab, seed)
    conforms(json.loads(text), OPEN_AS_STRICT)


def test_strict_refuses_a_missing_or_extra_property_that_the_schema_as_written_allows(vocab):
    lax, strict = vocab.grammars.json_schema(OPEN, strict=False), vocab.grammars.json_schema(OPEN, strict=True)
    for text in ['{"name":"ab"}', '{"name":"ab","tags":[],"inner":{},"other":1}', "{}"]:
        assert_walks_to_the_end(lax, vocab, text)
        assert not walk(strict.matcher(), vocab, text)[0] or not strict.matcher().complete, text
    assert_walks_to_the_end(strict, vocab, '{"name":"ab","tags":["pending"],"inner":{"n":true}}')
    for text in ['{"name":"ab","tags":[],"inner":{}}', '{"name":"ab","tags":[],"inner":{"n":true},"x":1}']:
        assert not walk(strict.matcher(), vocab, text)[0], text


def test_strict_reads_keywords_by_place_not_by_name(vocab):
    """Properties named `properties`, `type` and `required` are properties, not keywords."""
    schema = {"type": "object", "properties": {"properties": {"type": "string"}, "type": {"type": "integer"},
                                               "required": {"type": "object", "properties": {"a": {"type": "null"}}}}}
    grammar = vocab.grammars.json_schema(schema, strict=True)
    assert_walks_to_the_end(grammar, vocab, '{"properties":"x","type":1,"required":{"a":null}}')
    assert not walk(grammar.matcher(), vocab, '{"properties":"x","type":1,"required":{}}')[0]


def test_strict_refuses_an_explicitly_open_object_naming_the_place(smol):
    schema = {"type": "object", "properties": {"a": {"type": "object", "additionalProperties": True}}}
    with pytest.raises(BadRequest) as caught:
        smol.grammars.json_schema(schema, strict=True, param="tools[0].function.parameters")
    assert caught.value.param == "tools[0].function.parameters" and caught.value.status == 400
    assert "/properties/a" in caught.value.message
    smol.grammars.json_schema(schema, strict=False)  # as written it is fine


@pytest.mark.parametrize("schema, said", [
    ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "strnig"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nothing"}}}, "/$defs/nothing"),
    ({"type": "string", "pattern": "(("}, "unclosed group"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"type": "number", "minimum": float("nan")}, "NaN"),
    (["type", "object"], "JSON object"),
])
def test_a_schema_llguidance_cannot_compile_is_a_bad_request_saying_why(vocab, schema, said):
    for param in (PARAM, "text.format.schema"):
        with pytest.raises(BadRequest) as caught:
            if param == PARAM:
                vocab.grammars.json_schema(schema, strict=False)
            else:
                vocab.grammars.json_schema(schema, strict=True, param=param)
        error = caught.value
        assert (error.param, error.status) == (param, 400)
        assert said in error.message and "\n" not in error.message and len(error.message) < 400


ANY = [{"a": [1, -2.5e3, True, None, {"b": "é\n\"\\"}], "": {}}, {}, {"x": [[], [[]]], "y": "😀 tab\t"}]


@pytest.mark.parametrize("instance", ANY)
def test_any_json_takes_any_object_written_any_usual_way(vocab, instance):
    grammar = vocab.grammars.any_json()
    for dumps in ({"separators": (",", ":")}, {}, {"indent": 4}):
        assert_walks_to_the_end(grammar, vocab, json.dumps(instance, ensure_ascii=False, **dumps))


@pytest.mark.parametrize("text", ['[1]', '"a"', "1", "null", 'x{}'])
def test_any_json_takes_only_objects(vocab, text):
    assert not walk(vocab.grammars.any_json().matcher(), vocab, text)[0]


def test_whitespace_between_tokens_is_bounded():
    vocab = byte_vocab()
    grammar = vocab.grammars.any_json()
    assert_walks_to_the_end(grammar, vocab, "{" + " " * 32 + '"a":\n' + "\t" * 32 + "1\r\n}")
    assert not walk(grammar.matcher(), vocab, "{" + " " * 33 + '"a":1}')[0]
    assert not walk(grammar.matcher(), vocab, '{"a":1\n\n}')[0]


def test_an_id_the_grammar_refused_breaks_the_matcher_leaving_only_eos(vocab):
    matcher = vocab.grammars.any_json().matcher()
    refused = int(np.nonzero(~allowed(matcher, vocab))[0][0])
    matcher.accept(refused)
    assert set(np.nonzero(allowed(matcher, vocab))[0]) == set(vocab.eos) and not matcher.complete


def test_rollback_gives_back_the_masks_seen_before_an_eos_counting_as_one_id(vocab):
    grammar = vocab.grammars.json_schema(ORDER, strict=True)
    text = json.dumps(ORDER_INSTANCES[1], ensure_ascii=False)
    matcher = grammar.matcher()
    assert not matcher.rollback(1)  # nothing accepted yet: refused, and the matcher goes on unharmed
    whole, _, masks = walk(matcher, vocab, text)
    assert whole and matcher.complete
    last = allowed(matcher, vocab)
    matcher.accept(vocab.eos[0])
    assert matcher.rollback(1) and matcher.complete and (allowed(matcher, vocab) == last).all()
    matcher.accept(vocab.eos[0])
    assert matcher.rollback(4)  # the EOS and three ids
    assert not matcher.complete
    assert (allowed(matcher, vocab) == masks[-3]).all()
    assert not matcher.rollback(len(masks))  # one more than it holds now


def test_rolling_back_the_eos_of_a_scalar_lets_it_grow_again(vocab):
    matcher = vocab.grammars.json_schema({"type": "integer"}, strict=False).matcher()
    assert walk(matcher, vocab, "12")[0] and matcher.complete
    matcher.accept(vocab.eos[0])
    assert set(np.nonzero(allowed(matcher, vocab))[0]) == set(vocab.eos)  # ended: nothing but EOS
    assert matcher.rollback(1)
    assert walk(matcher, vocab, "3")[0] and matcher.complete


def test_fill_all_fills_each_row_as_its_matcher_would_and_leaves_none_rows_alone(vocab):
    grammar = vocab.grammars.json_schema(ORDER, strict=True)
    text = json.dumps(ORDER_INSTANCES[0])
    matchers = [grammar.matcher() for _ in range(3)]
    for m, cut in zip(matchers, (0, 10, len(text))):
        assert walk(m, vocab, text[:cut])[0]
    words = np.zeros((4, -(-vocab.logits // 32)), dtype=np.int32)
    words[1] = -1
    fill_all([matchers[0], None, matchers[1], matchers[2]], words)
    assert (words[1] == -1).all()
    for row, m in zip((0, 2, 3), matchers):
        alone = np.zeros_like(words[row])
        m.fill(alone)
        assert (words[row] == alone).all()
    last = np.unpackbits(words[3].view(np.uint8), bitorder="little")
    assert set(np.nonzero(last)[0]) == set(vocab.eos)


def test_logits_narrower_than_the_vocabulary_never_allow_the_ids_beyond(smol_path, smol_pieces):
    vocab = Vocab("smol-narrow", HFTokenizer(smol_path, SMOL_EOS), smol_pieces, 49100, SMOL_EOS)
    assert_walks_to_the_end(vocab.grammars.json_schema(ORDER, strict=True), vocab, json.dumps(ORDER_INSTANCES[0]))
    matchers = [vocab.grammars.any_json().matcher() for _ in range(2)]
    for m in matchers:
        assert walk(m, vocab, '{"a":"')[0]  # inside a string: every id that spells text is allowed
    words = np.zeros((2, -(-49100 // 32)), dtype=np.int32)
    fill_all(matchers, words)
    assert not np.unpackbits(words.view(np.uint8), bitorder="little").reshape(2, -1)[:, 49100:].any()


def test_a_schema_compiles_once_per_text_and_threads_share_it():
    grammars = byte_vocab().grammars  # llguidance's tokenizer not built yet: the threads race to build it
    results = []
    threads = [threading.Thread(target=lambda: results.append(grammars.json_schema(ORDER, strict=True)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(g is results[0] for g in results)
    assert grammars.json_schema(json.loads(json.dumps(ORDER)), strict=True) is results[0]
    assert grammars.json_schema(ORDER, strict=False) is results[0]  # ORDER follows the strict rules already
    assert grammars.json_schema(OPEN, strict=False) is not grammars.json_schema(OPEN, strict=True)
    reordered = dict(reversed(ORDER["properties"].items()))
    assert grammars.json_schema({**ORDER, "properties": reordered}, strict=True) is not results[0]


def test_the_cache_forgets_the_least_recently_used_schema():
    grammars = byte_vocab().grammars
    first = grammars.json_schema({"enum": [0]}, strict=False)
    kept = grammars.json_schema({"enum": [1]}, strict=False)
    for n in range(2, 65):
        grammars.json_schema({"enum": [n]}, strict=False)
        assert grammars.json_schema({"enum": [1]}, strict=False) is kept  # used again: stays
    assert grammars.json_schema({"enum": [0]}, strict=False) is not first


def test_the_tokenizer_json_comes_from_a_public_accessor(smol_path):
    text = smol_path.read_text()
    assert json.loads(tokenizer_json(Tokenizer.from_file(str(smol_path))))["model"]["type"] == "BPE"
    assert json.loads(tokenizer_json(HFTokenizer(smol_path, SMOL_EOS))) == json.loads(text)
    assert tokenizer_json(object()) is None
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Grammars(object(), 100, [1]).any_json()


def test_eos_ids_past_the_logits_are_dropped_and_none_left_is_refused():
    with pytest.raises(ConfigError, match="end-of-sequence"):
        Grammars(ByteTokenizer(), 258, [300])
    vocab = byte_vocab()
    grammars = Grammars(ByteTokenizer(), 258, [BYTE_EOS, 999])
    assert_walks_to_the_end(grammars.any_json(), vocab, "{}")
