"""Tests for grpo_fleet.learner.records.lease_book.PromptScheduler, on an injected fake clock."""

from __future__ import annotations

from collections import Counter

import pytest

from grpo_fleet.learner.records.lease_book import UNSCORED_RETURNS, PromptScheduler
from grpo_fleet.protocol.reasons import RejectReason

LEASE_SECONDS = 10.0


@pytest.fixture
def make_scheduler(clock):
    def make(num_prompts: int = 10, seed: int = 0) -> PromptScheduler:
        return PromptScheduler(num_prompts, seed=seed, lease_seconds=LEASE_SECONDS, clock=clock)

    return make


def ids_of(lease) -> list[str]:
    return list(lease.tickets)


def test_empty_dataset_is_rejected():
    with pytest.raises(ValueError, match="no prompts"):
        PromptScheduler(0, seed=0, lease_seconds=1.0)


def test_issue_gives_the_requested_number_of_groups_with_a_deadline(make_scheduler, clock):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 3)
    assert lease is not None
    assert len(lease.tickets) == 3
    assert lease.actor == "actor-a"
    assert lease.deadline == pytest.approx(clock.now + LEASE_SECONDS)
    assert scheduler.ledger.leases[lease.lease_id] is lease
    assert all(0 <= t.prompt_index < 10 for t in lease.tickets.values())


def test_issue_of_zero_groups_returns_none_and_changes_nothing(make_scheduler):
    scheduler = make_scheduler()
    assert scheduler.issue("actor-a", 0) is None
    assert scheduler.outstanding_groups == 0
    assert scheduler.ledger.leases == {}


def test_group_ids_are_unique_across_many_leases(make_scheduler):
    scheduler = make_scheduler(num_prompts=5)
    seen: list[str] = []
    for i in range(12):  # spans several epochs of the 5-prompt dataset
        seen.extend(ids_of(scheduler.issue(f"actor-{i % 3}", 3)))
    assert len(seen) == 36
    assert len(set(seen)) == len(seen)


def test_lease_ids_are_unique(make_scheduler):
    scheduler = make_scheduler()
    lease_ids = {scheduler.issue("actor-a", 1).lease_id for _ in range(20)}
    assert len(lease_ids) == 20


def test_requeued_groups_are_leased_first_with_the_same_ids_and_prompts(make_scheduler):
    scheduler = make_scheduler()
    first = scheduler.issue("actor-a", 2)
    original = dict(first.tickets)
    scheduler.release(first.lease_id)
    assert {t.group_id for t in scheduler.queue.tickets} == set(original)

    second = scheduler.issue("actor-b", 3)
    tickets = list(second.tickets.values())
    # The two re-queued groups come first, under their original ids and prompts.
    assert [t.group_id for t in tickets[:2]] == list(original)
    for ticket in tickets[:2]:
        assert original[ticket.group_id] == ticket
    # The third one is fresh.
    assert tickets[2].group_id not in original
    assert scheduler.queue.tickets == []


def test_requeue_puts_one_group_back_and_keeps_the_rest_of_the_lease(make_scheduler):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 3)
    gid = ids_of(lease)[1]
    ticket = scheduler.requeue(lease.lease_id, gid)
    assert ticket.group_id == gid
    assert scheduler.queue.tickets == [ticket]
    assert scheduler.outstanding_groups == 2
    assert gid not in scheduler.ledger.leases[lease.lease_id].tickets
    assert scheduler.classify("actor-a", lease.lease_id, gid) is RejectReason.NOT_LEASED


def test_expire_does_nothing_before_the_deadline(make_scheduler, clock):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 2)
    clock.advance(LEASE_SECONDS - 0.001)
    assert scheduler.expire() == []
    assert lease.lease_id in scheduler.ledger.leases
    assert scheduler.outstanding_groups == 2
    assert scheduler.queue.tickets == []


def test_expire_requeues_at_the_deadline(make_scheduler, clock):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 2)
    gids = ids_of(lease)
    clock.advance(LEASE_SECONDS)
    expired = scheduler.expire()
    assert [e.lease_id for e in expired] == [lease.lease_id]
    assert lease.lease_id not in scheduler.ledger.leases
    assert scheduler.outstanding_groups == 0
    assert [t.group_id for t in scheduler.queue.tickets] == gids
    # The next lease re-issues them under the same ids.
    assert ids_of(scheduler.issue("actor-b", 2)) == gids


def test_expire_only_touches_leases_past_their_own_deadline(make_scheduler, clock):
    scheduler = make_scheduler()
    old = scheduler.issue("actor-a", 1)
    clock.advance(LEASE_SECONDS / 2)
    young = scheduler.issue("actor-b", 1)
    clock.advance(LEASE_SECONDS / 2)
    expired = scheduler.expire()
    assert [e.lease_id for e in expired] == [old.lease_id]
    assert young.lease_id in scheduler.ledger.leases
    assert scheduler.outstanding_groups == 1


def test_classify_finds_nothing_wrong_for_the_holder_of_a_live_lease(make_scheduler):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 2)
    for gid in lease.tickets:
        assert scheduler.classify("actor-a", lease.lease_id, gid) is None


def test_classify_duplicate_after_finish(make_scheduler):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 2)
    gid = ids_of(lease)[0]
    scheduler.finish(lease.lease_id, gid)
    assert scheduler.classify("actor-a", lease.lease_id, gid) is RejectReason.DUPLICATE
    # Duplicate wins over every other reason, whoever asks under whatever lease.
    assert scheduler.classify("actor-b", "no-such-lease", gid) is RejectReason.DUPLICATE


def test_classify_stale_lease_for_unknown_or_forgotten_lease(make_scheduler, clock):
    scheduler = make_scheduler()
    scheduler.ledger.late.capacity = 1
    lease = scheduler.issue("actor-a", 1)
    gid = ids_of(lease)[0]
    assert scheduler.classify("actor-a", "no-such-lease", gid) is RejectReason.STALE_LEASE
    clock.advance(LEASE_SECONDS + 1)
    scheduler.expire()
    assert scheduler.classify("actor-a", lease.lease_id, gid) is None, "expired lately: still remembered"
    scheduler.issue("actor-b", 1)
    clock.advance(LEASE_SECONDS + 1)
    scheduler.expire()  # a newer expired lease pushes the first out of a memory of one
    assert len(scheduler.ledger.late) == 1
    assert scheduler.classify("actor-a", lease.lease_id, gid) is RejectReason.STALE_LEASE


# ---------------------------------------------------------------- late results (issue 38: long answers)


def _expired(scheduler: PromptScheduler, clock, actor: str = "actor-a", groups: int = 2):
    lease = scheduler.issue(actor, groups)
    ids = ids_of(lease)
    clock.advance(LEASE_SECONDS + 1)
    assert scheduler.expire() and scheduler.ledger.is_late(lease.lease_id)
    return scheduler.ledger.late.get(lease.lease_id), ids


def test_a_late_result_for_a_queued_group_takes_it_out_of_the_queue_once(make_scheduler, clock):
    scheduler = make_scheduler()
    lease, (first, second) = _expired(scheduler, clock)
    assert [t.group_id for t in scheduler.queue.tickets] == [first, second]
    assert scheduler.leased_prompt(lease.lease_id, first) == lease.tickets[first].prompt_index
    scheduler.finish(lease.lease_id, first)
    assert [t.group_id for t in scheduler.queue.tickets] == [second], "never handed out again"
    assert first in scheduler.finished and second not in scheduler.finished
    assert scheduler.classify("actor-a", lease.lease_id, first) is RejectReason.DUPLICATE
    assert scheduler.classify("actor-a", lease.lease_id, second) is None
    again = scheduler.issue("actor-b", 2)
    assert first not in again.tickets and second in again.tickets


def test_a_late_result_names_only_its_senders_groups(make_scheduler, clock):
    scheduler = make_scheduler()
    lease, (first, _) = _expired(scheduler, clock)
    fresh = ids_of(scheduler.issue("actor-a", 3))[-1]  # the two re-queued groups, then a fresh one
    assert scheduler.classify("actor-b", lease.lease_id, first) is RejectReason.NOT_YOUR_LEASE
    assert scheduler.classify("actor-a", lease.lease_id, fresh) is RejectReason.NOT_LEASED


def test_the_first_result_for_a_re_leased_group_wins_the_other_is_a_duplicate(make_scheduler, clock):
    scheduler = make_scheduler()
    late, (first, second) = _expired(scheduler, clock)
    again = scheduler.issue("actor-b", 2)  # both groups out again, to someone else
    assert set(again.tickets) == {first, second}
    scheduler.finish(late.lease_id, first)  # the late result arrives first: it wins
    assert list(again.tickets) == [second] and scheduler.outstanding_groups == 1
    assert scheduler.classify("actor-b", again.lease_id, first) is RejectReason.DUPLICATE
    scheduler.finish(again.lease_id, second)  # here the new holder is first
    assert scheduler.classify("actor-a", late.lease_id, second) is RejectReason.DUPLICATE
    assert again.lease_id not in scheduler.ledger.leases and len(scheduler.ledger.late) == 1
    assert scheduler.outstanding_groups == 0 and scheduler.queue.tickets == []


def test_a_late_group_refused_stays_where_it_is_and_its_ticket_is_spent(make_scheduler, clock):
    scheduler = make_scheduler()
    late, (first, second) = _expired(scheduler, clock)
    scheduler.requeue(late.lease_id, first, not_to="actor-a")  # e.g. its version was too old
    assert [t.group_id for t in scheduler.queue.tickets] == [first, second], "queued once, not twice"
    assert scheduler.classify("actor-a", late.lease_id, first) is RejectReason.NOT_LEASED
    assert ids_of(scheduler.issue("actor-a", 1)) == [second], "not back to the actor whose fault it was"
    scheduler.requeue(late.lease_id, second)  # out again under actor-a's new lease: it stays there
    assert scheduler.outstanding_groups == 1 and len(scheduler.ledger.late) == 0


def test_a_dropped_actors_lease_is_remembered_too(make_scheduler):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 2)
    ids = ids_of(lease)
    assert scheduler.release_actor("actor-a") == 1 and scheduler.outstanding_groups == 0
    assert [scheduler.classify("actor-a", lease.lease_id, gid) for gid in ids] == [None, None]


def test_late_leases_survive_a_resume(make_scheduler, clock):
    scheduler = make_scheduler()
    late, (first, second) = _expired(scheduler, clock)
    resumed = make_scheduler()
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.classify("actor-a", late.lease_id, first) is None
    resumed.finish(late.lease_id, first)
    assert [t.group_id for t in resumed.queue.tickets] == [second] and first in resumed.finished
    older = {k: v for k, v in scheduler.state_dict().items() if k != "late"}  # a checkpoint from before
    resumed.load_state_dict(older)
    assert resumed.classify("actor-a", late.lease_id, first) is RejectReason.STALE_LEASE


def test_classify_not_your_lease_for_another_actor(make_scheduler):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 1)
    gid = ids_of(lease)[0]
    assert scheduler.classify("actor-b", lease.lease_id, gid) is RejectReason.NOT_YOUR_LEASE


def test_classify_not_leased_for_a_group_outside_the_lease(make_scheduler):
    scheduler = make_scheduler()
    mine = scheduler.issue("actor-a", 1)
    other = scheduler.issue("actor-a", 1)
    other_gid = ids_of(other)[0]
    assert scheduler.classify("actor-a", mine.lease_id, other_gid) is RejectReason.NOT_LEASED
    assert scheduler.classify("actor-a", mine.lease_id, "g-made-up") is RejectReason.NOT_LEASED


def test_finish_removes_a_group_forever(make_scheduler, clock):
    scheduler = make_scheduler(num_prompts=3)
    lease = scheduler.issue("actor-a", 2)
    done, pending = ids_of(lease)
    ticket = scheduler.finish(lease.lease_id, done)
    assert ticket.group_id == done
    assert done in scheduler.finished
    assert scheduler.outstanding_groups == 1

    # Expiry and actor loss re-queue only what is still out.
    clock.advance(LEASE_SECONDS)
    scheduler.expire()
    assert [t.group_id for t in scheduler.queue.tickets] == [pending]
    assert scheduler.release_actor("actor-a") == 0

    reissued = []
    for _ in range(10):
        reissued.extend(ids_of(scheduler.issue("actor-b", 3)))
    assert done not in reissued
    assert pending in reissued


def test_finishing_every_group_of_a_lease_closes_it(make_scheduler):
    scheduler = make_scheduler()
    lease = scheduler.issue("actor-a", 2)
    for gid in ids_of(lease):
        scheduler.finish(lease.lease_id, gid)
    assert lease.lease_id not in scheduler.ledger.leases
    assert scheduler.outstanding_groups == 0
    assert scheduler.queue.tickets == []


def test_release_of_unknown_lease_is_a_no_op(make_scheduler):
    scheduler = make_scheduler()
    scheduler.issue("actor-a", 2)
    scheduler.release("no-such-lease")
    assert scheduler.outstanding_groups == 2
    assert scheduler.queue.tickets == []


def test_release_actor_requeues_only_that_actors_leases(make_scheduler):
    scheduler = make_scheduler()
    a1 = scheduler.issue("actor-a", 2)
    b1 = scheduler.issue("actor-b", 1)
    a2 = scheduler.issue("actor-a", 1)
    actor_a_groups = set(ids_of(a1)) | set(ids_of(a2))  # captured: release empties the records

    assert scheduler.release_actor("actor-a") == 2
    assert set(scheduler.ledger.leases) == {b1.lease_id}
    assert {t.group_id for t in scheduler.queue.tickets} == actor_a_groups
    assert scheduler.outstanding_groups == 1
    assert scheduler.classify("actor-b", b1.lease_id, ids_of(b1)[0]) is None
    assert scheduler.release_actor("actor-nobody") == 0


def test_each_epoch_covers_every_prompt_exactly_once(make_scheduler):
    num_prompts = 7
    scheduler = make_scheduler(num_prompts=num_prompts, seed=3)
    indices: list[int] = []
    for _ in range(3 * num_prompts):
        lease = scheduler.issue("actor-a", 1)
        indices.extend(t.prompt_index for t in lease.tickets.values())
    for epoch in range(3):
        chunk = indices[epoch * num_prompts : (epoch + 1) * num_prompts]
        assert sorted(chunk) == list(range(num_prompts)), f"epoch {epoch}: {chunk}"
    assert scheduler.queue.epoch == 3


def test_epochs_are_shuffled_by_seed(make_scheduler):
    def order(seed: int) -> list[int]:
        scheduler = make_scheduler(num_prompts=20, seed=seed)
        return [t.prompt_index for t in scheduler.issue("actor-a", 20).tickets.values()]

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert order(1) != list(range(20))


def test_a_resumed_scheduler_continues_the_same_shuffled_order_mid_epoch(make_scheduler):
    """The order survives a checkpoint (state_dict through msgpack, as persistence.py writes it) exactly."""
    import msgpack

    def prompts(scheduler, count: int) -> list[int]:
        return [t.prompt_index for t in scheduler.issue("actor-a", count).tickets.values()]

    uninterrupted = make_scheduler(num_prompts=7, seed=5)
    expected = prompts(uninterrupted, 30)  # four epochs and a bit

    first_life = make_scheduler(num_prompts=7, seed=5)
    before = prompts(first_life, 10)  # stops in the second epoch
    saved = msgpack.unpackb(msgpack.packb(first_life.state_dict(), use_bin_type=True), raw=False)
    second_life = make_scheduler(num_prompts=7, seed=99)  # the seed a new life is built with does not matter
    second_life.load_state_dict(saved)
    assert before + prompts(second_life, 20) == expected
    assert second_life.queue.epoch == uninterrupted.queue.epoch == 5
    assert expected[7:14] != expected[:7]  # every epoch is reshuffled


def test_requeued_groups_do_not_consume_the_fresh_epoch(make_scheduler):
    num_prompts = 4
    scheduler = make_scheduler(num_prompts=num_prompts)
    lease = scheduler.issue("actor-a", 2)
    scheduler.release(lease.lease_id)
    # 2 re-queued + the remaining 2 fresh prompts make one full epoch.
    nxt = scheduler.issue("actor-a", 4)
    counts = Counter(t.prompt_index for t in nxt.tickets.values())
    assert sorted(counts) == list(range(num_prompts))
    assert set(counts.values()) == {1}
    assert scheduler.queue.epoch == 1


def test_outstanding_groups_counts_through_the_lifecycle(make_scheduler, clock):
    scheduler = make_scheduler()
    assert scheduler.outstanding_groups == 0
    a = scheduler.issue("actor-a", 3)
    b = scheduler.issue("actor-b", 2)
    a_ids = ids_of(a)
    assert scheduler.outstanding_groups == 5
    scheduler.finish(a.lease_id, a_ids[0])
    assert scheduler.outstanding_groups == 4
    scheduler.requeue(a.lease_id, a_ids[1])
    assert scheduler.outstanding_groups == 3
    scheduler.release_actor("actor-b")
    assert scheduler.outstanding_groups == 1
    clock.advance(LEASE_SECONDS)
    scheduler.expire()
    assert scheduler.outstanding_groups == 0
    assert len(scheduler.queue.tickets) == 4
    scheduler.issue("actor-c", 4)
    assert scheduler.outstanding_groups == 4
    assert scheduler.queue.tickets == []
    assert b.lease_id not in scheduler.ledger.leases


def _finish_all(scheduler: PromptScheduler, groups: int) -> list[str]:
    done = []
    while len(done) < groups:
        lease = scheduler.issue("actor-a", 4)
        for group_id in list(lease.tickets):
            scheduler.finish(lease.lease_id, group_id)
            done.append(group_id)
    return done


def test_the_checkpointed_scheduler_does_not_grow_with_the_groups_accepted(make_scheduler):
    """Issue 29: every accepted id was kept, and sorted and copied at every checkpoint."""
    short, long = make_scheduler(num_prompts=50), make_scheduler(num_prompts=50)
    _finish_all(short, 40)
    _finish_all(long, 4000)
    held = long.issue("actor-a", 2)  # a lease still out is kept, as before
    sizes = [len(repr(scheduler.state_dict())) for scheduler in (short, long)]
    assert sizes[1] - sizes[0] < 400, f"the state grew with the run: {sizes}"
    assert len(long.finished) == 4000 and set(held.tickets).isdisjoint(long.finished)


def test_duplicates_are_refused_across_a_resume_without_a_finished_list(make_scheduler):
    scheduler = make_scheduler(num_prompts=5)
    done = _finish_all(scheduler, 12)
    open_lease = scheduler.issue("actor-a", 3)
    leased = list(open_lease.tickets)
    scheduler.finish(open_lease.lease_id, leased[0])
    scheduler.release(open_lease.lease_id)  # the other two go back in the queue
    resumed = make_scheduler(num_prompts=5)
    resumed.load_state_dict(scheduler.state_dict())
    for group_id in done + leased[:1]:
        assert resumed.classify("actor-a", open_lease.lease_id, group_id) is RejectReason.DUPLICATE
    assert not any(group_id in resumed.finished for group_id in leased[1:])  # queued again, not finished
    again = resumed.issue("actor-b", 2)
    assert sorted(again.tickets) == sorted(leased[1:])
    assert resumed.classify("actor-b", again.lease_id, leased[1]) is None
    # Ids never handed out, or not in the canonical form, are not finished either.
    for made_up in ("g99999999", "g0000001", "g-made-up", "g00000001 ", "gx"):
        assert made_up not in resumed.finished


def test_a_checkpoint_that_still_lists_finished_ids_resumes(make_scheduler):
    scheduler = make_scheduler(num_prompts=5)
    done = _finish_all(scheduler, 8)
    saved = scheduler.state_dict() | {"finished": sorted(done)}  # what older checkpoints hold
    resumed = make_scheduler(num_prompts=5)
    resumed.load_state_dict(saved)
    assert resumed.finished == set(done)


def _return_unscored(scheduler: PromptScheduler, key: str, live_keys: int) -> tuple[str, bool]:
    lease = scheduler.issue(key, 1)
    (group_id,) = lease.tickets
    return group_id, scheduler.return_unscored(lease.lease_id, group_id, key, live_keys)


def test_a_group_returned_unscored_goes_to_another_key_and_one_key_can_skip_nothing(make_scheduler):
    """Issue 39 item 2: returning the same prompt unscored three times skipped it for the pass, so one actor chose
    which prompts were trained."""
    scheduler = make_scheduler()
    returned, skipped = _return_unscored(scheduler, "hostile", live_keys=2)
    assert not skipped and [t.group_id for t in scheduler.queue.tickets] == [returned]
    for _ in range(2 * UNSCORED_RETURNS):  # it asks again and again: never that group again
        group_id, skipped = _return_unscored(scheduler, "hostile", live_keys=2)
        assert group_id != returned and not skipped
    assert returned in ids_of(scheduler.issue("honest", 1)), "re-leased to a different key"


def test_a_prompt_is_skipped_only_after_unscored_returns_from_two_keys(make_scheduler):
    scheduler = make_scheduler()
    group_id, _ = _return_unscored(scheduler, "a", live_keys=2)
    lease = scheduler.issue("b", 1)
    assert ids_of(lease) == [group_id]
    assert not scheduler.return_unscored(lease.lease_id, group_id, "b", live_keys=2)
    lease = scheduler.issue("a", 1)
    assert ids_of(lease) == [group_id]
    assert scheduler.return_unscored(lease.lease_id, group_id, "a", live_keys=2), "3 in a row from 2 keys"
    assert group_id in scheduler.finished and scheduler.queue.tickets == []


def test_in_a_fleet_of_one_key_its_returns_alone_skip_a_prompt(make_scheduler):
    scheduler = make_scheduler()
    group_id, skipped = _return_unscored(scheduler, "only", live_keys=1)
    for attempt in range(1, UNSCORED_RETURNS):
        lease = scheduler.issue("only", 1)
        assert ids_of(lease) == [group_id], "not barred: nobody else would do it"
        skipped = scheduler.return_unscored(lease.lease_id, group_id, "only", live_keys=1)
        assert skipped == (attempt == UNSCORED_RETURNS - 1)
    assert group_id in scheduler.finished


def test_a_scored_group_ends_the_run_of_unscored_returns(make_scheduler):
    scheduler = make_scheduler()
    group_id, _ = _return_unscored(scheduler, "only", live_keys=1)
    lease = scheduler.issue("only", 1)
    index = lease.tickets[group_id].prompt_index
    scheduler.finish(lease.lease_id, group_id)
    retry = scheduler.queue.retry_prompt(index)
    for _ in range(UNSCORED_RETURNS - 1):  # two more returns of the prompt: three in all, not three in a row
        lease = scheduler.issue("only", 1)
        assert ids_of(lease) == [retry.group_id]
        assert not scheduler.return_unscored(lease.lease_id, retry.group_id, "only", live_keys=1)
