"""A sample's text as it is generated: stop strings found across pieces, nothing shown too early.

The oracle: the whole decode of the ids, searched and cut by hand.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlayout.models.tokenizer import ByteTokenizer
from kvlayout.runner.text import SampleText

TOK = ByteTokenizer()


def feed(text: SampleText, ids) -> tuple[list[str], int | None]:
    """Feed ids until the stopper says stop: (what take_new gave after each, tokens fed)."""
    shown = []
    for k, t in enumerate(ids, 1):
        stopped = text(t)
        shown.append(text.take_new(final=stopped))
        if stopped:
            return shown, k
    shown.append(text.take_new(final=True))
    return shown, None


def cut_by_hand(full: str, stops) -> str:
    hits = [full.find(s) for s in stops if s in full]
    return full[: min(hits)] if hits else full


@pytest.mark.parametrize(
    "output, stops, want, tokens",
    [
        ("The answer is 42.\nQ: next", ["\nQ:"], "The answer is 42.", len("The answer is 42.\nQ:")),
        ("abcSTOPdef", ["STOP", "cS"], "ab", 4),  # the earliest start wins, found as soon as it is whole
        ("café😀 done", ["😀"], "café", len("café😀".encode())),  # a stop string of one 4-byte character
        ("no stop here", ["zz"], "no stop here", None),
    ],
)
def test_the_text_ends_before_the_first_stop_string_and_stops_on_the_token_completing_it(output, stops, want, tokens):
    text = SampleText(TOK.decode, stops)
    shown, fed = feed(text, TOK.encode(output))
    assert text.output == want == cut_by_hand(output, stops)
    assert fed == tokens
    assert "".join(shown) == want


def test_text_that_may_start_a_stop_string_is_held_until_it_cannot():
    text = SampleText(TOK.decode, ["</answer>"])
    shown = [text.take_new() for _ in [text(t) for t in b"x</ans"]]
    assert "".join(shown) == "x"  # "</ans" might be the start of the stop string
    for t in b"wer":
        text(t)
    assert text.take_new() == ""
    text(ord("!"))  # "</answer!" is not it: all of it may show now
    assert text.take_new() == "</answer!"


def test_half_a_character_is_never_shown_and_the_end_is_flushed():
    text = SampleText(TOK.decode)
    ids = list("é😀".encode())
    shown = []
    for t in ids[:-1]:
        text(t)
        shown.append(text.take_new())
    assert shown == ["", "é", "", "", ""]
    assert text.take_new(final=True) == "\ufffd"  # cut off mid-character: as the decoder writes it
    assert text.output == TOK.decode(ids[:-1])


def test_a_resumed_sample_is_primed_with_what_it_generated():
    text = SampleText(TOK.decode, ["END"], tokens=list(b"so far EN"))
    assert text.end is None
    assert text(ord("D")) is True
    assert text.output == "so far "


def stop_by_hand(ids, stops) -> tuple[str, int | None]:
    """Decode ever longer prefixes until one holds a stop string: (that text cut, tokens taken)."""
    for k in range(1, len(ids) + 1):
        text = TOK.decode(ids[:k])
        if any(s in text for s in stops):
            return cut_by_hand(text, stops), k
    return TOK.decode(ids), None


@given(
    out=st.text(alphabet="abc😀é\n", max_size=30),
    stops=st.lists(st.text(alphabet="abc😀é\n", min_size=1, max_size=3), max_size=3),
)
def test_any_output_and_stop_strings_match_decoding_every_prefix_by_hand(out, stops):
    text = SampleText(TOK.decode, stops)
    ids = TOK.encode(out)
    shown, fed = feed(text, ids)
    assert (text.output, fed) == stop_by_hand(ids, stops)
    assert "".join(shown) == text.output
