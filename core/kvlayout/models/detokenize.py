"""Incremental detokenization: the text of a token stream, piece by piece, as it is generated.

Decoding one token alone is wrong for most tokenizers: a byte-level token may
hold half of a multi-byte character, and a SentencePiece token's leading
space depends on what came before it. So the new tokens are decoded together
with the tokens of the piece before them (the context window), and what is
new is the text past what was already given out. Text ending in U+FFFD (an
incomplete UTF-8 sequence, so far) is given out up to those replacement
characters, which wait until the next tokens complete them. Each token costs
at most two decodes of a few tokens, never of the whole output. The pieces,
then `flush()`, join to `decode(all ids)` (tested against it on emoji, CJK
and accents, byte and BPE tokenizers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete (or invalid) UTF-8 sequence


class Detokenizer:
    """Text pieces of a token stream: `add(token)` gives what the token completes (maybe "")."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        # The window decoded on each token is tokens[context:]; tokens[:clean] end on a whole
        # character; `shown` characters of the window's text were given out.
        self.context = self.clean = self.shown = 0

    def add(self, token: int) -> str:
        """Take the next token; the text it completes ("" while a character is incomplete)."""
        self.tokens.append(int(token))
        text = self.decode(self.tokens[self.context :])
        end = len(text.rstrip(REPLACEMENT))  # an incomplete character at the end waits
        piece = text[self.shown : end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        if end == len(text):
            # A whole character ends here: the next window starts at the previous such point,
            # so it stays a few tokens long, and all of its text is out.
            self.context, self.clean = self.clean, len(self.tokens)
            self.shown = len(self.decode(self.tokens[self.context :]))
        return piece

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end, as the decoder writes it)."""
        text = self.decode(self.tokens[self.context :])
        piece = text[self.shown :]
        self.shown = len(text)
        return piece
