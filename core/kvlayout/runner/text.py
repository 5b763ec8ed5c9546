"""A sample's text while it is generated: its stop strings, and what is safe to show so far.

The engine gives a sample's tokens one at a time to its stopper
(`engines.records.Stopper`); the runner's stopper is a `SampleText`. It
decodes each token incrementally (`models.detokenize`), so a multi-byte
character is never split and the output is never re-decoded per token, and
looks for the stop strings only where the new text could complete one. As
OpenAI does, a sample's text ends before the first stop string it holds,
and text that might be the start of a stop string is not shown until the
next tokens say it is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvlayout.models.detokenize import Detokenizer


class SampleText:
    """The text of one sample; called with each token it keeps, True once a stop string is in it."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), tokens: Sequence[int] = ()):
        self.detokenizer = Detokenizer(decode)
        self.stop = tuple(stop)
        self.longest = max(map(len, self.stop), default=0)
        self.text = ""  # every whole character decoded so far
        self.end: int | None = None  # where the first stop string starts: the output is text[:end]
        self.shown = 0  # text[:shown] was handed out by take_new()
        self.flushed = False
        for t in tokens:  # a resumed sample: what it generated before
            self(t)

    def __call__(self, token: int) -> bool:
        if self.end is not None:
            return True
        piece = self.detokenizer.add(token)
        if not piece:
            return False
        # A stop string completed by this piece starts at most longest - 1 characters before it.
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        found = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            self.end = min(found)
            return True
        return False

    @property
    def output(self) -> str:
        """The sample's text: cut before its stop string, if one came."""
        return self.text if self.end is None else self.text[: self.end]

    def finish(self) -> None:
        """The sample is over: a character left incomplete comes out as the decoder writes it."""
        if not self.flushed and self.end is None:
            self.text += self.detokenizer.flush()
        self.flushed = True

    def take_new(self, final: bool = False) -> str:
        """The text not handed out yet that is safe to show: all of it once `final`; before
        that, whole characters only, and none that may begin a stop string."""
        if final:
            self.finish()
            upto = len(self.output)
        elif self.end is not None:
            upto = self.end
        else:
            upto = len(self.text) - self.pending_stop()
        new = self.text[self.shown : upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return new

    def pending_stop(self) -> int:
        """How many characters at the end of the text could be the start of a stop string."""
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
