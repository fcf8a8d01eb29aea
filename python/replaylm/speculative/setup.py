"""The speculative decoding the server's flags ask for."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from replaylm.speculative.draft_model import DraftModelDrafter
from replaylm.speculative.drafter import Drafter, Speculation
from replaylm.speculative.eagle import EagleDrafter
from replaylm.speculative.ngram import NgramDrafter

if TYPE_CHECKING:
    from replaylm.model_executor.model_runner import ModelRunner
    from replaylm.server_args import ServerArgs

logger = logging.getLogger(__name__)


def speculation_from_args(
    args: ServerArgs, target: ModelRunner, draft: ModelRunner | None, prefill_chunk: int
) -> Speculation | None:
    """None when `--speculative-algorithm` is not set; logs what was chosen. `draft`: the draft
    model's or EAGLE head's runner (draft_model, eagle, eagle3); `prefill_chunk`: the target's
    (the most tokens an EAGLE head catches up on at once)."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        logger.info("speculative decoding: off")
        return None
    drafter: Drafter
    if algorithm == "draft_model":
        assert draft is not None  # load_model_runners loads it for this algorithm
        drafter = DraftModelDrafter(draft)
        what = f"draft model {args.speculative_draft_model_path}, proposing greedily"
    elif algorithm in ("eagle", "eagle3"):
        store = target.model.model.feature_store
        assert draft is not None and store is not None  # load_model_runners wires them
        drafter = EagleDrafter(draft, store, target.kv.req_to_token, prefill_chunk)
        what = f"head {args.speculative_draft_model_path}, proposing greedily"
    else:
        low = args.speculative_ngram_min_match_window_size
        high = args.speculative_ngram_max_match_window_size
        drafter = NgramDrafter(low, high)
        what = f"n-gram windows {low}-{high}"
    logger.info(
        "speculative decoding: %s (%s), %d draft tokens per request per verify step, batches "
        "up to %d",
        drafter.name,
        what,
        args.speculative_steps,
        args.speculative_batch_limit,
    )
    return Speculation(drafter, args.speculative_steps, args.speculative_batch_limit)
