"""The fixed device buffers a prefill graph reads its inputs from (decode shapes have their own
`DecodeInputs`, where batches are built)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from replaylm.model_executor.model_runner import ModelRunner


@dataclass
class StaticBuffers:
    """Token-indexed buffers hold `max_num_tokens` entries, request-indexed ones `max_bs`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor

    @classmethod
    def allocate(cls, max_bs: int, max_num_tokens: int, device: torch.device) -> StaticBuffers:
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        return cls(
            input_ids=zeros(max_num_tokens),
            positions=zeros(max_num_tokens),
            out_cache_loc=zeros(max_num_tokens),
            req_pool_indices=zeros(max_bs),
            seq_lens=zeros(max_bs),
            prefix_lens=zeros(max_bs),
            extend_seq_lens=zeros(max_bs),
            extend_start_loc=zeros(max_bs),
        )

    def view(
        self,
        mode: ForwardMode,
        bs: int,
        num_tokens: int,
        seq_lens_cpu: list[int],
        extend_seq_lens_cpu: list[int],
        model_runner: ModelRunner,
        num_decode: int = 0,
    ) -> ForwardBatch:
        """A ForwardBatch over the first `bs` requests / `num_tokens` tokens of the buffers,
        with the model runner's pools and attention backend (`num_decode`: ForwardBatch's)."""
        return ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs],
            extend_seq_lens=self.extend_seq_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            out_cache_loc=self.out_cache_loc[:num_tokens],
            seq_lens_cpu=seq_lens_cpu,
            extend_seq_lens_cpu=extend_seq_lens_cpu,
            req_to_token_pool=model_runner.req_to_token_pool,
            kv_pool=model_runner.kv_pool,
            attn_backend=model_runner.attn_backend,
            num_decode=num_decode,
        )
