"""Incremental detokenization: the text of a token stream, piece by piece, as it is generated.

Decoding one token alone is wrong for most tokenizers: a byte-level token may
hold half of a multi-byte character, and a SentencePiece token's leading
space depends on what came before it. So each new token is decoded together
with the tokens of the piece before it (the context), and the new piece is
what that adds to the context's own text; a piece whose text ends in U+FFFD
(an incomplete UTF-8 sequence, so far) is held back until the next token
completes it. Each token costs two decodes of a few tokens, never of the
whole output. The pieces, then `flush()`, join to `decode(all ids)` (tested
against it on emoji, CJK and accents, byte and BPE tokenizers).
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete (or invalid) UTF-8 sequence


class Detokenizer:
    """Text pieces of a token stream: `add(token)` gives what the token completes (maybe "")."""

    def __init__(self, decode: Callable[[Sequence[int]], str], tokens: Sequence[int] = ()):
        self.decode = decode
        self.tokens: list[int] = []
        # tokens[context:done] produced the last piece given out; tokens[done:] are not given out yet.
        self.context = 0
        self.done = 0
        for t in tokens:
            self.add(t)

    def add(self, token: int) -> str:
        """Take the next token; the text it completes ("" while a character is incomplete)."""
        self.tokens.append(int(token))
        before = self.decode(self.tokens[self.context : self.done])
        text = self.decode(self.tokens[self.context :])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""  # nothing new (a special token), or a character still incomplete: wait
        self.context, self.done = self.done, len(self.tokens)
        return text[len(before) :]

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end, as the decoder writes it)."""
        before = self.decode(self.tokens[self.context : self.done])
        text = self.decode(self.tokens[self.context :])
        self.context = self.done = len(self.tokens)
        return text[len(before) :]
