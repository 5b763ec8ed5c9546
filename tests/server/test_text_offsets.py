"""A legacy completion's `text_offset`s, counted as tokens arrive (server.shapes.TextOffsets): each equals
the length of everything before it decoded at once with "replace" (the oracle), whatever bytes the tokens
hold (parts of characters, invalid bytes, surrogates' encodings), however the stream is cut into events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout.engines.shaping import TokenLogprob
from kvlayout.server.shapes import TextOffsets, text_logprobs

PIECES = st.one_of(st.binary(max_size=3), st.text(max_size=2).map(str.encode),
                   st.sampled_from([b"\xed\xb2", b"\xe2\x80", b"\xf0\x9f\x98"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=16), st.integers(0, 16))
def test_each_offset_is_the_length_of_what_precedes_it_decoded_at_once(pieces, cut):
    records = [TokenLogprob(i, -1.0) for i in range(len(pieces))]
    offsets = TextOffsets()
    got = text_logprobs(records[:cut], pieces.__getitem__, offsets)["text_offset"]
    got += text_logprobs(records[cut:], pieces.__getitem__, offsets)["text_offset"]  # the next event goes on
    assert got == [len(b"".join(pieces[:i]).decode("utf-8", errors="replace")) for i in range(len(pieces))]
