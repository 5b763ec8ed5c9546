"""Prefix reuse across requests: finished sequences' cells kept in the table, found by their tokens.

A cell layout shares cells between sequences by owner bits, so keeping a
prefix costs no copy: an *entry* is a sequence id of its own that owns the
cells of positions `[0, len(tokens))`, holding exactly `tokens`. The engine
(engines.cell) makes entries at two moments:

- when a prompt is in the cache (its prefill done), an id cloned from it
  (`seq_clone(id, upto)`), so requests still queued behind it find it;
- when a sample finishes, its own id becomes the entry (prompt plus what it
  generated: the next turn of a conversation starts with it).

A new sequence whose tokens start with an entry's is admitted as a clone of
the entry up to the common length and prefills only the rest.

Isolation: every entry and lookup carries an isolation key (a server's
tenant: its API key's hash, its `cache_salt`; "" for none), and a prefix is
shared only between sequences with the same one. The key seeds the hash
chain, so different tenants' blocks never share an index key, and it is
compared again on the exact check, so not even a hash collision crosses it.

Index: a hash chain over blocks of `block` tokens. Block i's key hashes
(key of block i-1, the block's tokens), block 0's seeded by the isolation
key, so one key names a whole prefix of one tenant;
`index[key]` holds the entries whose tokens start with that prefix. A lookup
walks the new tokens' chain to the deepest key any entry holds; among that
key's entries, the one sharing the most tokens exactly (into its partial
last block) is the longest match of all. Matches are counted token by
token, so a hash collision costs a miss, never a wrong prefix. Entries
shorter than one block are not kept, and reuse starts at one whole block.

An entry whose tokens are a prefix of a new one's is dropped when the new
one is kept (the new one owns its cells too); a new one that an entry
already covers is not kept. Eviction is least recently used first, and is
`seq_rm` of the entry's id: cells that a live sequence (or another entry)
still owns stay, so eviction never touches what a live sequence reads.
The engine evicts when live work needs ids or cells, and, to keep a newly
prefilled prompt when ids are short, the least recently used entry.

With a store (engines.prefix_store, a server's `--prefix-store DIR`), an
evicted entry is written to disk first, and `flush` writes them all (the
server stopping); `find` loads a stored prefix that shares more with the new
tokens than the cells can lend into fresh cells (`load_seq`: through the
placement hook, as a step is placed), keeps it as an entry, and finds again.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvlayout.checks import int_scalar
from kvlayout.errors import ConfigError

DEFAULT_BLOCK = 16  # tokens per block of the index: reuse starts at one whole block


@attrs.frozen
class Hit:
    """An entry whose first `length` tokens are the new sequence's first `length`."""

    seq_id: int
    length: int
    source: int | None = None  # the request whose sequence made the cells (reuse of its own is no reuse)


@attrs.define(eq=False)
class Entry:
    tokens: tuple[int, ...]
    keys: list[int]  # the chain of its whole blocks
    used: int  # the use counter when it was last found or kept: LRU order
    source: int | None = None  # the request it came from
    isolation: str = ""  # only lookups with the same isolation key may reuse it


class PrefixCache:
    """The table's kept prefixes: entries by id, their block index, what reuse saved.

    `control` is the cache's BatchControl face: the cache owns the entries' ids
    (it releases them with `seq_rm`); the engine hands it ids to keep.
    """

    def __init__(self, control, block: int = DEFAULT_BLOCK, store: Any = None):
        self.bc, self.block = control, int_scalar("PrefixCache.block", block, ConfigError, minimum=1)
        self.store = store  # an engines.prefix_store.PrefixStore: entries outlive the cells (None: they do not)
        self.entries: dict[int, Entry] = {}
        self.index: dict[int, set[int]] = collections.defaultdict(set)
        self.clock = itertools.count(1)
        self.lookups = self.hits = self.reused_tokens = self.evictions = 0
        self.loaded = 0  # entries taken into the cells from the store: each a verb on the table

    def __len__(self) -> int:
        """Ids the entries hold."""
        return len(self.entries)

    @property
    def tokens(self) -> int:
        """Tokens the entries hold, each counting its whole prefix (shared cells counted again)."""
        return sum(len(e.tokens) for e in self.entries.values())

    def chain(self, tokens: Sequence[int], blocks: int, isolation: str = "") -> list[int]:
        """The keys of the first `blocks` whole blocks of `tokens`, for sequences of `isolation`."""
        keys, key, b = [], chain_seed(isolation), self.block
        for i in range(blocks):
            key = hash((key, tuple(tokens[i * b : (i + 1) * b])))
            keys.append(key)
        return keys

    # -- finding

    def find(self, tokens: Sequence[int], limit: int, isolation: str = "", room: int | None = None) -> Hit | None:
        """The longest reuse for `tokens` among `isolation`'s entries, at most `limit` of them (a
        sequence must feed at least one token to get logits); None when no entry shares a whole first
        block. An entry is reused only as far as the cache can continue it (`usable`). With a store,
        a stored prefix sharing more than the cells do is loaded into them first, as an entry, when it
        takes at most `room` cells (None: as many as are free; the placement says when they are not)."""
        hit = self.find_in_cells(tokens, limit, isolation)
        held = 0 if hit is None else hit.length
        if self.store is not None and self.load_better(tokens, limit, isolation, held, room):
            hit = self.find_in_cells(tokens, limit, isolation)
        return hit

    def load_better(self, tokens: Sequence[int], limit: int, isolation: str, held: int, room: int | None) -> bool:
        """Load the stored prefix of `isolation` sharing the most with `tokens` (at most `limit`) into the
        cells as an entry, when it shares more than the `held` tokens the cells can lend, at least half
        of its own (the whole sequence is read) and fits in `room` cells: whether it did."""
        best = self.store.best(tokens, limit, isolation)
        if best is None or best[1] <= held or (room is not None and len(best[0].tokens) > room):
            return False
        if 2 * best[1] < len(best[0].tokens):  # a whole long chat read in to lend its first blocks: not worth it
            return False
        stored = best[0]
        seq_id = self.store.load(stored)  # None: no room in the cells (nothing changed), or a damaged file
        if seq_id is None:
            return False
        self.loaded += 1
        return self.keep(seq_id, stored.tokens, None, isolation=isolation)

    def find_in_cells(self, tokens: Sequence[int], limit: int, isolation: str = "") -> Hit | None:
        """`find` among the entries the cells hold."""
        depths = self._holders(tokens, limit, isolation)
        for holders in reversed(depths):  # the deepest first: its holders share the most whole blocks
            # The longest usable exact match among them (the most recently used on a tie); none usable
            # (a hash collision, or windows gone): the holders of a shallower key.
            found = [(length, self.entries[i].used, i) for i in holders
                     if self.usable(i, length := self.shared(self.entries[i], tokens, limit, isolation))]
            if found:
                length, _, seq_id = max(found)
                entry = self.entries[seq_id]
                entry.used = next(self.clock)
                return Hit(seq_id, length, entry.source)
        return None

    def usable(self, seq_id: int, length: int) -> bool:
        """Whether entry `seq_id` can lend its first `length` tokens (> 0): a sliding-window layer
        keeps only an entry's last window, so it is continued only from its floor on."""
        return length > 0 and length >= self.bc.seq_floor(seq_id)

    def _holders(self, tokens: Sequence[int], limit: int, isolation: str) -> list[set[int]]:
        """The entries holding each whole block's key of `tokens` (at most `limit` tokens), shallow
        to deep, as far as any entry does."""
        depths = []
        for key in self.chain(tokens, limit // self.block, isolation):
            holders = self.index.get(key)
            if not holders:
                break
            depths.append(holders)
        return depths

    def note_admitted(self, hit: Hit | None) -> None:
        """A sequence was admitted, on `hit` or with nothing reused: what /health and the bench report."""
        self.lookups += 1
        if hit is not None:
            self.hits += 1
            self.reused_tokens += hit.length

    def covers(self, tokens: Sequence[int], keys: list[int] | None = None, isolation: str = "") -> bool:
        """Whether an entry of `isolation` holds all of `tokens` (touching it); the engine then keeps
        no copy. `keys`: their chain (for `isolation`), when the caller has it already."""
        n = len(tokens)
        keys = self.chain(tokens, n // self.block, isolation) if keys is None else keys
        for seq_id in self.index.get(keys[-1], ()) if keys else ():
            entry = self.entries[seq_id]
            if len(entry.tokens) >= n and self.shared(entry, tokens, n, isolation) == n and self.usable(seq_id, n):
                entry.used = next(self.clock)
                return True
        return False

    # -- keeping and dropping

    def keep(self, seq_id: int, tokens: Sequence[int], source: int | None = None,
             keys: list[int] | None = None, isolation: str = "") -> bool:
        """Take `seq_id` (which holds exactly `tokens`, positions 0..) as an entry of `isolation`:
        True. False, having released the id, when it is shorter than a block or an entry already
        covers it. Entries of `isolation` that are prefixes of it are dropped: it owns their cells
        too, where it can lend every length they can (a sliding window's reach: from their floor on).
        `keys`: the tokens' chain (for `isolation`), when the caller has it already."""
        tokens = tuple(tokens)
        keys = self.chain(tokens, len(tokens) // self.block, isolation) if keys is None else keys
        if len(tokens) < self.block or self.covers(tokens, keys, isolation):
            self.bc.seq_rm(seq_id)
            return False
        candidates = set().union(*(self.index.get(k, ()) for k in keys))
        for other in candidates:
            e = self.entries[other]
            n = len(e.tokens)
            if (n <= len(tokens) and self.shared(e, tokens, n, isolation) == n
                    and self.bc.seq_floor(seq_id) <= max(self.bc.seq_floor(other), 1)):
                self.drop(other)
        self.entries[seq_id] = Entry(tokens, keys, next(self.clock), source, isolation)
        for k in keys:
            self.index[k].add(seq_id)
        return True

    @staticmethod
    def shared(entry: Entry, tokens: Sequence[int], limit: int, isolation: str) -> int:
        """How many leading tokens `entry` may lend `tokens` (at most `limit`): none across isolation keys."""
        return common_length(entry.tokens, tokens, limit) if entry.isolation == isolation else 0

    def drop(self, seq_id: int) -> None:
        """Release entry `seq_id`: its cells that no live sequence or other entry owns are freed."""
        entry = self.entries.pop(seq_id)
        for k in entry.keys:
            holders = self.index[k]
            holders.discard(seq_id)
            if not holders:
                del self.index[k]
        self.bc.seq_rm(seq_id)

    def evict(self, spare: int | None = None) -> bool:
        """Drop the least recently used entry other than `spare` (written to the store first, when there
        is one): True, or False when there is none."""
        victims = [i for i in self.entries if i != spare]
        if not victims:
            return False
        victim = min(victims, key=lambda i: self.entries[i].used)
        if self.store is not None:
            entry = self.entries[victim]
            self.store.put(victim, entry.tokens, entry.isolation)  # a failure is the store's to say; evicted anyway
        self.drop(victim)
        self.evictions += 1
        return True

    def flush(self) -> int:
        """Write every entry to the store (the server stopping): how many it holds now. 0 without a store."""
        if self.store is None:
            return 0
        return sum(self.store.put(i, e.tokens, e.isolation) for i, e in list(self.entries.items()))

    def forget(self) -> None:
        """The cache was cleared under the entries: forget them (their ids are gone already)."""
        self.entries.clear()
        self.index.clear()

    def snapshot(self) -> dict:
        out = {
            "entries": len(self.entries),
            "tokens": self.tokens,
            "lookups": self.lookups,
            "hits": self.hits,
            "reused_tokens": self.reused_tokens,
            "evictions": self.evictions,
        }
        if self.store is not None:
            out["store"] = self.store.snapshot()
        return out


def chain_seed(isolation: str) -> int:
    """Block 0's predecessor key: 0 for no isolation, else the key's own (tenants' chains never meet)."""
    return hash(("isolation", isolation)) if isolation else 0


def common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n
