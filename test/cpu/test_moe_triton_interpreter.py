"""The fused MoE kernels on the CPU, through Triton's interpreter, at tiny sizes.

The block-aligned sort (`moe_align`) is checked for what the grouped GEMM relies on; the whole
fused path (`triton_experts`) against `torch_experts`, with experts that get no token and ids of
other ranks' experts; a token's output is shown not to depend on the rows beside it (a CUDA
graph's padding rows). Then the dispatch: `fused_experts` takes the Triton route where
the kernels' device is the input's, and traces as one custom op under torch.compile. float32 and
float16 only: the interpreter's bf16 is not the GPU's (test_fused_kernels_interpreter.py).
The routing kernel (`fused_route`) against the torch routing and count, and the router's
matmul fused into it (`fused_router`) against the two launches.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import require_triton_interpreter, scalar_loop_bounds

require_triton_interpreter()

from replaylm.distributed.parallel_state import TPPlace  # noqa: E402
from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.kernels import native_only  # noqa: E402
from replaylm.layers.kernels.rmsnorm import rms_norm, rms_norm_of_expert_sum  # noqa: E402
from replaylm.layers.kernels.skinny_matmul import (  # noqa: E402
    MatmulConfig,
    skinny_matmul,
    split_k_workspace,
)
from replaylm.layers.layernorm import RMSNorm  # noqa: E402
from replaylm.layers.linear import Linear  # noqa: E402
from replaylm.layers.moe import fused_router as fused_router_module  # noqa: E402
from replaylm.layers.moe import fused_routing  # noqa: E402
from replaylm.layers.moe import moe_align as moe_align_module  # noqa: E402
from replaylm.layers.moe import triton_experts as triton_module  # noqa: E402
from replaylm.layers.moe.block_configs import MoeBlockConfig  # noqa: E402
from replaylm.layers.moe.experts import fused_experts  # noqa: E402
from replaylm.layers.moe.fused_router import (  # noqa: E402
    fused_router,
    route_hidden_rows,
)
from replaylm.layers.moe.fused_routing import fused_route  # noqa: E402
from replaylm.layers.moe.layer import FusedMoE, SparseMoeBlock  # noqa: E402
from replaylm.layers.moe.moe_align import max_padded_rows, moe_align_block_size  # noqa: E402
from replaylm.layers.moe.pair_experts import pair_experts  # noqa: E402
from replaylm.layers.moe.routed_rows import RoutedRows  # noqa: E402
from replaylm.layers.moe.routing import (  # noqa: E402
    LiveTokens,
    count_routed_tokens,
    route,
    route_hidden,
    select_experts,
)
from replaylm.layers.moe.torch_experts import torch_experts  # noqa: E402
from replaylm.layers.moe.triton_experts import triton_experts  # noqa: E402
from replaylm.layers.moe.weighted_sum import weighted_sum  # noqa: E402
from replaylm.layers.quantization.fp8_kernels import rms_norm_quantize  # noqa: E402

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}
DTYPES = [torch.float32, torch.float16]
# 16-row blocks over K in several steps, and column tiles that do not divide N
SMALL_TILES = MoeBlockConfig(block_m=16, block_n=32, block_k=16, group_m=2)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_scalar_index():
    with scalar_loop_bounds():
        yield


def _routing(
    tokens: int,
    top_k: int,
    experts: int,
    seed: int,
    unused: tuple[int, ...] = (),
    foreign: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` float32, ids `[T, k]` int32): k distinct experts per token drawn from
    those not in `unused`, then `foreign` slots set to ids outside 0..E-1 (other ranks')."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in unused])
    picks = [allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)]
    ids = torch.stack(picks).to(torch.int32)
    for i, flat in enumerate(torch.randperm(tokens * top_k, generator=gen)[:foreign].tolist()):
        ids.view(-1)[flat] = (-1, experts, experts + 5)[i % 3]
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return weights / weights.sum(dim=1, keepdim=True), ids


def _weights(
    experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random `w13` `[E, 2I, H]` and `w2` `[E, H, I]`, scaled for unit-size products."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def _hidden(tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _check_aligned(ids: torch.Tensor, experts: int, block_m: int, chunk_tile: int = 1024) -> None:
    """The sort of `ids` is a block-aligned permutation of its pairs of experts 0..E-1: each
    such pair exactly once, in order within its expert, each block one expert's (ascending), each
    expert's run padded with the sentinel T * k by less than a block."""
    flat = ids.reshape(-1).long()
    numel = flat.numel()
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, experts, block_m, chunk_tile)
    rows = max_padded_rows(numel, experts, block_m)
    assert sorted_ids.shape == (rows,) and expert_ids.shape == (rows // block_m,)
    counts = torch.bincount(flat[(flat >= 0) & (flat < experts)], minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(num_post_pad.item())
    assert total == padded.sum().item() <= rows
    body = sorted_ids[:total].long()
    real = body[body != numel]
    mine = ((flat >= 0) & (flat < experts)).nonzero().view(-1)
    assert torch.equal(real.sort().values, mine)
    blocks = expert_ids[: total // block_m].long()
    assert torch.equal(blocks, torch.repeat_interleave(torch.arange(experts), padded // block_m))
    for expert in range(experts):
        start = padded[:expert].sum().item()
        run = body[start : start + padded[expert].item()]
        count = counts[expert].item()
        assert torch.equal(run[:count], (flat == expert).nonzero().view(-1))
        assert (run[count:] == numel).all()


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m", "unused", "foreign"),
    [
        (1, 2, 4, 16, (), 0),
        (7, 2, 4, 16, (1,), 3),
        (40, 2, 3, 16, (), 5),  # several blocks per expert
        (33, 4, 8, 32, (0, 5), 9),
        (5, 3, 6, 16, (), 15),  # every pair another rank's: nothing to compute
        (300, 4, 5, 64, (2,), 40),  # 1,200 pairs in one launch
        (256, 8, 128, 16, (), 20),  # a decode step's most pairs in one launch: 2,048
        (700, 4, 40, 16, (3, 17), 50),  # more than one launch takes: 22 chunks, the last ragged
        (600, 8, 128, 64, (), 30),  # Qwen3-30B-A3B's experts: 38 chunks
    ],
)
def test_align_is_a_block_aligned_permutation(tokens, top_k, experts, block_m, unused, foreign):
    _, ids = _routing(tokens, top_k, experts, seed=tokens, unused=unused, foreign=foreign)
    _check_aligned(ids, experts, block_m)


def test_one_launch_and_three_sort_alike(monkeypatch):
    """A decode step's 2,048 pairs sorted in one launch (each expert's program counting them
    all) and in three (histograms, runs, scatter): the same runs, blocks and total."""
    _, ids = _routing(256, 8, 128, seed=5, unused=(7,), foreign=30)
    one = moe_align_block_size(ids, 128, 16)
    monkeypatch.setattr(moe_align_module, "_ONE_LAUNCH_PAIRS", 0)
    three = moe_align_block_size(ids, 128, 16)
    total = int(one[2].item())
    assert total == int(three[2].item())
    assert torch.equal(one[0][:total], three[0][:total])
    assert torch.equal(one[1][: total // 16], three[1][: total // 16])


def test_align_reads_the_chunks_in_tiles():
    """Each expert's program reads the chunks' counts a tile at a time, carrying its count so far
    across tiles: 69 chunks in tiles of 16, as 1,024 of them would be read in one."""
    _, ids = _routing(1100, 8, 128, seed=3, unused=(9,), foreign=70)
    _check_aligned(ids, 128, 128, chunk_tile=16)


CASES = [  # tokens, experts, top_k, hidden, intermediate, unused experts, foreign slots
    (1, 4, 2, 32, 16, (), 0),
    (7, 4, 2, 48, 40, (), 0),  # tokens and N not multiples of the tiles
    (40, 3, 2, 32, 24, (), 0),  # several blocks per expert
    (9, 8, 3, 32, 32, (2, 5), 4),  # experts without a token, other ranks' ids
    (6, 4, 2, 16, 16, (), 12),  # no pair of this rank: zeros
    (2, 8, 3, 40, 24, (1,), 2),  # the pair route by default, with other ranks' ids
    (2, 4, 2, 16, 16, (), 4),  # the pair route, no pair of this rank: zeros
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["default", "small"])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "unused", "foreign"), CASES
)
def test_fused_matches_torch_experts(
    dtype, config, tokens, experts, top_k, hidden, inter, unused, foreign
):
    weights, ids = _routing(tokens, top_k, experts, seed=tokens, unused=unused, foreign=foreign)
    w13, w2 = _weights(experts, hidden, inter, dtype, seed=experts)
    x = _hidden(tokens, hidden, dtype, seed=hidden)
    got = triton_experts(x, w13, w2, weights, ids, config=config)
    want = torch_experts(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    if foreign == tokens * top_k:
        assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["default", "small"])
def test_weights_through_a_descriptor_and_by_pointer_agree(dtype, config):
    """The grouped GEMMs read the expert weights through a tensor descriptor (TMA on the GPU),
    by default from `TMA_MIN_TOKENS` tokens, or by pointer: both give `torch_experts`' numbers,
    with column tiles and K steps that do not divide the weights (gate and up 24 wide, hidden
    40), experts with no token and other ranks' ids. Weights TMA cannot read take the pointers."""
    weights, ids = _routing(9, 3, 8, seed=11, unused=(4,), foreign=2)
    w13, w2 = _weights(8, 40, 24, dtype, seed=12)
    x = _hidden(9, 40, dtype, seed=13)
    assert triton_module.tma_weights(w13, None) and triton_module.tma_weights(w2, None)
    fewest = triton_module.TMA_MIN_TOKENS  # the default's choice: by pointer below it
    assert triton_module._tma(w13, None, None, fewest)
    assert not triton_module._tma(w13, None, None, fewest - 1)
    want = torch_experts(x, w13, w2, weights, ids)
    for weight_tma in (True, False):
        got = triton_experts(x, w13, w2, weights, ids, config=config, weight_tma=weight_tma)
        torch.testing.assert_close(got, want, **TOL[dtype])
    odd = _weights(8, 41, 24, dtype, seed=12)[0]  # rows of 41 columns: not 16-byte aligned
    assert not triton_module.tma_weights(odd, None)
    every_other_row = torch.cat([w13, w13], dim=1)[:, ::2]  # rows contiguous, the tensor not
    assert not triton_module.tma_weights(every_other_row, None)
    with pytest.raises(ValueError, match="tensor descriptor"):
        triton_experts(x, every_other_row, w2, weights, ids, weight_tma=True)


def test_strided_hidden_and_empty_batch():
    """A column slice of a wider tensor (a row stride above H) reads right; no tokens, no
    launches."""
    weights, ids = _routing(5, 2, 4, seed=3)
    w13, w2 = _weights(4, 32, 16, torch.float32, seed=4)
    wide = _hidden(5, 48, torch.float32, seed=5)
    x = wide[:, 8:40]
    got = triton_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, torch_experts(x, w13, w2, weights, ids), **TOL[torch.float32])
    empty = triton_experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["default", "small"])
def test_rows_do_not_depend_on_padding_rows(dtype, config):
    """5 tokens alone and as the first rows of an 8-row batch (3 padding rows of other routes,
    one of them another rank's): the 5 rows' outputs are bit-equal."""
    experts, hidden, inter = 4, 32, 24
    w13, w2 = _weights(experts, hidden, inter, dtype, seed=6)
    weights, ids = _routing(8, 2, experts, seed=7, foreign=1)
    x = _hidden(8, hidden, dtype, seed=8)
    alone = triton_experts(x[:5], w13, w2, weights[:5], ids[:5], config=config)
    batch = triton_experts(x, w13, w2, weights, ids, config=config)
    assert torch.equal(alone, batch[:5])


# 16- and 32-column tiles over 16- and 32-column K steps (several of each), both orientations
PAIR_TILES = [
    (MatmulConfig(32, 16, 1, num_warps=4, num_stages=2), MatmulConfig(16, 32, 1, 4, 2)),
    (
        MatmulConfig(16, 32, 1, num_warps=4, num_stages=2, swap=True),
        MatmulConfig(16, 16, 1, num_warps=4, num_stages=2, swap=True),
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("configs", PAIR_TILES, ids=["plain", "swapped"])
def test_pair_experts_match_torch_experts_and_rows_ignore_padding(dtype, configs):
    """The unsorted route: 4 tokens (another rank's ids among them) as `torch_experts` gives
    them, the first 3 alone bit-equal to the same rows of the batch, every arrival counter back
    at zero."""
    experts, hidden, inter = 6, 48, 40
    w13, w2 = _weights(experts, hidden, inter, dtype, seed=15)
    weights, ids = _routing(4, 3, experts, seed=16, foreign=3)
    x = _hidden(4, hidden, dtype, seed=17)
    got = pair_experts(x, w13, w2, weights, ids, configs)
    torch.testing.assert_close(got, torch_experts(x, w13, w2, weights, ids), **TOL[dtype])
    alone = pair_experts(x[:3], w13, w2, weights[:3], ids[:3], configs)
    assert torch.equal(alone, got[:3])
    assert int(split_k_workspace(x.device)[1].count_nonzero()) == 0


@pytest.fixture
def triton_calls(monkeypatch) -> list[int]:
    """Point the kernel device at the CPU and record each call of `triton_experts`."""
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return triton_experts(*args, **kwargs)

    monkeypatch.setattr(triton_module, "triton_experts", counted)
    return calls


def test_fused_experts_takes_the_triton_route(triton_calls):
    """The Triton route on the kernels' device, the torch one inside native_only();
    both give the same numbers."""
    weights, ids = _routing(6, 2, 4, seed=9, foreign=2)
    w13, w2 = _weights(4, 32, 16, torch.float32, seed=10)
    x = _hidden(6, 32, torch.float32, seed=11)
    fused = fused_experts(x, w13, w2, weights, ids)
    assert triton_calls == [6]
    with native_only():
        native = fused_experts(x, w13, w2, weights, ids)
    assert triton_calls == [6]
    torch.testing.assert_close(fused, native, **TOL[torch.float32])


@pytest.mark.parametrize("kernels_switch", [False, True])
def test_fused_experts_traces_as_one_custom_op(triton_calls, kernels_switch):
    """Under torch.compile, with or without `kernels_in_compiled_code` (the torch code's host
    sync cannot be traced), the Triton route is the custom op `replaylm::fused_experts`: one
    graph (fullgraph), the eager numbers."""
    weights, ids = _routing(3, 2, 4, seed=12)
    w13, w2 = _weights(4, 16, 16, torch.float16, seed=13)
    x = _hidden(3, 16, torch.float16, seed=14)
    eager = fused_experts(x, w13, w2, weights, ids)
    torch._dynamo.reset()
    with kernels.kernels_in_compiled_code(kernels_switch):
        compiled = torch.compile(fused_experts, backend="eager", fullgraph=True)
        got = compiled(x, w13, w2, weights, ids)
    assert triton_calls == [3, 3]
    assert torch.equal(got, eager)


# ---- the routing kernel -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize"),
    [(1, 8, 2, True), (7, 60, 4, True), (5, 128, 8, False), (3, 6, 6, True)],
)
def test_fused_routing_matches_the_torch_routing(tokens, experts, top_k, renormalize):
    """Weights, ids (shifted by a first expert) and the live tokens' count equal
    `select_experts` and `count_routed_tokens`; a row at slot 0 (padding) counts nothing.
    float32 logits: no ties, whose order torch.topk leaves open."""
    gen = torch.Generator().manual_seed(tokens + experts)
    logits = torch.randn(tokens, experts, generator=gen)
    slots = torch.arange(tokens) * 3
    want_w, want_ids = select_experts(logits, top_k, renormalize)
    want_counts = torch.zeros(experts, dtype=torch.int64)
    count_routed_tokens(want_counts, want_ids, slots)
    counts = torch.zeros(experts, dtype=torch.int64)
    weights, ids = fused_route(logits, top_k, renormalize, counts, slots, first_expert=2)
    assert torch.equal(ids, want_ids - 2)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts, want_counts) and counts.sum() == (tokens - 1) * top_k


def test_route_takes_the_kernel_on_the_kernels_device(monkeypatch):
    """`route` runs the fused kernel where the experts run theirs, torch inside native_only();
    without slots every row counts."""
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    calls: list[int] = []

    def counted(logits, *args):
        calls.append(logits.shape[0])
        return fused_route(logits, *args)

    monkeypatch.setattr(fused_routing, "fused_route", counted)
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    counts = [torch.zeros(16, dtype=torch.int64) for _ in range(2)]
    fused = route(logits, 4, True, counts[0], LiveTokens())
    with native_only():
        native = route(logits, 4, True, counts[1], LiveTokens())
    assert calls == [4]
    assert torch.equal(fused[1], native[1]) and torch.equal(counts[0], counts[1])
    assert counts[0].sum() == 16


# ---- the router's matmul and the routing in one launch -------------------------------------


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize", "width"),
    [(1, 8, 2, True, 64), (5, 60, 4, True, 96), (16, 128, 8, False, 320), (3, 6, 6, True, 48)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_router_is_the_skinny_matmul_then_the_routing(
    tokens, experts, top_k, renormalize, width, dtype
):
    """The one launch gives the router's skinny matmul then `fused_route` bit for bit (weights,
    shifted ids, the count without the padding row at slot 0), over K in one slice and in
    several, and leaves every counter of the workspace at zero."""
    gen = torch.Generator().manual_seed(tokens + experts)
    hidden = torch.randn(tokens, width, generator=gen).to(dtype)
    weight = (torch.randn(experts, width, generator=gen) / width**0.5).to(dtype)
    slots = torch.arange(tokens) * 3
    counts = [torch.zeros(experts, dtype=torch.int64) for _ in range(2)]
    logits = skinny_matmul(hidden, weight)
    want = fused_route(logits, top_k, renormalize, counts[0], slots, first_expert=1)
    got = fused_router(hidden, weight, top_k, renormalize, counts[1], slots, first_expert=1)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert torch.equal(counts[1], counts[0]) and counts[1].sum() == (tokens - 1) * top_k
    assert int(split_k_workspace(hidden.device)[1].count_nonzero()) == 0
    with pytest.raises(ValueError, match="at most 16 tokens"):
        fused_router(torch.zeros(17, width, dtype=dtype), weight, top_k, True, counts[1], None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tokens_routing_does_not_depend_on_its_batch_up_to_a_decode_batch(dtype):
    """Past 16 tokens, up to SPLIT_ROUTER_ROWS, the router's matmul is the skinny matmul's split-K
    launch over 16-token tiles, the tiles the fused router runs: each token of a 40-token batch
    routes as it does alone, bit for bit, and the counts are the fused router's."""
    width, experts, top_k = 576, 16, 4  # K in 4 slices
    gen = torch.Generator().manual_seed(40)
    hidden = torch.randn(40, width, generator=gen).to(dtype)
    weight = (torch.randn(experts, width, generator=gen) / width**0.5).to(dtype)
    counts = torch.zeros(experts, dtype=torch.int64)
    weights, ids = route_hidden_rows(hidden, weight, top_k, True, counts, None)
    alone_counts = torch.zeros(experts, dtype=torch.int64)
    for t in range(40):
        one = route_hidden_rows(hidden[t : t + 1], weight, top_k, True, alone_counts, None)
        assert torch.equal(one[1][0], ids[t]) and torch.equal(one[0][0], weights[t])
    assert torch.equal(counts, alone_counts) and int(counts.sum()) == 40 * top_k
    assert int(split_k_workspace(hidden.device)[1].count_nonzero()) == 0


def test_route_hidden_fuses_the_router_at_decode_rows(monkeypatch):
    """Where the kernels run, a skinny-matmul router's few tokens take the fused launch, more
    tokens the router's matmul then the routing, inside native_only() the torch code; all route
    alike (the weights within float32's rounding of the logits)."""
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    calls: list[int] = []

    def counted(hidden, *args):
        calls.append(hidden.shape[0])
        return fused_router(hidden, *args)

    monkeypatch.setattr(fused_router_module, "fused_router", counted)
    router = Linear(32, 16)
    router.matmul = "triton"
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=torch.Generator().manual_seed(4)))
    for tokens in (3, 20):
        hidden = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens))
        counts = [torch.zeros(16, dtype=torch.int64) for _ in range(2)]
        fused = route_hidden(hidden, router, 4, True, counts[0], LiveTokens())
        with native_only():
            native = route_hidden(hidden, router, 4, True, counts[1], LiveTokens())
        assert torch.equal(fused[1], native[1]) and torch.equal(counts[0], counts[1])
        torch.testing.assert_close(fused[0], native[0], **TOL[torch.float32])
    assert calls == [3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norm_after_the_experts_takes_their_weighted_sum_into_its_launch(dtype):
    """The sorted route's rows before their weighted sum (`defer_sum`, other ranks' slots among
    them): summed alone they are the route's summed output, and the residual-add RMSNorm that
    sums them in its own launch gives the sum's launch then the norm's, bit for bit (output and
    new residual), as does the norm that also quantizes its output to FP8."""
    weights, ids = _routing(5, 2, 4, seed=61, foreign=3)
    w13, w2 = _weights(4, 32, 16, dtype, seed=62)
    x = _hidden(5, 32, dtype, seed=63)
    routed = triton_experts(x, w13, w2, weights, ids, defer_sum=True)
    assert isinstance(routed, RoutedRows) and routed.rows.shape == (5 * 2, 32)
    summed = weighted_sum(routed)
    assert torch.equal(summed, triton_experts(x, w13, w2, weights, ids))
    norm_weight = (torch.rand(32, generator=torch.Generator().manual_seed(64)) + 0.5).to(dtype)
    residual = _hidden(5, 32, dtype, seed=65)
    out, new_residual = rms_norm_of_expert_sum(*routed, norm_weight, 1e-6, residual)
    want_out, want_residual = rms_norm(summed, norm_weight, 1e-6, residual)
    assert torch.equal(out, want_out) and torch.equal(new_residual, want_residual)
    # and quantized to FP8 in the same launch, as for a per-channel FP8 layer after it
    experts = (routed.weights, routed.ids, routed.num_experts)
    rows, quantized_residual = rms_norm_quantize(routed.rows, norm_weight, 1e-6, residual, experts)
    want_rows, _ = rms_norm_quantize(summed, norm_weight, 1e-6, residual)
    assert torch.equal(rows.q.view(torch.uint8), want_rows.q.view(torch.uint8))
    assert torch.equal(rows.scale, want_rows.scale)
    assert torch.equal(quantized_residual, want_residual)


def test_the_fp8_norm_of_decode_rows_in_pieces_sums_their_experts():
    """Decode rows wider than a piece (2,500 columns) take the FP8 norm a program a piece: with
    their expert rows it gives the weighted sum's launch then the same norm, bit for bit."""
    weights, ids = _routing(3, 2, 4, seed=91, foreign=1)
    routed = RoutedRows(_hidden(3 * 2, 2500, torch.bfloat16, seed=92), weights, ids, 4)
    norm_weight = (torch.rand(2500, generator=torch.Generator().manual_seed(93)) + 0.5).bfloat16()
    residual = _hidden(3, 2500, torch.bfloat16, seed=94)
    experts = (routed.weights, routed.ids, routed.num_experts)
    rows, new_residual = rms_norm_quantize(routed.rows, norm_weight, 1e-6, residual, experts)
    want_rows, want_residual = rms_norm_quantize(weighted_sum(routed), norm_weight, 1e-6, residual)
    assert torch.equal(rows.q.view(torch.uint8), want_rows.q.view(torch.uint8))
    assert torch.equal(rows.scale, want_rows.scale)
    assert torch.equal(new_residual, want_residual)


def test_a_moe_block_hands_the_next_norm_its_rows(monkeypatch):
    """On the kernels' device a MoE block's sorted route hands its rows unsummed to the RMSNorm
    after it, which gives the summed rows' numbers with a residual, and sums them first without
    one; at pair-route token counts the block's output comes summed."""
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    block = SparseMoeBlock(32, FusedMoE(4, 32, 16, 2, True, TPPlace()))
    with torch.no_grad():
        for param, seed in zip(block.parameters(), range(70, 80), strict=False):
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
    norm = RMSNorm(32)
    norm.weight.data.copy_(torch.rand(32, generator=torch.Generator().manual_seed(81)) + 0.5)
    x, residual = _hidden(5, 32, torch.float32, seed=82), _hidden(5, 32, torch.float32, seed=83)
    with torch.no_grad():
        routed = block(x)
        assert isinstance(routed, RoutedRows)
        got = norm(routed, residual)
        want = norm(weighted_sum(routed), residual)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(norm(routed), norm(weighted_sum(routed)))
        assert isinstance(block(x[:1]), torch.Tensor)


def test_a_tiny_moe_model_on_the_kernels_matches_native(monkeypatch, tmp_path):
    """A 2-layer Qwen3-MoE (8 experts, top 2), dummy float32 weights, through the kernels: a
    prefill of 15 tokens and a decode step of 3 (both past the pair route) give the native
    route's logits, each layer's rows summed by the norm after it (the next layer's input norm,
    then the final norm) in its launch."""
    from replaylm.layers.kernels import rmsnorm as norm_module

    from model_parity import scripted_logits, tiny_dummy_runner

    shape = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    runner = tiny_dummy_runner(tmp_path, "qwen3-30b-a3b.json", shape)
    with native_only():
        want = scripted_logits(runner, prompt_lens=(5, 9, 1), decode_steps=1)
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    calls: list[int] = []
    fused = norm_module.rms_norm_of_expert_sum

    def counted(*args, **kwargs):
        calls.append(args[2].shape[0])
        return fused(*args, **kwargs)

    monkeypatch.setattr(norm_module, "rms_norm_of_expert_sum", counted)
    got = scripted_logits(runner, prompt_lens=(5, 9, 1), decode_steps=1)
    assert calls == [15, 15, 3, 3]  # per forward: layer 1's input norm and the final norm
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
