"""The trace compiler on hand-written calls: merging, splits and their reasons, alignment."""

from __future__ import annotations

import numpy as np
import pytest

from turnforge.gateway.trace import CallRecord, compile_trace


def call(i, prompt, completion, version=0):
    return CallRecord(i, tuple(prompt), tuple(completion), tuple(-0.1 * (k + 1) for k in range(len(completion))),
                      version, 1.0, "stop")


def test_calls_that_extend_the_sample_merge_with_masks_only_on_sampled_tokens():
    calls = [call(0, [1, 2, 3], [10, 11]), call(1, [1, 2, 3, 10, 11, 4, 5], [12], version=1)]
    out = compile_trace(calls, "r0")
    assert out.splits == () and len(out.samples) == 1
    s = out.samples[0]
    assert s.token_ids.tolist() == [1, 2, 3, 10, 11, 4, 5, 12]
    assert s.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert s.versions.tolist() == [-1, -1, -1, 0, 0, -1, -1, 1]
    np.testing.assert_allclose(s.logprobs[s.loss_mask == 1], [-0.1, -0.2, -0.1])
    assert np.isnan(s.logprobs[s.loss_mask == 0]).all() and s.turn_index == -1 and s.trajectory_id == "r0"


def test_a_rerendered_history_splits_keeps_the_sampled_tokens_and_says_where():
    calls = [call(0, [1, 2, 3], [10, 11, 99]), call(1, [1, 2, 3, 10, 7, 99, 4], [12])]
    out = compile_trace(calls, "r")
    assert [len(s) for s in out.samples] == [6, 8]
    assert out.samples[0].token_ids.tolist() == [1, 2, 3, 10, 11, 99] and out.samples[0].turn_index == 0
    assert out.samples[1].loss_mask.tolist() == [0] * 7 + [1] and out.samples[1].turn_index == 1
    (split,) = out.splits
    assert (split.call_index, split.reason, split.position, split.expected, split.got) == (1, "rerendered", 4, (11, 99), (7, 99, 4))
    assert out.count("rerendered") == 1 and out.count("new_context") == 0


def test_another_conversation_is_a_new_context_split_and_order_is_by_call_index():
    calls = [call(1, [8, 9], [20]), call(0, [1, 2, 3], [10])]  # recorded out of order
    out = compile_trace(calls, "r")
    assert [s.token_ids.tolist() for s in out.samples] == [[1, 2, 3, 10], [8, 9, 20]]
    assert [(s.reason, s.position) for s in out.splits] == [("new_context", 0)]


def test_a_retry_is_a_branch_split():
    out = compile_trace([call(0, [1, 2], [3]), call(1, [1, 2], [4])], "r")  # the same prompt again
    assert [(s.reason, s.position, s.got) for s in out.splits] == [("branch", 2, ())]
    assert sum(s.num_action_tokens for s in out.samples) == 2


def test_misaligned_records_are_refused():
    with pytest.raises(ValueError, match="2 completion ids but 1 logprobs"):
        compile_trace([CallRecord(0, (1,), (2, 3), (-0.5,), 0, 1.0, "stop")], "r")


def test_no_calls_no_samples():
    out = compile_trace([], "r")
    assert out.samples == () and out.splits == ()
