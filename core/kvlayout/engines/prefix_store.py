"""Kept prefixes on disk: a directory of saved sequences that outlives the server (issue 30).

`kvlayout serve` keeps prefixes in cells (engines.prefixes); this store keeps
them in files too, so that a restarted server, or another one sharing the
directory, starts with them. The cache does the K/V: `cache.save_seq(id, path)`
writes one sequence, `cache.load_seq(path)` places it in fresh cells of a
cache with the same layers and storage dtype.

Files, per entry, its `key` being sha256 over (the identity's hash, the
isolation key, the tokens) in hex:

- `<key>.<pid>-<random>.seq`: the sequence, as `save_seq` writes it (a
  kvlayout state file, checksummed; written atomically by save_seq itself);
- `<key>.json`: its meta, written last, the entry's commit point: a JSON object
  `{"kvlayout_prefix": 1, "identity": <hex>, "isolation": str, "tokens": [int],
  "seq": <the seq file's name>, "nbytes": int}`. Its mtime is the entry's last
  use: the least recently used entry is evicted first, across restarts.

Guarantees, with any number of stores (processes) on one directory:

- An entry exists exactly while its meta does, and a meta names a whole seq
  file. The meta is written under a unique temporary name (`.<key>.<pid>-<random>.json.tmp`)
  and published with `os.link`, which refuses to replace one another store
  published meanwhile (that store's entry is then adopted, ours dropped);
  where the file system has no hard links, `os.replace` (the last writer wins).
- Deletion (eviction, a damaged entry) takes the meta away first, by renaming it
  to a unique tombstone (`.<key>.<pid>-<random>.gone`), so that only one store
  deletes it and the entry is invisible before its seq file goes. Every store
  reads files that may vanish under it: a vanished file is a miss, never an error.
- Seq files no meta names and leftover temporaries are removed at start once
  older than ORPHAN_GRACE_S (a crash, or a publication race, left them; a put
  in progress elsewhere is younger than that).
- Only entries of this store's identity (model files, layout, kv dtype, ...:
  what the caller says K/V depend on) are used; the others are left alone.
- Nothing raises to the caller for the file system's sake: an unusable
  directory makes an empty store that keeps nothing (said once through `warn`),
  a failed write is said once per kind and answered False, leaving no partial file.
  A line said names the directory or the file; the caller adds who says it.

An entry that a newly stored one begins with (a conversation's earlier
turn, the same isolation key) is deleted: the new one lends all its tokens.

The byte budget counts the seq files of the entries this store knows (its own
puts and what it found at start); another store's later puts are not seen
until a restart, so stores sharing a directory may together exceed one budget.
No file handle is held between calls.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvlayout.checks import int_scalar
from kvlayout.errors import ConfigError, StateError, StepError, one_line, os_reason

DEFAULT_BLOCK = 16  # as engines.prefixes: reuse starts at one whole block
META_MARK = "kvlayout_prefix"  # the meta's format key; its value is the format version
META_FORMAT = 1
ORPHAN_GRACE_S = 600.0
SHOWN_DAMAGED = 3  # damaged files named one by one at start; the rest counted

_META_NAME = re.compile(r"^([0-9a-f]{64})\.json$")
_SEQ_NAME = re.compile(r"^([0-9a-f]{64})\.[0-9]+-[0-9a-f]+\.seq$")
_LEFTOVER_NAME = re.compile(r"^\.[0-9a-f]{64}\..*\.(tmp|gone)$")
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV, errno.ENOSYS}


@attrs.frozen
class Stored:
    """One stored prefix: `key` names its files; its sequence holds `tokens` at positions 0.."""

    key: str
    tokens: tuple[int, ...]
    isolation: str
    nbytes: int


@attrs.define(eq=False)
class _Entry:
    stored: Stored
    seq_name: str  # its seq file, in the store's directory
    used: int  # the store's use counter when last put, found or loaded: LRU order
    chain: list[int]  # the keys of its whole blocks in the index


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def identity_hash(identity: Mapping) -> str:
    """sha256 (hex) of `identity`'s canonical JSON; ConfigError when it is not JSON-able."""
    try:
        return hashlib.sha256(_canonical(dict(identity))).hexdigest()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"prefix store identity: expected a JSON-able mapping ({exc})") from None


def entry_key(identity: str, isolation: str, tokens: Sequence[int]) -> str:
    """The hex key naming the files of `tokens` stored under `isolation` for identity hash `identity`."""
    return hashlib.sha256(_canonical([identity, isolation, list(tokens)])).hexdigest()


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def _unique_tag() -> str:
    """`<pid>-<random>`: no other store, in this process or another, makes the same."""
    return f"{os.getpid()}-{secrets.token_hex(6)}"


def parse_meta(path: Path, text: str) -> dict:
    """A meta file's fields, checked; StateError naming `path` when it is not one. A meta of
    another format version is returned as it is (the caller ignores it: another kvlayout's)."""
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise StateError(f"{path}: not JSON ({exc})") from None
    if not isinstance(meta, dict) or type(meta.get(META_MARK)) is not int:
        raise StateError(f"{path}: not a stored prefix's meta (no {META_MARK!r} version)")
    if meta[META_MARK] != META_FORMAT:
        return meta
    tokens, seq = meta.get("tokens"), meta.get("seq")
    ok = isinstance(meta.get("identity"), str) and isinstance(meta.get("isolation"), str)
    ok = ok and isinstance(tokens, list) and all(type(t) is int and t >= 0 for t in tokens)
    ok = ok and type(meta.get("nbytes")) is int and isinstance(seq, str)
    if not ok:
        raise StateError(f"{path}: a field is missing or of the wrong type")
    key = _META_NAME.match(path.name)
    if key is None or entry_key(meta["identity"], meta["isolation"], tokens) != key.group(1):
        raise StateError(f"{path}: its tokens do not hash to its name")
    seq_key = _SEQ_NAME.match(seq)
    if seq_key is None or seq_key.group(1) != key.group(1):
        raise StateError(f"{path}: seq {seq!r} is not a seq file of this entry")
    return meta


class StoredIndex:
    """The stored entries a store knows, found by their tokens: a hash chain over blocks of `block` tokens
    (block i's key hashes block i-1's and the block's tokens, block 0's seeded by the isolation key, as
    engines.prefixes indexes cells), with LRU stamps and the bytes they hold."""

    def __init__(self, block: int):
        self.block = block
        self.entries: dict[str, _Entry] = {}
        self.index: dict[int, set[str]] = {}
        self.clock = itertools.count(1)
        self.bytes = 0

    def stamp(self) -> int:
        """The next use's LRU stamp."""
        return next(self.clock)

    def chain(self, tokens: Sequence[int], blocks: int, isolation: str) -> list[int]:
        """Keys of the first `blocks` whole blocks, seeded by `isolation`: one key names a whole prefix
        of one isolation key. In-process hashes: the index is rebuilt at every start."""
        keys, key, b = [], hash(("isolation", isolation)), self.block
        for i in range(blocks):
            key = hash((key, tuple(tokens[i * b : (i + 1) * b])))
            keys.append(key)
        return keys

    def add(self, stored: Stored, seq_name: str) -> None:
        chain = self.chain(stored.tokens, len(stored.tokens) // self.block, stored.isolation)
        self.entries[stored.key] = _Entry(stored, seq_name, self.stamp(), chain)
        for k in chain:
            self.index.setdefault(k, set()).add(stored.key)
        self.bytes += stored.nbytes

    def forget(self, key: str) -> _Entry | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        for k in entry.chain:
            holders = self.index[k]
            holders.discard(key)
            if not holders:
                del self.index[k]
        self.bytes -= entry.stored.nbytes
        return entry

    def prefixes_of(self, tokens: tuple[int, ...], isolation: str, other_than: str) -> list[str]:
        """The keys of the entries of `isolation` (but `other_than`) whose tokens all begin `tokens`."""
        chain = self.chain(tokens, len(tokens) // self.block, isolation)
        holders = set().union(*(self.index.get(k, ()) for k in chain))
        out = []
        for key in holders - {other_than}:
            mine = self.entries[key].stored
            if mine.isolation == isolation and len(mine.tokens) <= len(tokens) \
                    and common_length(mine.tokens, tokens) == len(mine.tokens):
                out.append(key)
        return out

    def best(self, tokens: tuple[int, ...], isolation: str) -> tuple[Stored, int] | None:
        """PrefixStore.best over `tokens`, cut to their limit already."""
        depths = []
        for k in self.chain(tokens, len(tokens) // self.block, isolation):
            holders = self.index.get(k)
            if not holders:
                break
            depths.append(holders)
        for holders in reversed(depths):  # the deepest first: its holders share the most whole blocks
            found = [(common_length(e.stored.tokens, tokens), e.used, key)
                     for key in holders if (e := self.entries[key]).stored.isolation == isolation]
            found = [f for f in found if f[0] >= self.block]  # a hash collision matches less
            if found:
                length, _, key = max(found)
                return self.entries[key].stored, length
        return None


class PrefixStore:
    """Stored prefixes in `directory`, at most `budget_bytes` of seq files, for `identity` (see the module).

    `cache`: what saves and loads one sequence (`save_seq`, `load_seq`: the cell
    layout's); `warn`: where the store says, one line at a time, what it could
    not do; `block`: tokens per block of the index, as the PrefixCache's.
    """

    def __init__(self, directory: Path, budget_bytes: int, identity: Mapping, cache,
                 warn: Callable[[str], None], block: int = DEFAULT_BLOCK):
        self.directory, self.cache, self.warn = Path(directory), cache, warn
        self.budget_bytes = int_scalar("prefix store budget_bytes", budget_bytes, ConfigError, minimum=0)
        self.block = int_scalar("prefix store block", block, ConfigError, minimum=1)
        self.identity = identity_hash(identity)
        self.known = StoredIndex(self.block)  # the entries of this identity, by their tokens
        self.hits = self.loads_failed = self.writes = self.write_failures = 0
        self.evictions = self.skipped = 0
        self.warned: set[str] = set()  # the kinds of write failure said already
        self.enabled = self._open_directory()
        if self.enabled:
            self._scan()

    # -- start

    def _open_directory(self) -> bool:
        """Whether the directory exists (made here, parents too) and takes a file; said once if not."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.directory, prefix=f".probe.{_unique_tag()}.")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            self.warn(f"{self.directory}: cannot use it as the prefix store ({os_reason(exc)}); "
                      "prefixes are not kept on disk")
            return False
        return True

    def _scan(self) -> None:
        """Take the directory's entries of this identity, oldest use first; say what was ignored or damaged."""
        try:
            names = sorted(os.listdir(self.directory))  # said in a stable order
        except OSError as exc:
            self.warn(f"{self.directory}: cannot list the prefix store ({os_reason(exc)}); starting empty")
            return
        found, referenced, foreign, damaged = [], set(), 0, []
        for name in names:
            if not _META_NAME.match(name):
                continue
            path = self.directory / name
            try:
                meta, mtime = parse_meta(path, path.read_text()), path.stat().st_mtime
            except FileNotFoundError:  # deleted by another store since the listing
                continue
            except (StateError, OSError, UnicodeDecodeError) as exc:
                damaged.append((path, exc))
                continue
            if isinstance(meta.get("seq"), str):
                referenced.add(meta["seq"])
            if meta[META_MARK] != META_FORMAT or meta["identity"] != self.identity:
                foreign += 1
            else:
                found.append((mtime, path, meta))
        for _, path, meta in sorted(found, key=lambda f: f[0]):
            self._take_found(path, meta)
        self._say_skipped(foreign, damaged)
        self._evict_to_budget(spare="")  # the budget may have shrunk since they were written
        self._sweep(names, referenced)

    def _take_found(self, path: Path, meta: dict) -> None:
        """A meta of this identity found at start: an entry, unless its seq file is gone (then removed)."""
        try:
            nbytes = (self.directory / meta["seq"]).stat().st_size
        except FileNotFoundError:
            self.skipped += 1
            self.warn(f"{path}: its seq file {meta['seq']} is missing; the stored prefix is removed")
            self._remove_files(path.name[:64], meta["seq"])
            return
        except OSError:
            return
        self.known.add(Stored(path.name[:64], tuple(meta["tokens"]), meta["isolation"], nbytes), meta["seq"])

    def _say_skipped(self, foreign: int, damaged: list) -> None:
        """One line for the foreign entries; one per damaged meta (removed), at most SHOWN_DAMAGED, then a count."""
        self.skipped += foreign + len(damaged)
        if foreign:
            self.warn(f"{self.directory}: {foreign} stored prefixes of another model/layout ignored")
        for path, exc in damaged[:SHOWN_DAMAGED]:
            self.warn(f"damaged stored prefix skipped and removed: {self._naming(path, exc)}")
        if len(damaged) > SHOWN_DAMAGED:
            self.warn(f"{self.directory}: {len(damaged) - SHOWN_DAMAGED} more damaged stored prefixes "
                      "skipped and removed")
        for path, _ in damaged:
            self._remove_files(path.name[:64], None)  # its seq file, unknown, goes with the orphans

    def _sweep(self, names: list[str], referenced: set[str]) -> None:
        """Remove seq files no meta names and leftover temporaries, once older than ORPHAN_GRACE_S."""
        now = time.time()
        for name in names:
            if name in referenced or not (_SEQ_NAME.match(name) or _LEFTOVER_NAME.match(name)):
                continue
            path = self.directory / name
            try:
                if now - path.stat().st_mtime > ORPHAN_GRACE_S:
                    path.unlink()
            except OSError:  # gone already, or not ours to remove: left
                pass

    def _touch(self, entry: _Entry) -> None:
        """Most recently used now, here and (the meta's mtime) for the next start."""
        entry.used = self.known.stamp()
        try:
            os.utime(self.directory / f"{entry.stored.key}.json")
        except OSError:  # gone (another store evicted it): the next load says so
            pass

    # -- the API

    def best(self, tokens: Sequence[int], limit: int, isolation: str) -> tuple[Stored, int] | None:
        """The entry of `isolation` sharing the most leading tokens with `tokens[:limit]` (at least one
        whole block; the most recently used on a tie), and how many; None when there is none."""
        return self.known.best(tuple(int(t) for t in tokens[: max(int(limit), 0)]), isolation)

    def load(self, stored: Stored) -> int | None:
        """`stored`'s sequence placed in the cache: its new seq id. None when the cache has no room (the
        entry stays), or when the file cannot be loaded (said in one line; the entry is forgotten and
        its files removed)."""
        entry = self.known.entries.get(stored.key)
        if entry is None:  # forgotten since `best` found it
            return None
        path = self.directory / entry.seq_name
        try:
            seq_id = self.cache.load_seq(path)
        except (StateError, OSError) as exc:
            self.loads_failed += 1
            self.warn(f"cannot load a stored prefix, forgetting it: {self._naming(path, exc)}")
            self.known.forget(stored.key)
            self._remove_files(stored.key, entry.seq_name)
            return None
        if seq_id is not None:
            self.hits += 1
            self._touch(entry)
        return seq_id

    def put(self, seq_id: int, tokens: Sequence[int], isolation: str) -> bool:
        """Store sequence `seq_id` (which holds exactly `tokens`, positions 0..) for `isolation`: True when
        it is stored now (written, or there already: then only touched). False when it is shorter than
        a block, larger than the budget, or could not be written (said once per kind; a save refused
        mid-forward, StepError, is such a failure too). SequenceError for an id not live."""
        tokens = tuple(int(t) for t in tokens)
        if not self.enabled or len(tokens) < self.block:
            return False
        key = entry_key(self.identity, isolation, tokens)
        if self._already_stored(key):
            return True
        if not self._write(seq_id, key, tokens, isolation):
            return False
        # A stored prefix of it (a conversation's earlier turn) is covered now: the new entry lends its tokens.
        for covered in self.known.prefixes_of(tokens, isolation, key):
            entry = self.known.forget(covered)
            self._remove_files(entry.stored.key, entry.seq_name)
        return True

    def snapshot(self) -> dict:
        return {
            "entries": len(self.known.entries),
            "bytes": self.known.bytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "loads_failed": self.loads_failed,
            "writes": self.writes,
            "write_failures": self.write_failures,
            "evictions": self.evictions,
            "skipped": self.skipped,
        }

    # -- writing

    def _already_stored(self, key: str) -> bool:
        """Whether `key` is stored (by this store, or another on the directory: then taken): touched."""
        entry = self.known.entries.get(key)
        meta_path = self.directory / f"{key}.json"
        if entry is not None and meta_path.exists():
            self._touch(entry)
            return True
        self.known.forget(key)  # evicted by another store meanwhile, if it was known
        return self._adopt(meta_path)

    def _adopt(self, meta_path: Path) -> bool:
        """Take the entry whose meta another store published at `meta_path`: whether there is a whole one."""
        try:
            meta = parse_meta(meta_path, meta_path.read_text())
            if meta[META_MARK] != META_FORMAT:
                return False
            nbytes = (self.directory / meta["seq"]).stat().st_size
        except (StateError, OSError, UnicodeDecodeError):
            return False  # none, or not whole: this store writes its own over it
        if nbytes > self.budget_bytes:
            return False
        key = meta_path.name[:64]
        self.known.add(Stored(key, tuple(meta["tokens"]), meta["isolation"], nbytes), meta["seq"])
        self._touch(self.known.entries[key])
        self._evict_to_budget(spare=key)
        return True

    def _write(self, seq_id: int, key: str, tokens: tuple[int, ...], isolation: str) -> bool:
        """Write the seq file, then publish the meta, then evict to the budget: whether it is stored
        (False: no file of it left behind)."""
        tag = _unique_tag()
        seq_name = f"{key}.{tag}.seq"
        seq_path = self.directory / seq_name
        try:
            self.cache.save_seq(seq_id, seq_path)
            nbytes = seq_path.stat().st_size
            if nbytes > self.budget_bytes:  # never kept: it would evict everything and still not fit
                _unlink_quietly(seq_path)
                return False
            meta = {META_MARK: META_FORMAT, "identity": self.identity, "isolation": isolation,
                    "tokens": list(tokens), "seq": seq_name, "nbytes": nbytes}
            published = self._publish(key, tag, meta)
        except (StateError, StepError, OSError) as exc:  # StepError: asked mid-forward, nothing saved
            _unlink_quietly(seq_path)
            self._write_failed(exc)
            return False
        if not published:  # another store published the same entry first: take theirs
            _unlink_quietly(seq_path)
            return self._adopt(self.directory / f"{key}.json")
        self.known.add(Stored(key, tokens, isolation, nbytes), seq_name)
        self.writes += 1
        self._evict_to_budget(spare=key)
        return True

    def _publish(self, key: str, tag: str, meta: dict) -> bool:
        """Write the meta under a temporary name and link it as `<key>.json` (the commit point): False when
        another store's is there already. OSError, the temporary removed, when it cannot be written."""
        tmp = self.directory / f".{key}.{tag}.json.tmp"
        final = self.directory / f"{key}.json"
        try:
            with open(tmp, "wb") as f:
                f.write(_canonical(meta))
                f.flush()
                os.fsync(f.fileno())  # a crash must not publish an empty meta
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                os.replace(tmp, final)  # no hard links here: the last writer wins, the loser's seq an orphan
            return True
        finally:
            _unlink_quietly(tmp)

    def _write_failed(self, exc: BaseException) -> None:
        """Count a failed write; say it once per kind (the OS's errno, or the refusal's type)."""
        self.write_failures += 1
        cause = exc if isinstance(exc, OSError) else exc.__cause__
        kind = errno.errorcode.get(cause.errno, "OSError") if isinstance(cause, OSError) else type(exc).__name__
        if kind in self.warned:
            return
        self.warned.add(kind)
        reason = os_reason(cause) if isinstance(cause, OSError) else one_line(exc)
        self.warn(f"{self.directory}: cannot store a prefix ({reason}); such failures are not said again")

    # -- removing

    def _evict_to_budget(self, spare: str) -> None:
        """Remove least recently used entries other than `spare` until the bytes fit the budget."""
        while self.known.bytes > self.budget_bytes:
            victims = [k for k in self.known.entries if k != spare]
            if not victims:
                return
            entry = self.known.forget(min(victims, key=lambda k: self.known.entries[k].used))
            self._remove_files(entry.stored.key, entry.seq_name)
            self.evictions += 1

    def _remove_files(self, key: str, seq_name: str | None) -> None:
        """Delete entry `key`'s files: its meta first (renamed to a tombstone, so one store alone deletes
        it and the entry is gone at once), then the seq file the meta names. A meta naming another seq file
        than `seq_name` is another store's newer entry: left."""
        meta_path = self.directory / f"{key}.json"
        if seq_name is not None:
            try:
                current = json.loads(meta_path.read_text()).get("seq")
            except (OSError, ValueError, UnicodeDecodeError, AttributeError):
                current = seq_name  # unreadable or gone: nothing newer to spare
            if current != seq_name:  # ours is named by no meta: only it goes
                _unlink_quietly(self.directory / seq_name)
                return
        tomb = self.directory / f".{key}.{_unique_tag()}.gone"
        try:
            os.rename(meta_path, tomb)
        except OSError:  # another store took it, or the meta is gone: its seq file is theirs / an orphan
            if seq_name is not None:
                _unlink_quietly(self.directory / seq_name)
            return
        try:
            named = json.loads(tomb.read_text()).get("seq")
        except (OSError, ValueError, UnicodeDecodeError, AttributeError):
            named = None
        for name in {seq_name, named} - {None}:
            own = isinstance(name, str) and (m := _SEQ_NAME.match(name)) is not None and m.group(1) == key
            if own:  # a damaged meta names no other entry's file
                _unlink_quietly(self.directory / name)
        _unlink_quietly(tomb)

    def _naming(self, path: Path, exc: BaseException) -> str:
        """`exc` in one line, led by `path` unless its message names it already."""
        text = one_line(exc)
        return text if str(path) in text else f"{path}: {text}"


def _unlink_quietly(path: Path) -> None:
    """Remove `path` if there; a refusal is left (the store goes on; the sweep retries at the next start)."""
    try:
        path.unlink()
    except OSError:
        pass
