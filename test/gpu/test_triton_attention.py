"""Triton attention kernels against torch_native (float32 reference) on the GPU.

Fresh random inputs per case, every KV slot random (a wrong slot shows), shuffled slots and
request rows, outputs poisoned with NaN before each run. Relative error by norm, under
1e-2 for bf16, 2e-3 for fp16, 1e-5 for fp32. Then decode captured in a CUDA graph through the
backend's hooks, replayed with other lengths, rows and padding: equal to eager, bit for bit.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from replaylm.layers.attention.triton import TritonAttnBackend
from replaylm.layers.attention.triton.decode import (
    decode_workspace,
    num_kv_splits,
    starts_longest_first,
)
from replaylm.layers.attention.triton.extend import extend_attention
from replaylm.layers.attention.triton.kv_store import store_kv
from replaylm.model_executor.forward_batch import ForwardMode

from attention_cases import (
    make_case,
    reference,
    rel_error,
    store_and_attend,
    triton_decode,
    triton_extend,
)

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _lens(seed: int, n: int, low: int, high: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "NaN/inf in the output: a row was not written"
    err = rel_error(out, ref)
    print(f"rel error {err:.2e}")
    assert err < TOL[dtype]


DECODE_CASES = {  # name: (context lengths, heads, kv heads, head dim, dtype)
    "bs1-ctx8192-gqa8": ([8192], 16, 2, 128, BF16),
    "bs1-ctx1-mha": ([1], 8, 8, 64, BF16),
    "bs7-odd-ctx-gqa2-fp16": ([1, 2, 3, 255, 257, 1000, 4097], 8, 4, 64, FP16),
    "bs64-ctx-to-8192-gqa4": (_lens(1, 64, 1, 8192), 16, 4, 128, BF16),
    "bs33-gqa4-d128": (_lens(2, 33, 1, 3000), 32, 8, 128, BF16),
    "bs16-gqa1-d64": (_lens(3, 16, 100, 2000), 4, 4, 64, BF16),
    "bs5-d256": (_lens(4, 5, 1, 1500), 8, 2, 256, BF16),
    "bs4-fp32": ([1, 77, 600, 1500], 8, 2, 128, FP32),
}


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_matches_torch_native(name):
    ctx, heads, kv_heads, dim, dtype = DECODE_CASES[name]
    case = make_case(
        ForwardMode.DECODE,
        [c - 1 for c in ctx],
        [1] * len(ctx),
        heads,
        kv_heads,
        dim,
        dtype,
        "cuda",
        seed=len(name),
    )
    b = case.batch
    b.kv.pool.store(0, b.out_cache_loc, case.k, case.v)
    ref = reference(case)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for splits, min_len in [(num_kv_splits(len(ctx), kv_heads, sms), 64), (64, 16), (1, 256)]:
        # one workspace for 20 back-to-back launches: the in-kernel merge of the last arriving
        # split must see every partial and leave the counters at zero, each time; the merge
        # kernel (captured graphs) must write the same output bit for bit
        ws = decode_workspace(case.q, kv_heads, splits)
        outs = []
        for separate in [False] * 20 + [True] * 5:
            out = torch.full_like(case.q, float("nan"))
            triton_decode(
                case, out, splits, min_split_len=min_len, workspace=ws, separate_merge=separate
            )
            outs.append(out)
        _check(outs[0], ref, dtype)
        assert all(torch.equal(o, outs[0]) for o in outs[1:])
        assert torch.count_nonzero(ws.arrivals) == 0


EXTEND_CASES = {  # name: (prefix lengths, new lengths, heads, kv heads, head dim, dtype)
    "one-4096-prompt": ([0], [4096], 16, 8, 128, BF16),
    "ragged-with-prefixes": ([0, 2048, 17, 5000], [1, 512, 1000, 333], 16, 4, 128, BF16),
    "many-prefixes-gqa8": (_lens(5, 16, 1, 3000), _lens(6, 16, 1, 300), 16, 2, 128, BF16),
    "no-prefix-mha-d64-fp16": ([0, 0, 0], [1, 1500, 129], 8, 8, 64, FP16),
    "chunk-on-prefix-d64": ([2048] * 8, [512] * 8, 8, 4, 64, BF16),
    "d256": ([0, 700], [300, 65], 4, 2, 256, BF16),
    "fp32": ([0, 100], [70, 200], 4, 2, 128, FP32),
}


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("name", EXTEND_CASES)
def test_extend_matches_torch_native(name, aligned):
    prefix, new, heads, kv_heads, dim, dtype = EXTEND_CASES[name]
    case = make_case(
        ForwardMode.EXTEND, prefix, new, heads, kv_heads, dim, dtype, "cuda", seed=len(name)
    )
    b = case.batch
    b.kv.pool.store(0, b.out_cache_loc, case.k, case.v)
    out = triton_extend(case, aligned=aligned)
    _check(out, reference(case), dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_store_kv_equals_index_put(dtype):
    k_cache = torch.randn(5000, 8, 128, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(700, 32, 128, device="cuda", dtype=dtype)
    k, v = qkv[:, 16:24], qkv[:, 24:]  # strided views, as a fused qkv projection gives
    loc = torch.randperm(5000, device="cuda")[:700]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[loc], want_v[loc] = k, v
    store_kv(k_cache, v_cache, loc, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_backend_forward_stores_then_attends():
    backend = TritonAttnBackend()
    case = make_case(
        ForwardMode.EXTEND, [0, 300], [50, 20], 16, 8, 128, BF16, "cuda", seed=11, backend=backend
    )
    backend.init_forward_metadata(case.batch)
    out = store_and_attend(backend, case.q, case.k, case.v, case.layer, case.batch)
    _check(out, reference(case), BF16)


def _replay_batch(case, rng: random.Random, live: int, shape: int):
    """A decode batch of `shape` requests over the case's pool and table: `live` requests on
    shuffled rows with new lengths (<= the case's), then padding: seq_len 1 over the zero
    padding row writing KV slot 0, and the last one seq_len 0."""
    b = case.batch
    table = b.kv.req_to_token
    rows = b.req_pool_indices.tolist()
    rng.shuffle(rows)
    full = {
        r: int(s) for r, s in zip(b.req_pool_indices.tolist(), b.seq_lens.tolist(), strict=True)
    }
    rows = rows[:live]
    seq = [rng.randint(1, full[r]) for r in rows]
    loc = [int(table.req_to_token[r, s - 1]) for r, s in zip(rows, seq, strict=True)]
    pad = shape - live
    rows = rows + [table.padding_row] * pad
    seq = seq + ([1] * (pad - 1) + [0] if pad else [])
    loc = loc + [0] * pad

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device="cuda")

    seq_t = t(seq)
    return dataclasses.replace(
        b,
        batch_size=shape,
        seq_lens=seq_t,
        prefix_lens=(seq_t - 1).clamp(min=0),
        extend_seq_lens=t([1] * shape),
        extend_start_loc=t(list(range(shape))),
        req_pool_indices=t(rows),
        out_cache_loc=t(loc),
        seq_lens_cpu=seq,
        extend_seq_lens_cpu=[1] * shape,
    )


def _live(batch, live: int):
    return dataclasses.replace(
        batch,
        batch_size=live,
        seq_lens=batch.seq_lens[:live],
        prefix_lens=batch.prefix_lens[:live],
        extend_seq_lens=batch.extend_seq_lens[:live],
        extend_start_loc=batch.extend_start_loc[:live],
        req_pool_indices=batch.req_pool_indices[:live],
        out_cache_loc=batch.out_cache_loc[:live],
        seq_lens_cpu=batch.seq_lens_cpu[:live],
        extend_seq_lens_cpu=[1] * live,
    )


@pytest.mark.parametrize(("shape", "live"), [(16, 13), (1, 1), (200, 190)])
def test_decode_graph_replay_equals_eager(shape, live):
    """200 requests of 4 KV heads: more programs than the GPU holds, launched longest first from
    an order sorted inside the graph on every replay."""
    rng = random.Random(shape)
    backend = TritonAttnBackend()
    ctx = _lens(shape, shape, 1, 6000)
    case = make_case(
        ForwardMode.DECODE,
        [c - 1 for c in ctx],
        [1] * shape,
        16,
        4,
        128,
        BF16,
        "cuda",
        seed=shape,
        backend=backend,
    )
    q, k, v = case.q.clone(), case.k.clone(), case.v.clone()  # the graph's static inputs
    # the captured batch: its tensors are refreshed in place before each replay, as a graph
    # runner does (the case's own batch keeps the lengths new batches are drawn from)
    names = ("req_pool_indices", "seq_lens", "out_cache_loc")
    captured = dataclasses.replace(case.batch, **{n: getattr(case.batch, n).clone() for n in names})
    backend.init_cuda_graph_state(max_bs=max(32, shape), max_num_tokens=max(32, shape))
    backend.init_forward_metadata_capture_cuda_graph(captured)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        store_and_attend(backend, q, k, v, case.layer, captured)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = store_and_attend(backend, q, k, v, case.layer, captured)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one_slice = num_kv_splits(shape, 4, sms) == 1
    assert (backend._meta.order is not None) == (one_slice and starts_longest_first(shape, 4, sms))
    pool = case.batch.kv.pool
    for _ in range(3):
        batch = _replay_batch(case, rng, live, shape)
        for static in (q, k, v):
            static.copy_(torch.randn(static.shape, device="cuda", dtype=static.dtype))
        keep = torch.ones(pool.k_buffers[0].shape[0], dtype=torch.bool, device="cuda")
        keep[batch.out_cache_loc] = False
        before = pool.k_buffers[0][keep].clone()
        out.fill_(float("nan"))
        for n in names:
            getattr(captured, n).copy_(getattr(batch, n))
        backend.init_forward_metadata_replay_cuda_graph(captured)
        graph.replay()
        replayed = out.clone()
        assert torch.equal(pool.k_buffers[0][keep], before), "padding wrote a live KV slot"
        if shape > live:
            assert torch.equal(replayed[-1], torch.zeros_like(replayed[-1]))  # seq_len 0
        backend.init_forward_metadata(batch)
        eager = store_and_attend(backend, q, k, v, case.layer, batch)
        # padding requests all write and read slot 0, racing: only live rows are defined
        assert torch.equal(replayed[:live], eager[:live])
        live_case = dataclasses.replace(
            case, batch=_live(batch, live), q=q[:live], k=k[:live], v=v[:live]
        )
        _check(replayed[:live], reference(live_case), BF16)


@pytest.mark.parametrize("first", [1, 100, 333, 511])
def test_aligned_extend_does_not_depend_on_how_the_prompt_is_chunked(first):
    """`--deterministic`'s extend: a 600-token prompt attended whole, and as `first` cached
    tokens + the rest: the rest's outputs are bit-equal (keys fold in tiles at fixed positions)."""
    case = make_case(ForwardMode.EXTEND, [0], [600], 16, 8, 128, BF16, "cuda", seed=first)
    b = case.batch
    b.kv.pool.store(0, b.out_cache_loc, case.k, case.v)
    caches = (
        b.kv.pool.k_buffers[0],
        b.kv.pool.v_buffers[0],
        b.kv.req_to_token.req_to_token,
        b.req_pool_indices,
    )

    def attend(start: int, aligned: bool) -> torch.Tensor:
        q, k, v = case.q[start:], case.k[start:], case.v[start:]
        lens = [
            torch.tensor([n], dtype=torch.int32, device="cuda") for n in (start, 600 - start, 0)
        ]
        return extend_attention(
            q,
            k,
            v,
            torch.empty_like(q),
            *caches,
            *lens,
            600 - start,
            case.layer.scaling,
            aligned=aligned,
        )

    whole = attend(0, True)
    assert rel_error(whole, reference(case)) < 1e-2
    assert torch.equal(attend(first, True), whole[first:])
    print(
        f"unaligned chunked vs whole bit-equal: "
        f"{torch.equal(attend(first, False), attend(0, False)[first:])}"
    )
