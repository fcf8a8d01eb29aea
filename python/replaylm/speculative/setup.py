"""The speculative decoding the server's flags ask for."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from replaylm.speculative.drafter import Speculation
from replaylm.speculative.ngram import NgramDrafter

if TYPE_CHECKING:
    from replaylm.server_args import ServerArgs

logger = logging.getLogger(__name__)


def speculation_from_args(args: ServerArgs) -> Speculation | None:
    """None when `--speculative-algorithm` is not set; logs what was chosen."""
    if args.speculative_algorithm is None:
        logger.info("speculative decoding: off")
        return None
    low = args.speculative_ngram_min_match_window_size
    high = args.speculative_ngram_max_match_window_size
    drafter = NgramDrafter(low, high)
    logger.info(
        "speculative decoding: %s (n-gram windows %d-%d), %d draft tokens per request per verify "
        "step, %s; verify steps run eagerly",
        drafter.name,
        low,
        high,
        args.speculative_steps,
        f"batches up to {args.speculative_max_bs}"
        if args.speculative_max_bs is not None
        else "any batch size",
    )
    return Speculation(drafter, args.speculative_steps, args.speculative_max_bs)
