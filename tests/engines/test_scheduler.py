"""The scheduler's rules (engines.scheduler) against a fake BatchControl: a plain-Python table of
cells and ids, no model and no MLX. Each test states one rule and fails when it is broken: which
request is admitted and how much of its prompt a step takes, which sequence is preempted, when a
kept prefix is reused, which entry is evicted first, and what a spent budget leaves alone.

The tests drive the scheduler as the cell engine does: `declare` a step, then "run" it by writing
the plan's tokens into the fake table (`run_step`), a sequence that completes getting a made-up
next token.
"""

from __future__ import annotations

import pytest

from kvlayout.engines.prefixes import PrefixCache
from kvlayout.engines.records import Request, Stats, make_requests
from kvlayout.engines.scheduler import Scheduler, budget_left
from kvlayout.errors import CapacityError


class FakeTable:
    """The BatchControl face as a plain model: `capacity` cells, each owned by a set of ids at one
    position, and `max_seqs` ids. A declared step needs one free cell per token; nothing is
    placed until `write`. Every verb is logged in `calls`."""

    def __init__(self, capacity: int, max_seqs: int):
        self.capacity, self.max_seqs = capacity, max_seqs
        self.cells: dict[int, list[int | None]] = {}  # live id -> its cell per position
        self.owners: list[set[int]] = [set() for _ in range(capacity)]
        self.declared: list[int] | None = None
        self.calls: list[tuple] = []

    @property
    def free_cells(self) -> int:
        return sum(1 for o in self.owners if not o)

    def declare_step(self, seq_ids) -> bool:
        ids = [int(i) for i in seq_ids]
        self.calls.append(("declare_step", tuple(ids)))
        if len(ids) > self.free_cells:
            return False
        assert all(i in self.cells for i in ids), "declared an id that is not live"
        self.declared = ids
        return True

    def seq_new(self) -> int | None:
        free = [i for i in range(self.max_seqs) if i not in self.cells]
        self.calls.append(("seq_new",))
        if not free:
            return None
        self.cells[free[0]] = []
        self.declared = None
        return free[0]

    def seq_clone(self, src: int, upto: int | None = None) -> int | None:
        self.calls.append(("seq_clone", src, upto))
        free = [i for i in range(self.max_seqs) if i not in self.cells]
        if not free:
            return None
        shared = self.cells[src][: upto if upto is not None else None]
        self.cells[free[0]] = list(shared)
        for c in shared:
            self.owners[c].add(free[0])
        self.declared = None
        return free[0]

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int | None = None) -> None:
        self.calls.append(("seq_rm", seq_id, p0, p1))
        held = self.cells.get(seq_id, [])
        for c in held[p0:p1]:
            self.owners[c].discard(seq_id)
        del held[p0:p1]
        if not held:
            self.cells.pop(seq_id, None)
        self.declared = None

    def next_pos(self, seq_id: int) -> int:
        return len(self.cells.get(seq_id, []))

    def seq_floor(self, seq_id: int) -> int:
        return 0  # no sliding-window layers: any position will do

    def seq_pin(self, seq_id: int, pinned: bool = True) -> None:
        self.calls.append(("seq_pin", seq_id, pinned))

    def cells_by_window(self) -> dict[int, int]:
        return {0: self.capacity - self.free_cells}

    def write(self, seq_id: int, k: int) -> None:
        """The declared step's forward: `k` more positions of `seq_id` in free cells."""
        for _ in range(k):
            c = next(i for i, o in enumerate(self.owners) if not o)
            self.owners[c].add(seq_id)
            self.cells[seq_id].append(c)


def run_step(sched: Scheduler, table: FakeTable, next_token: int = 7) -> list[tuple[int, int]]:
    """One step as the engine takes it: declare, write each sequence's tokens, give each sequence
    whose prompt is in its next token (forking a prefilled prompt first). (request, k) per plan entry."""
    plan = sched.declare(settle=lambda: None)
    assert table.declared == [s.seq_id for s, k in plan for _ in range(k)], "ran a step the table was not told of"
    for s, k in plan:
        table.write(s.seq_id, k)
        s.cached += k
    for s, _ in plan:
        if s.pending == 0:
            for fork in sched.fork(s):
                sched.remember(fork)
                fork.tokens.append(next_token)
    return [(s.request.index, k) for s, k in plan]


def requests(*lengths: int, start: int = 100):
    """One request per prompt length; prompts of distinct tokens unless told otherwise."""
    return make_requests([list(range(start + 10 * i, start + 10 * i + L)) for i, L in enumerate(lengths)],
                         [4] * len(lengths), [1] * len(lengths), 0)


def test_requests_are_admitted_in_order_and_the_prompt_budget_is_shared_oldest_first():
    table = FakeTable(capacity=64, max_seqs=8)
    sched = Scheduler(table, chunk=4, stats=Stats())
    sched.add(requests(6, 3, 2))
    # The first prompt takes the whole budget; the others wait their turn (FIFO, not best fit).
    assert run_step(sched, table) == [(0, 4)]
    assert [w.request.index for w in sched.queue] == [1, 2]
    # Its last 2 tokens, then the next in line takes what is left of the 4.
    assert run_step(sched, table) == [(0, 2), (1, 2)]
    # A decoding sequence costs no budget: request 1 finishes its prompt, request 2 is admitted.
    assert run_step(sched, table) == [(0, 1), (1, 1), (2, 2)]
    assert [s.admitted for s in sched.running] == [0, 1, 2] and not sched.queue


def test_a_spent_budget_admits_nothing_and_evicts_nothing():
    # Two ids: a running sequence and its entry. Admitting the next request would evict the entry
    # for an id; with no prompt budget left it must wait without emptying the cache.
    table = FakeTable(capacity=64, max_seqs=2)
    prefixes = PrefixCache(table, block=2)
    sched = Scheduler(table, chunk=3, stats=Stats(), prefixes=prefixes)
    sched.add(requests(5))
    run_step(sched, table)
    run_step(sched, table)  # its prompt is in, kept as an entry (an id cloned from it)
    assert len(prefixes) == 1 and sched.running[0].pending == 1
    long, = requests(8, start=500)
    long_tokens = list(range(500, 508))
    sched.running[0].tokens += [1, 2, 3]  # three more to feed: the step's whole budget
    sched.add([long])
    kept_calls = len(table.calls)
    plan = sched.declare(settle=lambda: None)
    assert [(s.request.index, k) for s, k in plan] == [(0, 3)] and budget_left(plan, 3) == 0
    assert len(prefixes) == 1 and sched.queue[0].tokens == long_tokens
    assert not [c for c in table.calls[kept_calls:] if c[0] in ("seq_rm", "seq_new", "seq_clone")]


def test_when_cells_run_out_the_latest_admitted_sequence_is_preempted_and_queued_first():
    table = FakeTable(capacity=12, max_seqs=8)
    stats = Stats()
    sched = Scheduler(table, chunk=16, stats=stats)
    sched.add(requests(4, 4, 3))
    run_step(sched, table)  # all three prompts in: 11 cells of 12
    victim = sched.running[-1]
    before = list(victim.tokens)
    # Three decoding tokens need 3 cells, 1 is free: the latest admitted goes back to the queue.
    plan = run_step(sched, table)
    assert stats.preemptions == 1
    assert [r for r, _ in plan] == [0, 1]
    assert sched.queue[0].request is victim.request and sched.queue[0].tokens == before
    assert victim.seq_id not in table.cells  # its cells were freed


def test_the_last_fork_of_a_prompt_is_preempted_before_its_siblings_and_earlier_requests():
    table = FakeTable(capacity=10, max_seqs=8)
    sched = Scheduler(table, chunk=16, stats=Stats())
    sched.add(make_requests([[1, 2, 3], [4, 5, 6]], [4, 4], [1, 3], 0))
    run_step(sched, table)  # two prompts (6 cells); request 1 forks into three sequences sharing its prompt
    r1 = [s for s in sched.running if s.request.index == 1]
    assert len(r1) == 3 and len({s.admitted for s in r1}) == 1
    # The next step takes the last 4 free cells; the one after needs 4 with none free. Each fork
    # preempted frees its own cell only (its prompt's cells are shared): the last fork goes, then
    # the one before it, and request 0, admitted first, runs on with the first fork.
    run_step(sched, table)
    plan = run_step(sched, table)
    assert plan == [(0, 1), (1, 1)] and sched.running[1] is r1[0]
    assert [w.samples for w in sched.queue] == [r1[1].samples, r1[2].samples]  # the last preempted first


def test_a_kept_prefix_is_reused_as_a_clone_and_only_the_rest_is_prefilled():
    table = FakeTable(capacity=64, max_seqs=8)
    prefixes = PrefixCache(table, block=4)
    sched = Scheduler(table, chunk=16, stats=Stats(), prefixes=prefixes)
    system = list(range(900, 908))
    a, b = make_requests([system + [1, 2], system + [3, 4, 5]], [4, 4], [1, 1], 0)
    sched.add([a])
    run_step(sched, table)  # a's prompt (10 tokens) in; 8 of them (two whole blocks) kept
    assert len(prefixes) == 1
    entry = next(iter(prefixes.entries))
    sched.add([b])
    plan = run_step(sched, table)
    assert ("seq_clone", entry, 8) in table.calls
    assert [(r, k) for r, k in plan] == [(0, 1), (1, 3)]  # b feeds only what the entry lacks
    assert b.cached_tokens == 8


def two_sharing_a_prompt(chunk: int) -> tuple[FakeTable, Scheduler, Request, Request]:
    """A scheduler with a prefix cache (blocks of 4) and two requests whose prompts share 12 tokens."""
    table = FakeTable(capacity=64, max_seqs=8)
    sched = Scheduler(table, chunk=chunk, stats=Stats(), prefixes=PrefixCache(table, block=4))
    system = list(range(900, 912))
    a, b = make_requests([system + [1], system + [2]], [4, 4], [1, 1], 0)
    return table, sched, a, b


def test_a_request_sharing_a_prompt_still_prefilling_waits_for_it_then_clones_it():
    table, sched, a, b = two_sharing_a_prompt(chunk=10)
    sched.add([a, b])
    assert run_step(sched, table) == [(0, 10)]
    # Budget is left, but b shares 12 tokens with a, of which 10 are in: b waits, not prefills them.
    assert run_step(sched, table) == [(0, 3)]
    plan = run_step(sched, table)  # a's 12 shared tokens are in: b starts from them
    assert [(r, k) for r, k in plan] == [(0, 1), (1, 1)]
    assert b.cached_tokens == 12


def test_a_running_sequence_short_of_cells_evicts_a_kept_prefix_before_anything_is_preempted():
    table = FakeTable(capacity=10, max_seqs=8)
    prefixes = PrefixCache(table, block=2)
    stats = Stats()
    sched = Scheduler(table, chunk=16, stats=stats, prefixes=prefixes)
    sched.add(requests(4, 4))
    run_step(sched, table)  # 8 cells; both prompts kept as entries
    done, going = sched.running
    sched.finish(done)  # its cells stay, held by its entry alone
    held = len(prefixes)
    for _ in range(4):  # two free cells, then the entry gives its four
        run_step(sched, table)
    assert stats.preemptions == 0 and len(prefixes) < held
    assert sched.running == [going] and going.cached == 8


def test_kept_prefixes_give_way_least_recently_used_first_before_any_preemption():
    table = FakeTable(capacity=24, max_seqs=8)
    prefixes = PrefixCache(table, block=4)
    stats = Stats()
    sched = Scheduler(table, chunk=16, stats=stats, prefixes=prefixes)
    old, new = requests(4, 4, start=700)
    sched.add([old])
    run_step(sched, table)
    sched.add([new])
    run_step(sched, table)
    kept = list(prefixes.entries)  # old's entry first, then new's
    assert len(kept) == 2
    # A prompt of 16 needs 16 + 2 cells with 8 free besides the entries' (none of them shared by
    # a running sequence: the running ones hold 5 cells each, 4 of them shared with their entry).
    sched.add(requests(16, start=100))
    run_step(sched, table)
    assert stats.preemptions == 0
    assert kept[0] not in prefixes.entries, "the least recently used entry was not evicted first"


def test_ids_run_out_before_cells_the_entry_is_evicted_for_the_new_sequence():
    table = FakeTable(capacity=64, max_seqs=2)
    prefixes = PrefixCache(table, block=2)
    stats = Stats()
    sched = Scheduler(table, chunk=16, stats=stats, prefixes=prefixes)
    sched.add(requests(4))
    run_step(sched, table)  # ids: the running sequence and its entry
    assert len(prefixes) == 1
    sched.add(requests(4, start=600))
    plan = run_step(sched, table)
    assert len(prefixes) == 0 and stats.preemptions == 0
    assert [(r, k) for r, k in plan] == [(0, 1), (0, 4)]


def test_nothing_that_can_run_is_a_capacity_error_naming_the_table():
    table = FakeTable(capacity=3, max_seqs=2)
    sched = Scheduler(table, chunk=16, stats=Stats())
    sched.add(requests(5))
    with pytest.raises(CapacityError, match="nothing can run: 1 queued, 3 free cells of 3"):
        sched.declare(settle=lambda: None)
    # Refused: the queue and the table are as they were.
    assert len(sched.queue) == 1 and not sched.running and table.cells == {}


def test_a_cancelled_request_leaves_the_queue_and_the_table_and_the_others_run_on():
    table = FakeTable(capacity=64, max_seqs=8)
    sched = Scheduler(table, chunk=16, stats=Stats())
    reqs = requests(3, 3, 3)
    sched.add(reqs)
    sched.declare(settle=lambda: None)
    sched.add(requests(2, start=800))
    sched.cancel(reqs[1])
    assert [s.request.index for s in sched.running] == [0, 2]
    assert len(table.cells) == 2


def test_max_samples_caps_the_samples_generating_and_the_queue_waits_in_order():
    table = FakeTable(capacity=64, max_seqs=8)
    sched = Scheduler(table, chunk=64, stats=Stats(), max_samples=3)
    reqs = make_requests([[1, 2], [3, 4], [5, 6], [7, 8]], [4] * 4, [2, 2, 1, 1], 0)
    sched.add(reqs)
    # 2 samples, then 2 more would make 4 > 3: request 1 waits, and request 2 (1 sample, which
    # would fit) waits behind it: first come, first served.
    assert run_step(sched, table) == [(0, 2)]
    assert [r.started for r in reqs] == [True, False, False, False]
    sched.finish(sched.running[0])  # one sample of request 0 ends: 1 held
    assert [(r, k) for r, k in run_step(sched, table)] == [(0, 1), (1, 2)]
    assert [r.started for r in reqs] == [True, True, False, False]


def test_a_lone_request_with_more_samples_than_the_cap_still_runs():
    table = FakeTable(capacity=64, max_seqs=8)
    sched = Scheduler(table, chunk=64, stats=Stats(), max_samples=1)
    sched.add(make_requests([[1, 2]], [4], [3], 0))
    assert run_step(sched, table) == [(0, 2)]  # nothing else runs: it is not starved


def owners_shared(table: FakeTable, a: int, b: int) -> list[int]:
    """The cells both `a` and `b` own."""
    return [c for c, o in enumerate(table.owners) if a in o and b in o]


@pytest.mark.parametrize("same_tenant", [True, False])
def test_a_kept_prefix_is_reused_only_by_a_request_of_the_same_isolation_key(same_tenant):
    table = FakeTable(capacity=64, max_seqs=8)
    prefixes = PrefixCache(table, block=4)
    sched = Scheduler(table, chunk=16, stats=Stats(), prefixes=prefixes)
    system = list(range(900, 908))
    a, b = make_requests([system + [1, 2], system + [3, 4, 5]], [4, 4], [1, 1], 0)
    a.isolation = "tenant-a"
    b.isolation = "tenant-a" if same_tenant else "tenant-b"
    sched.add([a])
    run_step(sched, table)  # a's prompt in; 8 of its tokens kept, as tenant-a's
    entry = next(iter(prefixes.entries))
    sched.add([b])
    plan = run_step(sched, table)
    b_id = next(s.seq_id for s in sched.running if s.request is b)
    if same_tenant:
        assert plan == [(0, 1), (1, 3)] and b.cached_tokens == 8
        assert len(owners_shared(table, entry, b_id)) == 8
    else:  # b prefills all of its prompt in cells of its own
        assert plan == [(0, 1), (1, 11)] and b.cached_tokens == 0
        assert not any(call[0] == "seq_clone" and call[1] == entry for call in table.calls)
        assert owners_shared(table, entry, b_id) == []


def test_a_prompt_still_prefilling_is_cloned_only_by_a_request_of_the_same_isolation_key():
    table, sched, a, b = two_sharing_a_prompt(chunk=26)
    a.isolation, b.isolation = "tenant-a", "tenant-b"
    sched.add([a, b])
    # Sharing 12 tokens with a, b of another tenant neither waits for a's prefill nor clones it.
    assert run_step(sched, table) == [(0, 13), (1, 13)]
    assert b.cached_tokens == 0
    a_id, b_id = (next(s.seq_id for s in sched.running if s.request is r) for r in (a, b))
    assert owners_shared(table, a_id, b_id) == []
