"""The penalties of `layers/logit_adjust.py` in one launch, bit-equal to its torch code: each
batch row reads its request-table row's counts and prompt mask in place (the torch code gathers
them first) and computes with the same rounding (IEEE division, no fused multiply-add). The torch
code is a dozen passes over `[B, V]`; this is one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# the batch size is a runtime value: a penalised batch of a new size compiles no variant (one
# equal to 1 or divisible by 16 would, inside a running server)
@triton.jit(do_not_specialize=["batch"])
def _penalties_kernel(
    Logits, Counts, PromptMask, Rows, Penalties, Out, batch, vocab, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    row = tl.load(Rows + i)
    repetition = tl.load(Penalties + i)
    frequency = tl.load(Penalties + batch + i)
    presence = tl.load(Penalties + 2 * batch + i)
    x = tl.load(Logits + i.to(tl.int64) * vocab + cols, mask=mask, other=0.0)
    count = tl.load(Counts + row * vocab + cols, mask=mask, other=0)
    in_prompt = tl.load(PromptMask + row * vocab + cols, mask=mask, other=0) != 0
    in_output = count > 0
    x = tl.where(
        in_prompt | in_output, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x
    )
    x = x - frequency * count.to(tl.float32)
    x = x - presence * in_output.to(tl.float32)
    tl.store(Out + i.to(tl.int64) * vocab + cols, x, mask=mask)


def apply_penalties_kernel(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    penalties: torch.Tensor,
    block: int = 1024,
) -> torch.Tensor:
    """`logit_adjust.apply_penalties` for contiguous float32 `logits` `[B, V]`, `counts`,
    `prompt_mask` `[rows, V]`, `rows` `[B]` and `penalties` `[3, B]`."""
    batch, vocab = logits.shape
    out = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
    if batch:
        _penalties_kernel[(batch, triton.cdiv(vocab, block))](
            logits,
            counts,
            prompt_mask,
            rows,
            penalties,
            out,
            batch,
            vocab,
            BLOCK=block,
            num_warps=4,
            enable_fp_fusion=False,  # x - f * count rounded twice, as torch's two kernels do
        )
    return out
