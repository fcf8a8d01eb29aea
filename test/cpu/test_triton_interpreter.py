"""The Triton attention kernels on the CPU, through Triton's interpreter, at small sizes.

Same kernels as on the GPU (test/gpu/test_triton_attention.py covers bf16, big shapes and graph
capture), checked against torch_native in float32. float16 and float32 only: the 3.6
interpreter's bf16 dot is wrong. Small tiles are passed where the defaults would hide the
multi-block paths at these sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_interpreter import require_triton_interpreter, scalar_loop_bounds

require_triton_interpreter()

from replaylm.layers.attention.triton import TritonAttnBackend  # noqa: E402
from replaylm.layers.attention.triton.backend import DETERMINISTIC_SPLITS  # noqa: E402
from replaylm.layers.attention.triton.common import KernelConfig  # noqa: E402
from replaylm.layers.attention.triton.decode import (  # noqa: E402
    CONFIG,
    FEW_KV_HEADS_CONFIG,
    FP8_CONFIG,
    MAX_RUN,
    decode_attention,
    decode_workspace,
    launch_config,
    longest_first,
    starts_longest_first,
)
from replaylm.layers.attention.triton.kv_store import store_kv  # noqa: E402
from replaylm.model_executor.forward_batch import ForwardMode  # noqa: E402
from replaylm.server_args import MAX_SPECULATIVE_STEPS, ServerArgs  # noqa: E402

from attention_cases import (  # noqa: E402
    make_case,
    reference,
    rel_error,
    store_and_attend,
    triton_decode,
    triton_extend,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
SMALL_TILES = KernelConfig(block_n=16, num_warps=4, num_stages=1, block_m=32)
DECODE_TILES = KernelConfig(block_n=16, num_warps=4, num_stages=1)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_scalar_index():
    with scalar_loop_bounds():
        yield


def _store(case) -> None:
    case.batch.kv.pool.store(0, case.batch.out_cache_loc, case.k, case.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "splits"),
    [(4, 4, 16, 4), (4, 2, 32, 4), (8, 1, 16, 4), (6, 2, 16, 3)],
)
def test_decode_split_k_matches_reference(dtype, heads, kv_heads, dim, splits):
    """Groups and slice counts that are not powers of two included (the merge pads both)."""
    case = make_case(
        ForwardMode.DECODE,
        [0, 16, 99, 250],
        [1] * 4,
        heads,
        kv_heads,
        dim,
        dtype,
        "cpu",
        seed=heads + dim,
    )
    _store(case)
    out = torch.full_like(case.q, float("nan"))
    triton_decode(case, out, splits, min_split_len=16, config=DECODE_TILES)
    assert rel_error(out, reference(case)) < TOL[dtype]


@pytest.mark.parametrize(("heads", "kv_heads", "splits"), [(4, 2, 4), (6, 2, 3), (8, 1, 2)])
def test_decode_separate_merge_equals_the_single_launch(heads, kv_heads, splits):
    """The merge kernel (captured graphs) writes the single launch's output bit for bit: one
    slice, several, slices past the end and an empty sequence, over a workspace of NaNs (no
    stale partial may leak into a merge)."""
    case = make_case(
        ForwardMode.DECODE,
        [0, 9, 40, 99, 250],
        [1] * 5,
        heads,
        kv_heads,
        16,
        torch.float16,
        "cpu",
        seed=heads + splits,
    )
    _store(case)
    seq_lens = case.batch.seq_lens.clone()
    seq_lens[0] = 0
    outs = []
    for separate in (False, True):
        ws = decode_workspace(case.q, kv_heads, splits)
        ws.mid_o.fill_(float("nan"))
        ws.mid_lse.fill_(float("nan"))
        out = torch.full_like(case.q, float("nan"))
        triton_decode(
            case,
            out,
            splits,
            seq_lens,
            min_split_len=16,
            config=DECODE_TILES,
            workspace=ws,
            separate_merge=separate,
        )
        outs.append(out)
    assert torch.equal(outs[0][0], torch.zeros_like(outs[0][0]))
    assert not torch.isnan(outs[1]).any()
    assert torch.equal(outs[1], outs[0])
    assert rel_error(outs[1][1:], reference(case)[1:]) < TOL[torch.float16]


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_in_longest_first_order_equals_request_order(splits):
    """Programs started longest first (a large batch's launch) write every request's output
    where request order writes it, bit for bit: one slice (the large-batch case) and several
    (with the single launch's arrival counters)."""
    case = make_case(
        ForwardMode.DECODE, [7, 250, 0, 99, 40], [1] * 5, 4, 2, 16, torch.float16, "cpu", seed=2
    )
    _store(case)
    seq_lens = case.batch.seq_lens
    order = longest_first(seq_lens)
    assert seq_lens[order].tolist() == sorted(seq_lens.tolist(), reverse=True)
    outs = []
    for launch_order in (None, order):
        out = torch.full_like(case.q, float("nan"))
        triton_decode(case, out, splits, min_split_len=16, config=DECODE_TILES, order=launch_order)
        outs.append(out)
    assert torch.equal(outs[1], outs[0])
    assert rel_error(outs[1], reference(case)) < TOL[torch.float16]


def test_one_slice_over_few_kv_heads_takes_blocks_of_128_keys_longest_first():
    """A one-slice launch of one row a program over at most 4 KV heads of a 16-bit cache, heads
    of at most 128, takes FEW_KV_HEADS_CONFIG and starts longest first; split launches, verify
    rows, more KV heads, wider heads and an fp8 cache keep their launches."""
    f16, fp8 = torch.float16, torch.float8_e4m3fn
    assert launch_config(f16, f16, 4, 128, 1, 1) == FEW_KV_HEADS_CONFIG
    assert launch_config(f16, f16, 4, 128, 2, 1) == CONFIG
    assert launch_config(f16, f16, 4, 128, 1, 4) == CONFIG
    assert launch_config(f16, f16, 8, 128, 1, 1) == CONFIG
    assert launch_config(f16, f16, 4, 256, 1, 1) == CONFIG
    assert launch_config(f16, fp8, 4, 128, 1, 1) == FP8_CONFIG
    assert starts_longest_first(2, 4, 132) and not starts_longest_first(66, 8, 132)
    assert starts_longest_first(67, 8, 132)
    # the default launch: blocks of 128 keys, the last one masked, across two blocks and one
    case = make_case(
        ForwardMode.DECODE, [300, 4, 129, 0], [1] * 4, 8, 2, 32, torch.float16, "cpu", seed=8
    )
    _store(case)
    out = torch.full_like(case.q, float("nan"))
    triton_decode(case, out, 1, order=longest_first(case.batch.seq_lens))
    assert rel_error(out, reference(case)) < TOL[torch.float16]


def _verify_rows(case, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An EXTEND case's tokens as a verify step's decode rows (each over its request's table
    row, its length ending at its token), then `padding` rows of length 1 over one row."""
    b = case.batch
    rows, lens = [], []
    for row, prefix, n in zip(
        b.req_pool_indices.tolist(), b.prefix_lens.tolist(), b.extend_seq_lens.tolist(), strict=True
    ):
        rows += [row] * n
        lens += range(prefix + 1, prefix + n + 1)
    rows += [b.req_pool_indices[0].item()] * padding
    lens += [1] * padding
    return torch.tensor(rows), torch.tensor(lens)


@pytest.mark.parametrize(("rows_per_program", "splits"), [(4, 1), (4, 3), (2, 4), (8, 2)])
@pytest.mark.parametrize("separate", [False, True])
def test_verify_rows_taken_together_match_one_at_a_time(rows_per_program, splits, separate):
    """A verify step's runs (4, 1 and 3 rows, one longer than `rows_per_program` where it is 2)
    and padding rows attended `rows_per_program` at a time: every row as the decode kernel
    gives it alone, slices past a short row's end and runs split over programs included."""
    case = make_case(
        ForwardMode.EXTEND, [40, 0, 70], [4, 1, 3], 4, 2, 16, torch.float32, "cpu", seed=5
    )
    _store(case)
    req_rows, seq_lens = _verify_rows(case, padding=2)
    q = torch.cat([case.q, case.q[:2]])
    outs = []
    for rows in (1, rows_per_program):
        out = torch.full_like(q, float("nan"))
        decode_attention(
            q,
            case.batch.kv.pool.k_buffers[0],
            case.batch.kv.pool.v_buffers[0],
            case.batch.kv.req_to_token.req_to_token,
            req_rows,
            seq_lens,
            out,
            case.layer.scaling,
            splits,
            min_split_len=16,
            config=DECODE_TILES,
            separate_merge=separate,
            rows_per_program=rows,
        )
        outs.append(out)
    assert not torch.isnan(outs[1]).any()
    assert rel_error(outs[1], outs[0]) < TOL[torch.float32]
    assert rel_error(outs[0][:8], reference(case)) < TOL[torch.float32]


def test_the_longest_verify_run_fits_the_kernels_look_back():
    assert MAX_RUN.value == MAX_SPECULATIVE_STEPS + 1
    with pytest.raises(ValueError, match="is above 63"):
        ServerArgs(speculative_algorithm="ngram", speculative_num_steps=64).validate()


def test_backend_orders_one_slice_batches_at_the_first_layer():
    """A batch of one slice per request is launched longest first, the order sorted by the
    forward's first layer from the lengths of that step."""
    backend = TritonAttnBackend()
    case = make_case(
        ForwardMode.DECODE,
        [12, 0, 40],
        [1] * 3,
        4,
        2,
        32,
        torch.float32,
        "cpu",
        seed=4,
        backend=backend,
    )
    backend.init_forward_metadata(case.batch)
    assert backend._meta.num_splits == 1  # the interpreter's one "multiprocessor"
    out = store_and_attend(backend, case.q, case.k, case.v, case.layer, case.batch)
    assert backend._meta.order.tolist() == [2, 0, 1]
    assert rel_error(out, reference(case)) < 1e-5


def test_decode_of_an_empty_sequence_is_zero():
    case = make_case(ForwardMode.DECODE, [5, 0], [1, 1], 4, 2, 16, torch.float32, "cpu", seed=3)
    _store(case)
    seq_lens = case.batch.seq_lens.clone()
    seq_lens[1] = 0
    out = torch.full_like(case.q, float("nan"))
    triton_decode(case, out, 2, seq_lens)
    assert rel_error(out[0], reference(case)[0]) < 1e-5
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_decode_workspace_is_reusable_across_launches():
    """The last program of a split request merges and zeroes its arrival counter, so one
    workspace serves launch after launch (every layer of a step), whichever requests split."""
    case = make_case(
        ForwardMode.DECODE, [3, 120, 60], [1] * 3, 4, 2, 16, torch.float32, "cpu", seed=5
    )
    _store(case)
    ws = decode_workspace(case.q, 2, num_splits=4)
    want = reference(case)
    for lens in ([4, 121, 61], [121, 4, 1], [4, 121, 61]):
        seq_lens = torch.tensor(lens)
        out = torch.full_like(case.q, float("nan"))
        triton_decode(case, out, 4, seq_lens, min_split_len=16, config=DECODE_TILES, workspace=ws)
        assert torch.count_nonzero(ws.arrivals) == 0
        if lens == [4, 121, 61]:
            assert rel_error(out, want) < 1e-5
        else:
            assert not torch.isnan(out).any()


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("prefix", "extend", "heads", "kv_heads"),
    [
        ([0], [70], 2, 2),
        ([0, 40, 3], [33, 1, 50], 4, 2),
        ([90, 0], [17, 64], 8, 2),
    ],
)
def test_extend_matches_reference(dtype, prefix, extend, heads, kv_heads, aligned):
    case = make_case(
        ForwardMode.EXTEND,
        prefix,
        extend,
        heads,
        kv_heads,
        16,
        dtype,
        "cpu",
        seed=sum(prefix) + sum(extend),
    )
    _store(case)
    out = triton_extend(case, config=SMALL_TILES, aligned=aligned)
    assert rel_error(out, reference(case)) < TOL[dtype]


def test_store_kv_writes_only_the_given_slots():
    k_cache = torch.randn(20, 2, 16, dtype=torch.float16)
    v_cache = torch.randn(20, 2, 16, dtype=torch.float16)
    qkv = torch.randn(3, 6, 16, dtype=torch.float16)  # k and v as strided views, as models give
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    loc = torch.tensor([7, 1, 12])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[loc], want_v[loc] = k, v
    store_kv(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_deterministic_backend_splits_decode_whatever_the_batch_size():
    def splits(backend: TritonAttnBackend, bs: int) -> int:
        case = make_case(
            ForwardMode.DECODE,
            [5] * bs,
            [1] * bs,
            4,
            2,
            16,
            torch.float32,
            "cpu",
            seed=bs,
            backend=backend,
        )
        backend.init_forward_metadata(case.batch)
        return backend._meta.num_splits

    deterministic = TritonAttnBackend(deterministic=True)
    assert splits(deterministic, 1) == splits(deterministic, 9) == DETERMINISTIC_SPLITS
    assert TritonAttnBackend().deterministic is False


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_backend_stores_then_attends(mode, deterministic):
    backend = TritonAttnBackend(deterministic)
    extend = [1, 1, 1] if mode is ForwardMode.DECODE else [9, 30, 2]
    case = make_case(
        mode, [12, 0, 40], extend, 4, 2, 32, torch.float32, "cpu", seed=7, backend=backend
    )
    backend.init_forward_metadata(case.batch)
    out = store_and_attend(backend, case.q, case.k, case.v, case.layer, case.batch)
    assert rel_error(out, reference(case)) < 1e-5


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_mixed_batch_decodes_its_first_requests(deterministic):
    """A mixed step: decode tokens (one each, first) with prefill chunks after them, attended
    through the decode kernel and the extend kernel in one call, equal the reference."""
    backend = TritonAttnBackend(deterministic)
    case = make_case(
        ForwardMode.EXTEND,
        [12, 70, 0, 33],
        [1, 1, 17, 5],
        4,
        2,
        32,
        torch.float32,
        "cpu",
        seed=11,
        backend=backend,
    )
    batch = dataclasses.replace(case.batch, num_decode=2)
    backend.init_forward_metadata(batch)
    assert backend._meta.decode.num_splits == backend._num_splits(2, batch)
    out = store_and_attend(backend, case.q, case.k, case.v, case.layer, batch)
    assert rel_error(out, reference(case)) < 1e-5


def test_graph_metadata_reads_the_captured_batchs_tensors_in_place():
    """Decode metadata captured for a batch reads that batch's tensors in place: what the graph
    runner writes there after the capture (and the replay hook, which copies nothing) is what the
    attention uses. The captured path (slices merged by a kernel of their own) computes eager
    decode's numbers exactly."""
    backend = TritonAttnBackend()
    case = make_case(
        ForwardMode.DECODE,
        [12, 5, 40],
        [1, 1, 1],
        4,
        2,
        32,
        torch.float32,
        "cpu",
        seed=7,
        backend=backend,
    )
    live = case.batch
    names = ("req_pool_indices", "seq_lens", "out_cache_loc")
    static = dataclasses.replace(live, **{n: torch.zeros(3, dtype=torch.int64) for n in names})
    backend.init_cuda_graph_state(8, 8)
    backend.init_forward_metadata_capture_cuda_graph(static)
    backend.init_forward_metadata_replay_cuda_graph(static)
    assert all(not getattr(static, n).any() for n in names)  # the hook copied nothing
    for n in names:  # what a graph runner does before a replay
        getattr(static, n).copy_(getattr(live, n))
    out = store_and_attend(backend, case.q, case.k, case.v, case.layer, static)
    assert rel_error(out, reference(case)) < 1e-5
    backend.init_forward_metadata(live)
    assert torch.equal(store_and_attend(backend, case.q, case.k, case.v, case.layer, live), out)
