"""The draft-model drafter (SGLang's STANDALONE): a smaller model of the target's vocabulary
proposes greedily, one of its decode steps a token, over a KV cache of its own.

Each proposal first feeds the draft model the request's tokens it has not seen (the whole
prompt the first time; after a verify step, the target's own token, and the last draft when
every draft was accepted) in one EXTEND batch, whose logits give the first draft; each further
draft is a DECODE step over the one before. After the verify step the draft's KV keeps the
accepted drafts and gives back the rest. Greedy proposals are single tokens, so the scheduler's
check (a draft is kept when it is the token the request's sampling picks) stays exact.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from replaylm.mem_cache.errors import OutOfKVCacheError, OutOfRequestSlotsError
from replaylm.model_executor.forward_batch import ForwardMode
from replaylm.speculative.drafter import Drafter, DraftTarget

if TYPE_CHECKING:
    from replaylm.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class DraftKV:
    """A request's place in the draft model's KV cache: its request-table row and the slots of
    its first tokens (prompt and output, then the drafts fed back), in order."""

    row: int
    slots: list[int] = field(default_factory=list)
    proposed_from: int = 0  # the request's token count when the last proposal was made
    fed_drafts: int = 0  # of that proposal's drafts, those fed through the draft model


class DraftModelDrafter(Drafter):
    name = "draft_model"
    same_on_every_rank = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.kv = runner.kv

    def propose(self, reqs: Sequence[DraftTarget], limits: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        active = [i for i, limit in enumerate(limits) if limit > 0]
        if not active:
            return drafts
        try:
            states = [self._state(reqs[i]) for i in active]
            totals = [reqs[i].num_ids for i in active]
            tokens = self._catch_up([reqs[i] for i in active], states)
        except (OutOfKVCacheError, OutOfRequestSlotsError) as err:
            logger.info("%s: %s; no drafts this step", self.name, err)
            return drafts
        for i, state, total, token in zip(active, states, totals, tokens, strict=True):
            drafts[i].append(token)
            state.proposed_from, state.fed_drafts = total, 0
        step = 1
        previous = list(range(len(active)))  # the requests of the last forward, in its order
        while True:
            going = [j for j in previous if len(drafts[active[j]]) < limits[active[j]]]
            if not going:
                return drafts
            try:
                tokens = self._decode(
                    [states[j] for j in going],
                    [drafts[active[j]][-1] for j in going],
                    [previous.index(j) for j in going],
                )
            except OutOfKVCacheError as err:
                logger.info("%s: %s; shorter drafts this step", self.name, err)
                return drafts
            for j, token in zip(going, tokens, strict=True):
                drafts[active[j]].append(token)
                states[j].fed_drafts = step
            step += 1
            previous = going

    def accepted(self, reqs: Sequence[DraftTarget], counts: Sequence[int]) -> None:
        """Keep the draft KV of the accepted drafts that were fed through the draft model."""
        for req, count in zip(reqs, counts, strict=True):
            state = req.draft_state
            if isinstance(state, DraftKV) and state.fed_drafts:
                self._truncate(state, state.proposed_from + min(count, state.fed_drafts))
                state.fed_drafts = 0

    def release(self, req: DraftTarget) -> None:
        state = req.draft_state
        if isinstance(state, DraftKV):
            self.kv.allocator.free(state.slots)
            self.kv.req_to_token.free(state.row)
            req.draft_state = None

    def _state(self, req: DraftTarget) -> DraftKV:
        if not isinstance(req.draft_state, DraftKV):
            req.draft_state = DraftKV(self.kv.req_to_token.alloc(1)[0])
        return req.draft_state

    def _truncate(self, state: DraftKV, length: int) -> None:
        if len(state.slots) > length:
            self.kv.allocator.free(state.slots[length:])
            del state.slots[length:]

    @torch.inference_mode()
    def _catch_up(self, reqs: list[DraftTarget], states: list[DraftKV]) -> list[int]:
        """Feed each request's unseen tokens (at least its last one); its next token."""
        new = []
        for req, state in zip(reqs, states, strict=True):
            total = req.num_ids
            self._truncate(state, total - 1)  # its last token is always fed again
            new.append(req.id_slice(len(state.slots), total))
        return self._forward(ForwardMode.EXTEND, states, new)

    @torch.inference_mode()
    def _decode(self, states: list[DraftKV], last: list[int], rows: list[int]) -> list[int]:
        """One decode step over each request's last draft; `rows`: where each request was in
        the forward before (for a drafter that carries state from one step to the next)."""
        return self._forward(ForwardMode.DECODE, states, [[t] for t in last])

    def _forward(self, mode: ForwardMode, states: list[DraftKV], new: list[list[int]]) -> list[int]:
        table = self.kv.req_to_token
        for state, ids in zip(states, new, strict=True):
            table.check_fits(len(state.slots) + len(ids))
        slots = self.kv.allocator.alloc(sum(len(ids) for ids in new))
        prefix_lens = [len(s.slots) for s in states]
        start = 0
        for state, ids in zip(states, new, strict=True):
            state.slots += slots[start : start + len(ids)]
            start += len(ids)
        batch = self.runner.build_batch(mode, new, prefix_lens, [s.row for s in states], slots)
        return self._pick(self.runner.forward(batch))

    def _pick(self, logits: torch.Tensor) -> list[int]:
        """The greedy proposal of each row of `logits`, as target token ids."""
        return logits.argmax(-1).tolist()
