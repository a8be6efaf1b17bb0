"""Recorded chat calls stitched into trajectories: a call that extends the last one appends (the agent's added ids as
context, the sampled ids as the model's); one that rewrites history starts a new trajectory."""

import pytest

from hybrid_rl.sidecar.stitch import RecordedCall, stitch


def test_calls_that_extend_append_with_the_added_ids_as_context():
    first = RecordedCall([1, 2, 3], [10, 11], [-0.1, -0.2])
    second = RecordedCall([1, 2, 3, 10, 11, 50, 51], [12], [-0.3])  # 50, 51: a tool result the agent appended
    third = RecordedCall([1, 2, 3, 10, 11, 50, 51, 12], [13, 14], [-0.4, -0.5])  # nothing added in between
    (t,) = stitch([first, second, third])
    assert t.prompt_ids == [1, 2, 3]
    assert t.response_ids == [10, 11, 50, 51, 12, 13, 14]
    assert t.loss_mask == [True, True, False, False, True, True, True]
    assert t.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5]
    assert t.turns == 3
    # every call's context is a prefix of the trained ids: what the engine saw, id for id
    for c in (first, second, third):
        assert t.context[: len(c.prompt_ids) + len(c.output_ids)] == [*c.prompt_ids, *c.output_ids]


def test_a_call_that_rewrites_history_starts_a_new_trajectory():
    calls = [RecordedCall([1, 2], [10, 11], [-0.1, -0.1]),
             RecordedCall([1, 2, 10, 99, 7], [12], [-0.2]),  # the agent edited the model's turn (11 -> 99)
             RecordedCall([1, 2, 10, 99, 7, 12, 8], [13], [-0.3]),  # extends the second
             RecordedCall([5, 6], [14], [-0.4])]  # a fresh conversation
    a, b, c = stitch(calls)
    assert (a.prompt_ids, a.response_ids) == ([1, 2], [10, 11])
    assert (b.prompt_ids, b.response_ids, b.loss_mask) == ([1, 2, 10, 99, 7], [12, 8, 13], [True, False, True])
    assert (c.prompt_ids, c.response_ids) == ([5, 6], [14])


def test_a_call_shorter_than_the_trajectory_or_mismatched_logprobs():
    a, b = stitch([RecordedCall([1, 2, 3], [4], [-1.0]), RecordedCall([1, 2], [4], [-1.0])])  # a retry from earlier
    assert (b.prompt_ids, b.response_ids) == ([1, 2], [4])
    with pytest.raises(ValueError, match="2 output ids but 1 log-probs"):
        stitch([RecordedCall([1], [2, 3], [-1.0])])


def test_each_sampled_id_keeps_its_version_and_added_context_takes_the_one_before():
    calls = [RecordedCall([1, 2], [10, 11], [-0.1, -0.1], [3, 4]),  # paused for an update mid-call: 3, then 4
             RecordedCall([1, 2, 10, 11, 50], [12, 13], [-0.2, -0.2], [5, 5]),
             RecordedCall([6], [14], [-0.3], [5])]
    a, b = stitch(calls)
    assert a.response_ids == [10, 11, 50, 12, 13] and a.versions == [3, 4, 4, 5, 5]
    assert b.versions == [5]
    # a call the server stamped no versions for: the trajectory records none (not a guess)
    (c,) = stitch([RecordedCall([1], [2], [-1.0], [0]), RecordedCall([1, 2, 3], [4], [-1.0])])
    assert c.response_ids == [2, 3, 4] and c.versions == []
    with pytest.raises(ValueError, match="2 output ids but 1 versions"):
        stitch([RecordedCall([1], [2, 3], [-1.0, -1.0], [0])])
