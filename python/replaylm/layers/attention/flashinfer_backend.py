"""FlashInferAttnBackend: attention through FlashInfer's kernels (`flashinfer-python`, the `gpu`
extra), capturable in `full` decode graphs.

The KV pool is FlashInfer's paged cache with one token per page (`NHD`: the pool's `[slots, Hkv,
D]` buffers viewed as `[slots, 1, Hkv, D]`); a batch's page table is its requests' slots, gathered
from the request table by one launch (`kv_indices`). Per batch, FlashInfer plans its work on the
host from the lengths, which replaylm already holds there (`seq_lens_cpu`): no device sync.
Prefill of prompts with no cached prefix runs the ragged kernel over the step's own K and V;
prefill after a prefix, and mixed steps, run the paged kernel over prefix and new tokens (K/V
are stored before attention). Decode runs the decode kernel, through tensor cores where a KV
head serves 4 or more query heads (the rule SGLang uses). A `full` decode graph gets one wrapper
per batch size over static buffers, planned again with the live lengths before each replay.
An fp8 KV pool is planned as FlashInfer's fp8 cache (`kv_data_type`), every prefill over it
paged (the new tokens as stored, base.py), each layer's `k_scale` / `v_scale` handed to `run`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch

from replaylm.layers.attention.base import CudaGraphAttentionBackend
from replaylm.layers.attention.kv_indices import kv_indices
from replaylm.layers.attention.triton.kv_store import store_kv

if TYPE_CHECKING:
    from collections.abc import Sequence

    from replaylm.layers.attention.layer import Attention
    from replaylm.model_executor.forward_batch import ForwardBatch

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended split-K workspace, shared by all plans
HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's kernels are built for
TENSOR_CORE_GROUP = 4  # query heads per KV head from which decode runs on tensor cores


@dataclass(frozen=True)
class _Geometry:
    """The model's attention, the same in every layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype

    @property
    def decode_on_tensor_cores(self) -> bool:
        return self.num_heads // self.num_kv_heads >= TENSOR_CORE_GROUP


@dataclass
class _Plan:
    """What every layer of the batch runs: `wrapper.run` over the paged cache, or over the
    step's own K/V (`ragged`)."""

    wrapper: Any
    ragged: bool = False


@dataclass
class _GraphBuffers:
    """Static buffers of the captured decode graphs and one wrapper per captured batch size."""

    indptr: torch.Tensor  # [max_bs + 1] int32
    last_page_len: torch.Tensor  # [max_bs] int32 ones
    indices: torch.Tensor  # [pool slots + max_bs] int32: every slot, and a padding request's
    wrappers: dict[int, Any]


def _pinned(values: list[int]) -> torch.Tensor:
    """An int32 host tensor in pinned memory (a copy from it does not wait for the device)."""
    return torch.tensor(values, dtype=torch.int32, pin_memory=True)


class FlashInferAttnBackend(CudaGraphAttentionBackend):
    """Paged attention through FlashInfer; see the module docstring."""

    name = "flashinfer"

    def __init__(self) -> None:
        import flashinfer  # ImportError without the package: the registry names it

        self._fi = flashinfer
        self._geometry: _Geometry | None = None
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[str, Any] = {}  # eager: decode, ragged, paged
        self._meta: _Plan | None = None
        self._graph_max_bs: int | None = None
        self._graph: _GraphBuffers | None = None  # made at the first capture, which knows the pool
        self._pool: object | None = None  # the pool `_caches` views (compared by identity)
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._ones_host = _pinned([1])

    def init_model(self, layers: Sequence[Attention], dtype: torch.dtype) -> None:
        shapes = {(a.num_heads, a.num_kv_heads, a.head_dim, a.scaling) for a in layers}
        if len(shapes) != 1:
            raise ValueError(
                "--attention-backend flashinfer plans one attention shape per model; its layers "
                f"differ: {sorted(shapes)}"
            )
        heads, kv_heads, head_dim, scaling = shapes.pop()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"--attention-backend flashinfer runs bfloat16 or float16 models, not {dtype}"
            )
        if head_dim not in HEAD_DIMS:
            raise ValueError(
                f"--attention-backend flashinfer serves head dims {HEAD_DIMS}, not {head_dim}"
            )
        self._geometry = _Geometry(heads, kv_heads, head_dim, scaling, dtype)

    # ---- eager ------------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.forward_mode.is_decode_shaped():
            wrapper = self._eager_wrapper("decode", batch)
            indptr, indices = self._page_table(batch, batch.batch_size)
            self._plan_decode(wrapper, indptr, indices, batch.kv.pool.dtype)
            self._meta = _Plan(wrapper)
            return
        geometry = self._model_geometry()
        ext = batch.extend_seq_lens_cpu
        qo_indptr = _pinned(list(accumulate(ext, initial=0)))
        kv_dtype = batch.kv.pool.dtype
        common = {
            "causal": True,
            "sm_scale": geometry.scaling,
            "q_data_type": geometry.dtype,
            "kv_data_type": kv_dtype,
        }
        h, hkv, d = geometry.num_heads, geometry.num_kv_heads, geometry.head_dim
        no_prefix = batch.num_decode == 0 and ext == batch.seq_lens_cpu
        if no_prefix and kv_dtype == geometry.dtype:  # K/V are the step's, as the pool holds them
            wrapper = self._eager_wrapper("ragged", batch)
            wrapper.plan(qo_indptr, qo_indptr, h, hkv, d, **common)
            self._meta = _Plan(wrapper, ragged=True)
            return
        wrapper = self._eager_wrapper("paged", batch)
        kv_indptr, indices = self._page_table(batch, batch.batch_size)
        wrapper.plan(
            qo_indptr, kv_indptr, indices, self._ones(batch.batch_size), h, hkv, d, 1, **common
        )
        self._meta = _Plan(wrapper)

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> None:
        pool = batch.kv.pool
        store_kv(
            pool.k_buffers[layer.layer_id],
            pool.v_buffers[layer.layer_id],
            batch.out_cache_loc,
            k,
            v,
        )

    def kv_store_target(
        self, layer: Attention, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool = batch.kv.pool
        return pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id], batch.out_cache_loc

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        plan = self._plan()
        if plan.ragged:
            return plan.wrapper.run(q, k, v, out=out)
        return self._run_paged(plan, q, layer, batch, out)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
        out: torch.Tensor,
    ) -> torch.Tensor:
        return self._run_paged(self._plan(), q, layer, batch, out)

    def _run_paged(
        self, plan: _Plan, q: torch.Tensor, layer: Attention, batch: ForwardBatch, out: torch.Tensor
    ) -> torch.Tensor:
        """`plan`'s kernel over the layer's paged K/V, with its scales (1.0 but for an fp8
        cache: FlashInfer folds k_scale into the softmax scale, v_scale into the output)."""
        return plan.wrapper.run(
            q,
            self._paged_cache(layer, batch),
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            out=out,
        )

    # ---- CUDA graphs ------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_max_bs = max_bs

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Decode batches only: a wrapper for this batch size over the static buffers, planned
        with the capture batch's lengths."""
        if not batch.forward_mode.is_decode_shaped():
            raise ValueError("flashinfer attention captures decode batches only")
        graph = self._graph_buffers(batch)
        bs = batch.batch_size
        graph.wrappers[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace_for(batch),
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self._model_geometry().decode_on_tensor_cores,
            paged_kv_indptr_buffer=graph.indptr[: bs + 1],
            paged_kv_indices_buffer=graph.indices,
            paged_kv_last_page_len_buffer=graph.last_page_len[:bs],
        )
        self.init_forward_metadata_replay_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Plan the batch size's wrapper with the live lengths (host work, and the page table
        gathered into the static indices), before its graph replays."""
        graph = self._graph_buffers(batch)
        bs = batch.batch_size
        wrapper = graph.wrappers[bs]
        indptr, indices = self._page_table(batch, bs, graph.indptr[: bs + 1], graph.indices)
        self._plan_decode(wrapper, indptr, indices, batch.kv.pool.dtype)
        self._meta = _Plan(wrapper)

    # ---- helpers ----------------------------------------------------------------------------

    def _page_table(
        self,
        batch: ForwardBatch,
        bs: int,
        indptr_out: torch.Tensor | None = None,
        indices_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(host indptr `[bs + 1]`, device indices) of the batch's first `bs` requests' whole
        sequences, into the given device buffers if any (else new ones)."""
        host = list(accumulate(batch.seq_lens_cpu[:bs], initial=0))
        indptr_host = _pinned(host)
        device = batch.seq_lens.device
        if indptr_out is None:
            indptr_out = torch.empty(bs + 1, dtype=torch.int32, device=device)
        indptr_out.copy_(indptr_host, non_blocking=True)
        if indices_out is None:
            indices_out = torch.empty(host[-1], dtype=torch.int32, device=device)
        kv_indices(
            batch.kv.req_to_token.req_to_token,
            batch.req_pool_indices[:bs],
            batch.seq_lens[:bs],
            indptr_out,
            indices_out,
        )
        return indptr_host, indices_out[: host[-1]]

    def _plan_decode(
        self, wrapper: Any, indptr: torch.Tensor, indices: torch.Tensor, kv_dtype: torch.dtype
    ) -> None:
        """Plan decode over pages of `kv_dtype` (the pool's)."""
        g = self._model_geometry()
        wrapper.plan(
            indptr,
            indices,
            self._ones(indptr.shape[0] - 1),
            g.num_heads,
            g.num_kv_heads,
            g.head_dim,
            1,
            sm_scale=g.scaling,
            q_data_type=g.dtype,
            kv_data_type=kv_dtype,
        )

    def _ones(self, n: int) -> torch.Tensor:
        """`n` pinned int32 ones: every page (one token) is full."""
        if self._ones_host.shape[0] < n:
            self._ones_host = _pinned([1] * max(n, 2 * self._ones_host.shape[0]))
        return self._ones_host[:n]

    def _eager_wrapper(self, kind: str, batch: ForwardBatch) -> Any:
        wrapper = self._wrappers.get(kind)
        if wrapper is None:
            workspace = self._workspace_for(batch)
            fi = self._fi
            if kind == "decode":
                tensor_cores = self._model_geometry().decode_on_tensor_cores
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=tensor_cores
                )
            elif kind == "ragged":
                wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
            else:
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self._wrappers[kind] = wrapper
        return wrapper

    def _workspace_for(self, batch: ForwardBatch) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(
                WORKSPACE_BYTES, dtype=torch.uint8, device=batch.seq_lens.device
            )
        return self._workspace

    def _paged_cache(
        self, layer: Attention, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers as FlashInfer's `[pages, 1, Hkv, D]` (views made once per
        pool: a view is host time every layer would pay)."""
        pool = batch.kv.pool
        if pool is not self._pool:
            self._pool = pool
            self._caches = [
                (k.unsqueeze(1), v.unsqueeze(1))
                for k, v in zip(pool.k_buffers, pool.v_buffers, strict=True)
            ]
        return self._caches[layer.layer_id]

    def _graph_buffers(self, batch: ForwardBatch) -> _GraphBuffers:
        max_bs = self._graph_max_bs
        if max_bs is None:
            raise RuntimeError("init_cuda_graph_state was not called")
        if self._graph is None:
            device = batch.seq_lens.device
            slots = batch.kv.pool.k_buffers[0].shape[0]
            self._graph = _GraphBuffers(
                torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
                torch.ones(max_bs, dtype=torch.int32, device=device),
                torch.zeros(slots + max_bs, dtype=torch.int32, device=device),
                {},
            )
        return self._graph

    def _model_geometry(self) -> _Geometry:
        if self._geometry is None:
            raise RuntimeError("init_model was not called")
        return self._geometry

    def _plan(self) -> _Plan:
        if self._meta is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        return self._meta
