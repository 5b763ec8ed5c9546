"""Incremental detokenization, checked against decoding every id at once (the oracle)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlayout.models.detokenize import REPLACEMENT, Detokenizer
from kvlayout.models.tokenizer import BYTE_VOCAB, ByteTokenizer
from tests.chat_dirs import MULTIBYTE, bpe, byte_fallback

BPE = bpe()
FALLBACK = byte_fallback()
DECODERS = {
    "bytes": ByteTokenizer().decode,
    "byte-level-bpe": lambda ids: BPE.decode(list(ids), skip_special_tokens=True),
    "byte-fallback": lambda ids: FALLBACK.decode(list(ids), skip_special_tokens=True),
}
ENCODERS = {
    "bytes": ByteTokenizer().encode,
    "byte-level-bpe": lambda text: BPE.encode(text).ids,
    "byte-fallback": lambda text: FALLBACK.encode(text).ids,
}
VOCAB = {"bytes": BYTE_VOCAB, "byte-level-bpe": BPE.get_vocab_size(), "byte-fallback": FALLBACK.get_vocab_size()}


def stream(decode, ids) -> list[str]:
    d = Detokenizer(decode)
    pieces = [d.add(t) for t in ids]
    return pieces + [d.flush()]


@pytest.mark.parametrize("kind", sorted(DECODERS))
@pytest.mark.parametrize("text", MULTIBYTE)
def test_pieces_join_to_the_full_decode_and_never_split_a_character(kind, text):
    ids = ENCODERS[kind](text)
    pieces = stream(DECODERS[kind], ids)
    assert "".join(pieces) == DECODERS[kind](ids) == text
    # Every character is whole: no piece holds a replacement for half a character.
    assert not any(REPLACEMENT in p for p in pieces)
    # And the characters do span tokens here, so something was held back.
    assert any(p == "" for p in pieces[:-1])


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_a_piece_is_given_as_soon_as_its_character_is_complete(kind):
    text = "a😀b"
    ids = ENCODERS[kind](text)
    d = Detokenizer(DECODERS[kind])
    seen = ""
    for i, t in enumerate(ids):
        seen += d.add(t)
        # Whatever is whole so far is out: the decode of the prefix, less a trailing partial character.
        assert seen == DECODERS[kind](ids[: i + 1]).rstrip(REPLACEMENT)


def test_a_character_cut_off_at_the_end_comes_out_of_flush_as_the_decoder_writes_it():
    ids = list("ok😀".encode())[:-1]  # the emoji's last byte never comes
    d = Detokenizer(ByteTokenizer().decode)
    assert "".join(d.add(t) for t in ids) == "ok"
    assert d.flush() == REPLACEMENT


def test_special_tokens_give_no_text_and_keep_the_context():
    tok = ByteTokenizer()
    d = Detokenizer(tok.decode)
    assert [d.add(t) for t in [256, *"é".encode(), 257]] == ["", "", "é", ""]


@pytest.mark.parametrize("kind", sorted(DECODERS))
@given(text=st.text(max_size=16))
def test_any_text_streams_to_the_full_decode_of_its_ids(kind, text):
    ids = ENCODERS[kind](text)
    assert "".join(stream(DECODERS[kind], ids)) == DECODERS[kind](ids)


@pytest.mark.parametrize("kind", ["bytes", "byte-level-bpe"])
@given(data=st.data())
def test_any_id_sequence_streams_to_its_full_decode(kind, data):
    # Arbitrary ids, invalid UTF-8 and specials included. (Not byte-fallback: its decoder turns
    # every byte of an invalid run into U+FFFD, so a valid byte decodes differently once an
    # invalid one follows it; no stream of pieces can take back what it gave.)
    ids = data.draw(st.lists(st.integers(0, VOCAB[kind] - 1), max_size=24))
    assert "".join(stream(DECODERS[kind], ids)) == DECODERS[kind](ids)
