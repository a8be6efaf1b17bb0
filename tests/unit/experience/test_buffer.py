"""The experience buffer's book: dispatch, bounded staleness, out-of-order batches, refills, checkpoint state."""

import random

import pytest

from hybrid_rl.data import PromptRecord
from hybrid_rl.experience.buffer import Book


def _records(start: int, count: int) -> list[PromptRecord]:
    return [PromptRecord(i, f"p{i}", (i,), {}) for i in range(start, start + count)]


class Loader:
    def __init__(self, size: int):
        self.size, self.next = size, 0

    def __call__(self) -> list[PromptRecord]:
        out = _records(self.next, self.size)
        self.next += self.size
        return out


def _fill(book: Book, loader: Loader, version: int) -> None:
    while book.regular_room():
        book.add_round(loader(), version=version, step=version + 1, refill=False)


def test_staleness_zero_is_the_synchronous_loop():
    book, loader = Book(3, 0, 0), Loader(3)
    for v in range(3):
        _fill(book, loader, v)
        assert [g.record.index for g in book.live.values()] == [3 * v, 3 * v + 1, 3 * v + 2]  # one round per step
        assert [(g.seed_step, g.seed_group) for g in book.live.values()] == [(v + 1, 0), (v + 1, 1), (v + 1, 2)]
        for gid in reversed(list(book.live)[1:]):
            book.resolve(gid, kept=True)
            assert book.plan(v).take is None  # every group is due: wait for the last one
        book.resolve(next(iter(book.live)), kept=True)
        plan = book.plan(v)
        assert plan.take == (3 * v, 3 * v + 1, 3 * v + 2) and plan.drop == ()
        book.consume(plan)
        assert not book.live


def test_one_step_off_takes_finished_groups_out_of_order_but_waits_for_due_ones():
    book, loader = Book(2, 1, 0), Loader(2)
    _fill(book, loader, 0)
    assert list(book.live) == [0, 1, 2, 3]  # two batches in flight
    book.resolve(3, kept=True)
    book.resolve(2, kept=True)
    assert book.plan(0).take == (2, 3)  # started at v0, due at v1: the batch need not wait for 0 and 1
    book.consume(book.plan(0))
    _fill(book, loader, 1)
    assert list(book.live) == [0, 1, 4, 5]
    book.resolve(4, kept=True)
    book.resolve(5, kept=True)
    book.resolve(0, kept=True)
    assert book.plan(1).take is None  # 1 is due (started at v0, trained at v1): it must wait for it
    book.resolve(1, kept=True)
    assert book.plan(1).take == (0, 1)  # the oldest first
    book.consume(book.plan(1))
    assert list(book.live) == [4, 5]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_random_finish_orders_never_exceed_the_staleness_and_train_every_group_once(k):
    rng, size = random.Random(k), 4
    book, loader = Book(size, k, 0), Loader(size)
    trained, start = [], {}
    for v in range(40):
        _fill(book, loader, v)
        start.update((g.gid, g.start_version) for g in book.live.values())
        while (plan := book.plan(v)).take is None:
            book.resolve(rng.choice([g.gid for g in book.live.values() if not g.resolved]), kept=True)
        assert len(plan.take) == size and plan.drop == ()
        assert all(v - start[gid] <= k for gid in plan.take)
        trained += plan.take
        book.consume(plan)
        assert len(book.live) <= k * size
    assert sorted(trained) == list(range(len(trained)))  # each once; the rest are still live
    assert set(trained) | set(book.live) == set(range(loader.next))


def test_dynamic_sampling_refills_with_the_synchronous_rounds_seeds_and_drops_extra_due_groups():
    book, loader = Book(3, 0, 2), Loader(3)
    _fill(book, loader, 4)  # step 5
    book.resolve(0, kept=False)
    assert book.plan(4).take is None  # 2 kept at most of 3: wait, 1 and 2 may still have signal
    book.resolve(1, kept=False)
    assert book.plan(4).refill
    refill = book.add_round(loader(), version=4, step=5, refill=True)
    assert [(g.seed_step, g.seed_group) for g in refill] == [(5001, 10**6), (5001, 10**6 + 1), (5001, 10**6 + 2)]
    assert book.drop_unkept() == [0, 1]
    for gid in (2, 3, 4, 5):
        book.resolve(gid, kept=True)
    plan = book.plan(4)
    assert plan.take == (2, 3, 4) and plan.drop == (5,)  # as the synchronous merge keeps the first groups only
    book.consume(plan)
    assert not book.live and book.refills == 0


def test_when_refills_run_out_the_batch_is_what_was_kept():
    book, loader = Book(2, 0, 1), Loader(2)
    _fill(book, loader, 0)
    book.resolve(0, kept=False)
    book.resolve(1, kept=True)
    book.drop_unkept()
    assert book.plan(0).refill
    book.add_round(loader(), version=0, step=1, refill=True)
    book.resolve(2, kept=False)
    book.resolve(3, kept=False)
    book.drop_unkept()
    assert book.plan(0).take == (1,)
    book.consume(book.plan(0))
    _fill(book, loader, 1)
    for gid in list(book.live):
        book.resolve(gid, kept=False)
    book.drop_unkept()
    book.add_round(loader(), version=1, step=2, refill=True)
    for gid in list(book.live):
        book.resolve(gid, kept=False)
    book.drop_unkept()
    assert book.plan(1).take == ()  # nothing kept: the source raises


def test_the_state_round_trips_and_refuses_another_batch_size():
    book, loader = Book(2, 1, 0), Loader(2)
    _fill(book, loader, 0)
    book.resolve(1, kept=True)
    again = Book(2, 1, 0)
    again.load_state_dict(book.state_dict())
    assert [(g.gid, g.record, g.seed_step, g.slot, g.start_version) for g in again.live.values()] == \
        [(g.gid, g.record, g.seed_step, g.slot, g.start_version) for g in book.live.values()]
    assert not any(g.resolved for g in again.live.values())  # scored again after a resume
    assert (again.next_gid, again.regular_rounds) == (4, 2)
    with pytest.raises(ValueError, match="filled with 2 prompts per batch, this run takes 3"):
        Book(3, 1, 0).load_state_dict(book.state_dict())
