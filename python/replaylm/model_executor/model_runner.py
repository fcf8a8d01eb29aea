"""ModelRunner: owns the model, the KV memory, the attention backend and the sampler.

`forward(batch) -> logits` is the single entry for a forward pass: replayed from the phase's
CUDA graph when its graph runner can run the batch, eager otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from replaylm.distributed.communication import min_over_ranks
from replaylm.distributed.parallel_state import TPPlace, init_tensor_parallel
from replaylm.distributed.peer_all_reduce import choose_all_reduce
from replaylm.distributed.sharding import HeadShard, check_model_split
from replaylm.layers.attention.layer import attention_layers
from replaylm.layers.attention.registry import create_phase_backends
from replaylm.layers.attention.selection import resolve_phase_backends
from replaylm.layers.kernels import (
    check_pdl,
    choose_pdl,
    pdl_supported,
    set_pdl,
    use_triton_kernels,
)
from replaylm.layers.linear import AUTO_SKINNY_MAX_BYTES, set_matmul
from replaylm.layers.logit_adjust import LogitAdjuster, LogitAdjustments
from replaylm.layers.sampler import RankZeroSampler, Sampler, SamplingBatchInfo
from replaylm.mem_cache.kv_pool import KVPool
from replaylm.mem_cache.req_to_token_pool import ReqToTokenPool
from replaylm.mem_cache.token_allocator import TokenSlotAllocator
from replaylm.model_executor.cuda_graph.backend.factory import create_graph_backend
from replaylm.model_executor.cuda_graph.config import resolve_cuda_graph_config
from replaylm.model_executor.cuda_graph.runner.base import BaseCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.decode import DecodeCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.prefill import PrefillCudaGraphRunner
from replaylm.model_executor.forward_batch import ForwardBatch
from replaylm.model_executor.forward_stats import ForwardStats
from replaylm.model_executor.packed_inputs import DecodeInputs
from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.loader import load_model, load_model_config
from replaylm.runtime.triton_key import hash_triton_in_background
from replaylm.server_args import ServerArgs, default_max_running_requests
from replaylm.startup_stages import StartupStages
from replaylm.utils import loading_threads, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on CPU when --max-total-tokens is not given
GRAPH_RUNNERS: dict[str, type[BaseCudaGraphRunner]] = {
    "decode": DecodeCudaGraphRunner,
    "prefill": PrefillCudaGraphRunner,
}


def _default_running_cap(device: torch.device) -> int:
    """--max-running-requests when not given: by the GPU's memory (logged), 256 on the CPU."""
    memory = None
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    cap = default_max_running_requests(memory)
    where = f"a GPU of {memory / 2**30:.0f} GiB" if memory is not None else str(device)
    logger.info("max running requests: %d (the default for %s)", cap, where)
    return cap


class ModelRunner:
    """Loads the model and sizes memory at construction; then runs forward passes and sampling.

    `stages`: the start-up stages of the process it loads in, marked as it goes (default: its
    own, from its construction on), kept as `startup`. `tp_rank`: this process's rank of
    `--tp-size` (which joins the group, at `args.dist_init_addr`, before the model loads)."""

    def __init__(
        self, args: ServerArgs, stages: StartupStages | None = None, tp_rank: int = 0
    ) -> None:
        self.startup = stages or StartupStages("model runner")
        self.device = resolve_device(args.device)
        if self.device.type == "cuda" and args.tp_size > 1:  # one GPU per rank of a node
            self.device = torch.device("cuda", tp_rank % args.ranks_per_node)
            torch.cuda.set_device(self.device)
        self.max_running_requests = args.max_running_requests or _default_running_cap(self.device)
        self.args = args = dataclasses.replace(args, max_running_requests=self.max_running_requests)
        check_pdl(args.enable_pdl is True, self.device)
        # before the model loads: a flag that does not suit the device fails the start at once
        self.cuda_graphs = resolve_cuda_graph_config(args, self.device.type)
        all_reduce, why = choose_all_reduce(
            args.tp_all_reduce, self.device, args.tp_size, args.ranks_per_node
        )
        if all_reduce == "one-shot" and self.device.type != "cuda":
            raise ValueError(
                f"--tp-all-reduce one-shot needs CUDA GPUs (peer memory); on {self.device} "
                "the ranks sum with gloo (--tp-all-reduce nccl)"
            )
        backends = resolve_phase_backends(
            args.attention_backend, args.prefill_attention_backend, self.device.type
        )
        self.attn_backend = create_phase_backends(backends, args.deterministic)
        if self.device.type == "cuda":  # the CUDA context, made here to be a stage of its own
            torch.zeros(1, device=self.device)
            # the Engine's, beside its model's loading (a scheduler process started it earlier)
            hash_triton_in_background()
        self.startup.mark("device init")
        path = resolve_model_path(args.model_path)
        self.config = load_model_config(path)
        self.dtype = resolve_dtype(args.dtype, self.device, self.config.torch_dtype)
        self.tp = TPPlace(tp_rank, args.tp_size)
        if args.tp_size > 1:
            cfg = self.config
            check_model_split(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.intermediate_size,
                self.tp.size,
            )
            assert args.dist_init_addr is not None  # the launcher picks one
            init_tensor_parallel(
                tp_rank,
                args.tp_size,
                args.dist_init_addr,
                self.device,
                one_shot_dtype=self.dtype if all_reduce == "one-shot" else None,
            )
            logger.info("tensor-parallel sums: %s (%s)", all_reduce, why)
        self.startup.mark("model config")
        with loading_threads(self.device):
            self.model = load_model(
                path,
                self.config,
                args.load_format,
                self.dtype,
                self.device,
                args.seed,
                self.startup,
            )
        self.attn_backend.init_model(attention_layers(self.model), self.dtype)
        self.matmul = "invariant" if args.deterministic else args.small_batch_matmul
        if args.deterministic and args.small_batch_matmul != "auto":
            logger.warning(
                "--deterministic overrides --small-batch-matmul %s: every matmul runs "
                "the batch-invariant kernel",
                args.small_batch_matmul,
            )
        layers = set_matmul(self.model, self.matmul)
        # the layers' own test, on a weight: where it fails they run their torch code, whatever
        # kernel set_matmul chose
        triton_kernels = use_triton_kernels(next(self.model.parameters()))
        if not triton_kernels:
            logger.info("matmuls and fused ops: torch code on %s", self.device)
        elif self.matmul == "auto":
            logger.info(
                "--small-batch-matmul auto: the skinny triton kernel for %d matmul layers "
                "(the LM head and weights up to %d MiB), cuBLAS for %d (larger weights)",
                layers["triton"],
                AUTO_SKINNY_MAX_BYTES // 2**20,
                layers["cublas"],
            )
        self.pdl, why = choose_pdl(args.enable_pdl, pdl_supported(self.device))
        set_pdl(self.pdl)  # before any Triton kernel is launched (or captured)
        if self.device.type == "cuda":  # PDL is a launch mode of CUDA kernels only
            logger.info("programmatic dependent launch %s (%s)", "on" if self.pdl else "off", why)
        self.context_len = args.context_length or self.config.max_position_embeddings
        with loading_threads(self.device):
            self._init_memory()
        self.startup.mark("KV allocation")
        self.sampler = Sampler() if self.tp.size == 1 else RankZeroSampler()
        # penalty state per request-table row, allocated when a penalised request first comes
        self.logit_adjuster = LogitAdjuster(
            self.max_running_requests, self.config.vocab_size, self.device
        )
        logger.info(
            "model runner ready: %s on %s%s, KV cache %d tokens (%.2f GiB), attention %s, "
            "matmul %s%s%s",
            self.dtype,
            self.device,
            f" (tensor-parallel rank {tp_rank} of {args.tp_size})" if args.tp_size > 1 else "",
            self.max_total_tokens,
            self.kv_pool.memory_bytes() / 2**30,
            backends.describe(),
            self.matmul if triton_kernels else "torch",
            ", programmatic dependent launch" if self.pdl else "",
            " (--deterministic: batch-invariant kernels)" if args.deterministic else "",
        )
        self.forward_stats = ForwardStats()
        self.startup.mark("runner setup")
        self.graph_runners = self._capture_cuda_graphs()

    def _capture_cuda_graphs(self) -> dict[str, BaseCudaGraphRunner]:
        """One graph runner per enabled phase, captured now: a start-up stage each (with the
        compile under tc_piecewise, whose seconds `cuda_graph_stats` gives apart)."""
        logger.info("CUDA graphs: %s", self.cuda_graphs.summary())
        runners: dict[str, BaseCudaGraphRunner] = {}
        for phase, runner_cls in GRAPH_RUNNERS.items():
            phase_config = self.cuda_graphs.phase(phase)
            if phase_config.enabled:
                backend = create_graph_backend(
                    phase, phase_config.mode, self.attn_backend, self.args
                )
                runners[phase] = runner_cls(self, backend, phase_config.shapes)
                runners[phase].capture()
                compiled = runners[phase].stats()["compile_s"] is not None
                self.startup.mark(f"{'compile and capture' if compiled else 'capture'} {phase}")
        return runners

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

    def _kv_heads(self) -> int:
        """KV heads this rank holds (all of them without tensor parallelism)."""
        cfg = self.config
        return HeadShard.for_rank(
            cfg.num_attention_heads, cfg.num_key_value_heads, self.tp
        ).kv_heads

    def _kv_budget_tokens(self) -> int:
        cfg = self.config
        per_token = KVPool.bytes_per_token(
            cfg.num_hidden_layers, self._kv_heads(), cfg.head_dim, self.dtype
        )
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES // per_token
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.args.mem_fraction_static - (total - free)
        if budget < per_token:
            raise RuntimeError(
                f"--mem-fraction-static {self.args.mem_fraction_static} leaves no room for the KV "
                f"cache after the weights ({(total - free) / 2**30:.1f} GiB used of "
                f"{total / 2**30:.1f} GiB); raise it"
            )
        tokens = int(budget // per_token)
        # every rank's scheduler must see the same pool: the smallest any rank can hold
        return tokens if self.tp.size == 1 else min_over_ranks(tokens)

    def _init_memory(self) -> None:
        cfg = self.config
        budget = self._kv_budget_tokens()
        self.max_total_tokens = min(budget, self.args.max_total_tokens or budget)
        self.kv_pool = KVPool(
            self.max_total_tokens,
            cfg.num_hidden_layers,
            self._kv_heads(),
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.token_allocator = TokenSlotAllocator(self.max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, self.context_len, self.device
        )

    def decode_inputs(self, batch_size: int) -> DecodeInputs | None:
        """Where a decode batch of `batch_size` requests is best built (`ForwardBatch.create`'s
        `into`): the inputs of the decode graph that will replay it, so the replay copies
        nothing; None without decode graphs or beyond their largest shape."""
        graphs = self.graph_runners.get("decode")
        return graphs.inputs_for(batch_size) if isinstance(graphs, DecodeCudaGraphRunner) else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Next-token logits `[B, V]` (float32) for every request of the batch: replayed from
        the phase's CUDA graph when it can run the batch, else eager."""
        phase = "decode" if batch.forward_mode.is_decode() else "prefill"
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

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        steps: torch.Tensor,
        adjust: LogitAdjustments | None = None,
    ) -> torch.Tensor:
        """Next token id per request (`[B]` int64); `steps` = tokens each request generated.
        `adjust` (penalties, logit_bias, min_tokens; see `logit_adjuster`) changes the logits
        the sampler sees, not `logits` itself (logprobs stay the model's), and counts the
        sampled ids for the penalties."""
        if adjust is None:
            return self.sampler(logits, info, steps)
        next_ids = self.sampler(adjust.apply(logits), info, steps)
        adjust.record(next_ids)
        return next_ids
