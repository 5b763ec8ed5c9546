"""A model whose decoder layer k raises on demand, after the layers below it wrote K/V."""

from __future__ import annotations

POISON = ord("~")  # a byte no test prompt holds unless it means to


class Boom(RuntimeError):
    pass


class RaisingLayer:
    """Stands in for decoder layer `index`; raises `exc` while armed, else delegates."""

    def __init__(self, layer, index: int, exc=Boom):
        self.layer, self.index, self.exc = layer, index, exc
        self.armed = False
        self.raised = 0

    def __call__(self, x, positions, pos_host, cache):
        if self.armed:
            self.raised += 1
            raise self.exc(f"layer {self.index} failed on purpose")
        return self.layer(x, positions, pos_host, cache)


class FlakyModel:
    """`model` with layer `k` raising on the forwards `fail_calls` names (1-based), or on
    every forward carrying the POISON token when `poison` is set; `exc` is what it raises.
    With k=None the failure comes after every layer ran (as if in the LM head)."""

    def __init__(self, model, k: int | None, fail_calls=(), poison=False, exc=Boom):
        self.model, self.fail_calls, self.poison = model, set(fail_calls), poison
        self.after = k is None
        k = len(model.model.layers) - 1 if k is None else k
        self.layer = RaisingLayer(model.model.layers[k], k, exc)
        self.forwards = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, positions, cache, rows=None):
        self.forwards += 1
        self.layer.armed = self.forwards in self.fail_calls or (self.poison and POISON in tokens)
        layers = self.model.model.layers
        real, layers[self.layer.index] = layers[self.layer.index], self.layer
        armed, self.layer.armed = self.layer.armed, self.layer.armed and not self.after
        try:
            logits = self.model(tokens, positions, cache, rows=rows)
        finally:
            layers[self.layer.index] = real
        if armed and self.after:
            self.layer.raised += 1
            raise self.layer.exc("the LM head failed on purpose")
        return logits


def with_model(loaded, model):
    """A (model, args, tokenizer, name) tuple with another model."""
    return (model, *loaded[1:])
