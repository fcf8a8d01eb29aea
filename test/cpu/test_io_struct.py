"""The messages between the scheduler process and the front end survive the pipe: a step's
outputs, pickled as rows, come back equal, finish reasons, logprobs and optional fields
included, and tokens sent alone stay tokens alone."""

from __future__ import annotations

import pickle

from replaylm.model_executor.forward_stats import ForwardStats
from replaylm.runtime.io_struct import BatchTokenOut, ReqTokenOut, SchedulerStats, TokenLogprob
from replaylm.runtime.request import FinishReason


def test_a_step_of_outputs_comes_back_equal():
    outputs = [
        ReqTokenOut("a", [5], None, None, 12),
        ("a", [6]),  # a PlainTokenOut: tokens alone
        ReqTokenOut(
            "b",
            [7, 8, 9],
            [TokenLogprob(7, -0.1, [(7, -0.1), (3, -2.5)])] * 3,
            FinishReason("stop", "END"),
            40,
            prompt_logprobs=[None, TokenLogprob(4, -1.0, [])],
            cached_tokens=32,
            admitted_at=1234.5,
            spec_verify_ct=2,
            spec_accepted=1,
        ),
    ]
    stats = SchedulerStats(2, 0, 100, 1000, 0, ForwardStats())
    batch = BatchTokenOut(outputs, stats)
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch
    assert [type(o) for o in back.outputs] == [ReqTokenOut, tuple, ReqTokenOut]
    assert back.outputs[2].finish_reason.matched == "END"
