"""The experience buffer's book: which groups are live, which are due, and which form the next batch.

Pure and deterministic. Every rank keeps an identical book, changed only by calls all ranks make with
the same arguments (dispatches decided at collective points, group status agreed by one all-reduce),
so all ranks take the same groups for every batch without any rank deciding for the others.

Words (B = `groups_per_batch`, n samples per group, k = `max_staleness`, and v = the policy version
that trains the batch, i.e. the optimizer steps taken before it: step v + 1):

* a *group* is one prompt's n samples; *gid* numbers groups in dispatch order;
* a *round* is one loader batch (B prompts) dispatched together: *regular* rounds keep the pipeline
  full, *refill* rounds replace groups that dynamic sampling dropped;
* a group's *start version* is the policy version on the servers when it was dispatched; samples sent
  again (after a failed request, or a resume) keep it, so it bounds them conservatively; start versions
  never decrease with gid;
* *live*: dispatched, neither trained nor dropped; *resolved*: all n samples finished and scored; *kept*:
  dynamic sampling found signal in it (always, without dynamic sampling);
* *due* at v: `start <= v - k`: batch v is the last it may join (staleness = v - start <= k).

Rules:

1. Regular rounds are dispatched (after the weights of v reached the servers) while
   `live + B <= (k + 1) * B`: the pipeline holds k + 1 batches, so a group started now is due in k
   steps, when no more than k batches of older groups stand before it.
2. A refill round is dispatched when even every unresolved live group would not complete the batch
   (`kept + unresolved < B`) and refills are left (`algorithm.max_sampling_rounds - 1` per batch).
3. The batch is the B kept resolved groups with the lowest gids (the oldest), or, when nothing is
   unresolved and no refill is left, all kept ones; it is taken once what it leaves behind can still
   be trained in time: no due group left, and for h = 1..k no more than h * B left that are due within
   h steps (earliest deadline first; without this, batches taking young groups that finished first
   would leave more old ones than the next batches can hold). Until then it waits for older groups.
   Due groups left out are dropped as stale: only the extra groups of refill rounds can be, since
   rule 1 and the check above leave room for all others.

With k = 0 this is the synchronous loop exactly: one round per step, every group due, the batch its kept
groups in dispatch order, and refill rounds with the seeds the synchronous rounds use. With k > 0 the
batch takes groups as they finish (out of order), waiting only for due stragglers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybrid_rl.data import PromptRecord


def refill_seeds(step: int, refill: int) -> tuple[int, int]:
    """(seed step, group base) of dynamic sampling's refill round `refill` (1, 2, ...) for the batch of `step`: the
    synchronous loop's and the buffer's, which must agree for `max_staleness = 0` to be the synchronous run."""
    return step * 1000 + refill, refill * 10**6


@dataclass(frozen=True)
class Group:
    """One dispatched prompt: what its samples are generated from, and where it stands (agreed on every rank)."""

    gid: int
    record: PromptRecord
    seed_step: int  # request_seed(seed, seed_step, seed_group) + j is sample j's seed, as the synchronous loop's
    seed_group: int
    slot: int  # its place in its round: sample j is generated and held by rank (slot * n + j) % world
    start_version: int
    resolved: bool = False
    kept: bool = True


@dataclass(frozen=True)
class Plan:
    """What the buffer does next for the batch of version v."""

    refill: bool = False  # dispatch a refill round first
    take: tuple[int, ...] | None = None  # the batch's gids in order (None: wait for more groups)
    drop: tuple[int, ...] = ()  # due groups left out: dropped as stale


@dataclass
class Book:
    """The live groups and the dispatch counters; identical on every rank."""

    groups_per_batch: int
    max_staleness: int
    max_refills: int  # refill rounds allowed per batch (0 without dynamic sampling)
    live: dict[int, Group] = field(default_factory=dict)  # by gid, in dispatch order
    next_gid: int = 0
    regular_rounds: int = 0
    refills: int = 0  # refill rounds dispatched for the batch being formed

    # -- dispatch --------------------------------------------------------------------------------

    def regular_room(self) -> bool:
        """Rule 1: a regular round fits in the pipeline."""
        return len(self.live) + self.groups_per_batch <= (self.max_staleness + 1) * self.groups_per_batch

    def add_round(self, records: list[PromptRecord], *, version: int, step: int, refill: bool) -> list[Group]:
        """Book one round of `records`, dispatched at policy `version` (for the batch of `step` when a refill)."""
        if refill:
            self.refills += 1
            seed_step, base = refill_seeds(step, self.refills)
        else:
            self.regular_rounds += 1
            seed_step, base = self.regular_rounds, 0
        groups = [Group(self.next_gid + i, r, seed_step, base + i, i, version) for i, r in enumerate(records)]
        self.next_gid += len(groups)
        self.live.update((g.gid, g) for g in groups)
        return groups

    # -- status and the batch --------------------------------------------------------------------

    def resolve(self, gid: int, *, kept: bool) -> None:
        self.live[gid] = replace(self.live[gid], resolved=True, kept=kept)

    def drop_unkept(self) -> list[int]:
        """Resolved groups dynamic sampling did not keep leave the book."""
        gone = [g.gid for g in self.live.values() if g.resolved and not g.kept]
        for gid in gone:
            del self.live[gid]
        return gone

    def plan(self, version: int) -> Plan:
        """Rules 2 and 3 for the batch trained at policy `version`."""
        size, groups = self.groups_per_batch, list(self.live.values())
        kept = [g.gid for g in groups if g.resolved and g.kept]
        unresolved = [g for g in groups if not g.resolved]
        if len(kept) + len(unresolved) < size and self.refills < self.max_refills:
            return Plan(refill=True)
        if len(kept) >= size:
            take = tuple(kept[:size])
        elif not unresolved:
            take = tuple(kept)
        else:
            return Plan()
        taken = set(take)
        for h in range(self.max_staleness + 1):  # what stays must fit the next h batches before its deadline
            left = [g for g in groups if g.start_version <= version + h - self.max_staleness and g.gid not in taken]
            if unresolved and (len(left) > h * size or (h == 0 and any(not g.resolved for g in left))):
                return Plan()  # wait for older groups rather than leave more than the pipeline can still train
        due = version - self.max_staleness
        return Plan(take=take, drop=tuple(g.gid for g in groups if g.start_version <= due and g.gid not in taken))

    def consume(self, plan: Plan) -> None:
        """The batch leaves the book, with the groups it dropped; the next batch starts its own refills."""
        for gid in (*(plan.take or ()), *plan.drop):
            del self.live[gid]
        self.refills = 0

    # -- checkpoint ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"groups_per_batch": self.groups_per_batch, "max_staleness": self.max_staleness,
                "next_gid": self.next_gid, "regular_rounds": self.regular_rounds, "refills": self.refills,
                "live": [(g.gid, g.record, g.seed_step, g.seed_group, g.slot, g.start_version)
                         for g in self.live.values()]}

    def load_state_dict(self, state: dict) -> None:
        """Resume the book; groups come back unresolved (their finished samples are scored again)."""
        if state["groups_per_batch"] != self.groups_per_batch:
            raise ValueError(f"the checkpoint's experience buffer was filled with {state['groups_per_batch']} prompts "
                             f"per batch, this run takes {self.groups_per_batch}: resume with the same "
                             "data.prompts_per_step")
        self.next_gid, self.regular_rounds, self.refills = state["next_gid"], state["regular_rounds"], state["refills"]
        self.live = {row[0]: Group(*row) for row in state["live"]}
