"""The EAGLE / EAGLE-3 drafter: a draft head (models/eagle.py) proposes greedily from the
target's hidden states, one head step a token, over a KV cache of its own.

A head position p reads the request's token at p + 1 and the target's feature at p, which the
target keeps by KV slot (layers/feature_capture.py). Each proposal first catches the head up on
the positions it has not run, through the one before the request's newest token (the whole
prompt the first time; after a verify step, the accepted drafts and the target's own token), in
EXTEND batches of at most `chunk` tokens; the last position's logits give the first draft. Each
further draft is a DECODE step over the one before, reading the head's own output feature.
After the verify step the head's KV drops every draft position: the positions of accepted
drafts are run again from the target's features at the next catch-up (SGLang's draft extend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from replaylm.model_executor.forward_batch import ForwardMode
from replaylm.models.eagle import EagleHead
from replaylm.speculative.draft_model import DraftKV, DraftModelDrafter
from replaylm.speculative.drafter import DraftTarget

if TYPE_CHECKING:
    from collections.abc import Sequence

    from replaylm.layers.feature_capture import FeatureStore
    from replaylm.mem_cache.req_to_token_pool import ReqToTokenPool
    from replaylm.model_executor.model_runner import ModelRunner


class EagleDrafter(DraftModelDrafter):
    def __init__(
        self,
        head: ModelRunner,
        store: FeatureStore,
        target_table: ReqToTokenPool,
        chunk: int,
    ) -> None:
        """`head`: the head's runner; `store`: the target's features; `target_table`: the
        target's request-to-slot table (the requests' `req_pool_idx` rows); `chunk`: the most
        tokens of one catch-up forward."""
        super().__init__(head)
        assert isinstance(head.model, EagleHead)
        self.head: EagleHead = head.model
        self.name = self.head.algorithm
        self.store = store
        self.target_table = target_table
        self.chunk = chunk

    def accepted(self, reqs: Sequence[DraftTarget], counts: Sequence[int]) -> None:
        """Drop every draft position (fed the head's own features, not the target's)."""
        for req in reqs:
            state = req.draft_state
            if isinstance(state, DraftKV):
                self._truncate(state, state.proposed_from - 1)
                state.fed_drafts = 0

    @torch.inference_mode()
    def _catch_up(self, reqs: list[DraftTarget], states: list[DraftKV]) -> list[int]:
        """Run each request's positions from the first the head lacks through the one before
        its newest token (that one always again: its logits are the first draft), in chunks;
        each request's first draft, its output feature left in `features` in request order."""
        todo: dict[int, tuple[int, int]] = {}  # request -> positions [start, end) to run
        for i, (req, state) in enumerate(zip(reqs, states, strict=True)):
            end = req.num_ids - 1
            self._truncate(state, end - 1)
            todo[i] = (len(state.slots), end)
        firsts = [0] * len(reqs)
        kept: dict[int, torch.Tensor] = {}  # output features of requests done before the last
        while todo:
            part, room = [], self.chunk
            for i, (start, end) in todo.items():
                if room == 0:
                    break
                stop = min(end, start + room)
                part.append((i, start, stop))
                room -= stop - start
            self._load_features(reqs, part)
            new = [reqs[i].id_slice(start + 1, stop + 1) for i, start, stop in part]
            tokens = self._forward(ForwardMode.EXTEND, [states[i] for i, _, _ in part], new)
            last_round = all(stop == todo[i][1] for i, _, stop in part) and len(part) == len(todo)
            for row, ((i, _, stop), token) in enumerate(zip(part, tokens, strict=True)):
                if stop < todo[i][1]:
                    todo[i] = (stop, todo[i][1])
                    continue
                del todo[i]
                firsts[i] = token
                if not last_round:
                    kept[i] = self.head.features[row].clone()
        if kept:  # some finished in earlier rounds: lay every output feature out in order
            last = iter(self.head.features[: len(reqs) - len(kept)].clone())
            ordered = [kept[i] if i in kept else next(last) for i in range(len(reqs))]
            self.head.features[: len(reqs)].copy_(torch.stack(ordered))
        return firsts

    def _load_features(self, reqs: list[DraftTarget], part: list[tuple[int, int, int]]) -> None:
        """The target's features at each request's positions of `part`, as the head's inputs,
        into its `features` (token order)."""
        table = self.target_table
        index: list[int] = []
        for i, start, stop in part:
            row = reqs[i].req_pool_idx
            assert row is not None  # a running request holds its table row
            base = row * table.row_width
            index += range(base + start, base + stop)
        entries = torch.tensor(index, dtype=torch.int64).to(table.device, non_blocking=True)
        slots = table.req_to_token.view(-1)[entries].long()
        inputs = self.head.project_target_features(self.store.read(slots))
        self.head.features[: inputs.shape[0]].copy_(inputs)

    @torch.inference_mode()
    def _decode(self, states: list[DraftKV], last: list[int], rows: list[int]) -> list[int]:
        if rows != list(range(len(rows))):  # fewer requests go on: their features first
            features = self.head.features
            index = torch.tensor(rows, dtype=torch.int64).to(features.device, non_blocking=True)
            features[: len(rows)].copy_(features.index_select(0, index))
        return super()._decode(states, last, rows)

    def _pick(self, logits: torch.Tensor) -> list[int]:
        return self.head.to_target_ids(logits.argmax(-1)).tolist()
