"""ModelRunner: runs one loaded model's forward passes, from the phase's CUDA graph or eagerly.

It is made from a loaded model, its KV cache and attention backend, and a resolved CUDA-graph
config (`runner_setup.load_model_runner` does the loading, sizing and kernel choices). It
captures one graph runner per enabled phase, builds each batch where the graph that replays it
reads its inputs (`build_batch`), and `forward(batch) -> logits` replays or runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from replaylm.model_executor.cuda_graph.backend.factory import create_graph_backend
from replaylm.model_executor.cuda_graph.runner.base import BaseCudaGraphRunner, RunnerContext
from replaylm.model_executor.cuda_graph.runner.decode import DecodeCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.prefill import PrefillCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.verify import VerifyCudaGraphRunner
from replaylm.model_executor.expert_tokens import ExpertTokenReader
from replaylm.model_executor.forward_batch import ForwardBatch, ForwardMode
from replaylm.model_executor.forward_stats import ForwardStats

if TYPE_CHECKING:
    from replaylm.distributed.parallel_state import TPPlace
    from replaylm.layers.attention.base import AttentionBackend
    from replaylm.mem_cache.kv_cache import KVCache
    from replaylm.model_executor.cuda_graph.config import CudaGraphConfig
    from replaylm.models.config import ModelConfig
    from replaylm.models.llama import LlamaForCausalLM
    from replaylm.startup_stages import StartupStages

GRAPH_RUNNERS: dict[str, type[BaseCudaGraphRunner]] = {
    "decode": DecodeCudaGraphRunner,
    "prefill": PrefillCudaGraphRunner,
    "verify": VerifyCudaGraphRunner,
}


def phase_of(mode: ForwardMode) -> str:
    if mode.is_verify():
        return "verify"
    return "decode" if mode.is_decode() else "prefill"


class ModelRunner:
    """`tp`: this process's place among the tensor-parallel ranks. `expert_tokens`: the reader
    of a mixture-of-experts model's tokens per expert (None for a dense model)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVCache,
        attn_backend: AttentionBackend,
        cuda_graphs: CudaGraphConfig,
        tp: TPPlace,
    ) -> None:
        self.model = model
        self.kv = kv
        self.attn_backend = attn_backend
        self.cuda_graphs = cuda_graphs
        self.tp = tp
        self.device = kv.device
        self.forward_stats = ForwardStats()
        self.expert_tokens = ExpertTokenReader.of(model)
        self.graph_runners: dict[str, BaseCudaGraphRunner] = {}

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def capture_cuda_graphs(self, stages: StartupStages | None = None) -> None:
        """One graph runner per enabled phase, captured now: a start-up stage each (with the
        compile under tc_piecewise, whose seconds `cuda_graph_stats` gives apart)."""
        context = RunnerContext(self.model, self.kv, self.attn_backend)
        for phase, runner_cls in GRAPH_RUNNERS.items():
            phase_config = self.cuda_graphs.phase(phase)
            if not phase_config.enabled:
                continue
            backend = create_graph_backend(
                phase, phase_config.mode, self.attn_backend, self.cuda_graphs.options
            )
            runner = runner_cls(context, backend, phase_config.shapes)
            runner.capture()
            self.graph_runners[phase] = runner
            if stages is not None:
                compiled = runner.stats()["compile_s"] is not None
                stages.mark(f"{'compile and capture' if compiled else 'capture'} {phase}")

    def free_cuda_graphs(self) -> None:
        """Free every captured graph; later steps run eager. Before a tensor-parallel rank
        leaves its group: NCCL's teardown hangs while graphs that captured its collectives
        live (pytorch/pytorch#115388)."""
        for runner in self.graph_runners.values():
            runner.cleanup()
        self.graph_runners = {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def cuda_graph_stats(self) -> dict[str, dict[str, Any]]:
        """Per captured phase: mode, number of shapes, capture seconds, graph memory (MiB) and,
        for tc_piecewise, compile seconds (reported by /get_server_info)."""
        return {phase: runner.stats() for phase, runner in self.graph_runners.items()}

    def build_batch(
        self,
        mode: ForwardMode,
        new_token_ids: list[list[int]],
        prefix_lens: list[int],
        req_pool_indices: list[int],
        out_cache_loc: Sequence[int],
        num_decode: int = 0,
    ) -> ForwardBatch:
        """`ForwardBatch.create` over this model's KV cache and attention backend, built in the
        inputs of the graph that will replay it where one will (so the replay copies nothing),
        else in fresh tensors."""
        graphs = self.graph_runners.get(phase_of(mode))
        into = (
            graphs.inputs_for(mode, len(new_token_ids), len(out_cache_loc))
            if graphs is not None
            else None
        )
        return ForwardBatch.create(
            mode,
            new_token_ids,
            prefix_lens,
            req_pool_indices,
            out_cache_loc,
            self.kv,
            self.attn_backend,
            into,
            num_decode,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Next-token logits `[B, V]` (float32) for every request of the batch (`[T, V]`, every
        token's, for a verify batch): replayed from the phase's CUDA graph when it can run the
        batch, else eager."""
        phase = phase_of(batch.forward_mode)
        runner = self.graph_runners.get(phase)
        if runner is not None and runner.can_run(batch):
            logits, padding = runner.replay(batch)
            self.forward_stats.record(phase, graph=True, padding_tokens=padding)
            return logits
        self.forward_stats.record(phase, graph=False, padding_tokens=0)
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch.input_ids, batch.positions, batch)

    @torch.inference_mode()
    def forward_keeping_hidden(
        self, batch: ForwardBatch, token_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s logits plus the final hidden states of the batch's tokens at
        `token_index` (int64 `[N]`, flat token positions), for prompt logprobs. Always eager:
        graphs keep only what `forward` returns, and the eager pass is the reference anyway."""
        self.forward_stats.record("prefill", graph=False, padding_tokens=0)
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.model.forward_hidden(batch.input_ids, batch.positions, batch)
        return self.model.compute_logits(hidden, batch), hidden.index_select(0, token_index)

    @torch.inference_mode()
    def token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[N, V]` (float32) of every row of `hidden [N, H]`."""
        return self.model.logits_processor.project(hidden, self.model.lm_head_weight)
