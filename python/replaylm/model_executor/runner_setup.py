"""Everything between a resolved EngineConfig and a ModelRunner ready to serve: the device and
its tensor-parallel group, the model loaded, the kernel choices (PDL, matmuls), the KV cache sized
to the memory left, the attention backend, and the CUDA graphs captured. Each step is a start-up
stage; what was chosen is logged with why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from replaylm.device.triton_key import hash_triton_in_background
from replaylm.distributed.communication import min_over_ranks
from replaylm.distributed.parallel_state import TPPlace, init_tensor_parallel
from replaylm.distributed.peer_all_reduce import choose_all_reduce
from replaylm.distributed.sharding import HeadShard, check_model_split
from replaylm.layers.attention.base import AttentionBackend
from replaylm.layers.attention.layer import attention_layers
from replaylm.layers.attention.registry import create_phase_backends
from replaylm.layers.kernels import (
    check_pdl,
    choose_pdl,
    pdl_supported,
    set_pdl,
    use_triton_kernels,
)
from replaylm.layers.linear import AUTO_SKINNY_MAX_BYTES, set_matmul
from replaylm.layers.moe.block_configs import device_name, moe_block_config, set_batch_invariant
from replaylm.layers.moe.layer import FusedMoE
from replaylm.layers.quantization.config import resolve_quantization
from replaylm.layers.quantization.fp8 import FP8_DTYPE
from replaylm.mem_cache.kv_cache import KVCache, KVShape, resolve_kv_cache_dtype
from replaylm.model_executor.draft_heads import attach_head, check_draft, feature_bytes_per_token
from replaylm.model_executor.engine_config import EngineConfig
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.prefill_chunk import prefill_chunk
from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.loader import load_model, load_model_config
from replaylm.models.config import ModelConfig
from replaylm.models.eagle import EagleHead
from replaylm.models.llama import LlamaForCausalLM
from replaylm.models.moe import check_expert_split
from replaylm.models.registry import get_model_class
from replaylm.server_args import ServerArgs
from replaylm.startup_stages import StartupStages
from replaylm.utils import loading_threads, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on CPU when --max-total-tokens is not given


def load_model_runner(
    config: EngineConfig, stages: StartupStages | None = None, tp_rank: int = 0
) -> ModelRunner:
    """Load the model of `config` on this process's device and make its runner (a draft model
    of `config.draft`, if any, is loaded and left out: see `load_model_runners`)."""
    return load_model_runners(config, stages, tp_rank)[0]


def load_model_runners(
    config: EngineConfig, stages: StartupStages | None = None, tp_rank: int = 0
) -> tuple[ModelRunner, ModelRunner | None]:
    """The runner of the model of `config` and, for speculation with a draft model or an EAGLE
    head (`config.draft`), the drafter's, on the same device at tensor-parallel size 1 (every
    rank drafts alike; an EAGLE head's target taps its hidden states for it).
    Both are loaded before the KV budget is sized, so the budget covers both caches, which hold
    the same number of tokens. `stages`: the start-up stages of the process it loads in, marked
    as it goes (default: its own). `tp_rank`: this process's rank of `--tp-size` (which joins
    the group, at `args.dist_init_addr`, before the model loads)."""
    stages = stages or StartupStages("model runner")
    target = _load(config, stages, tp_rank)
    if isinstance(target.model, EagleHead):
        raise ValueError(
            f"{config.args.model_path} is an EAGLE draft head ({target.model.config.architecture})"
            ": serve its target model, with this as --speculative-draft-model-path"
        )
    draft = None
    features_bytes = 0
    if config.draft is not None:
        draft = _load(config.draft, stages, 0, target.device, "draft ")
        args = config.args
        assert args.speculative_algorithm and args.speculative_draft_model_path
        check_draft(
            target.model, draft.model, args.speculative_algorithm, args.speculative_draft_model_path
        )
        if isinstance(draft.model, EagleHead):
            features_bytes = feature_bytes_per_token(draft.model, target.dtype)
    loaded = [target] if draft is None else [target, draft]
    tokens = _kv_budget_tokens(
        config.args, [m.kv_shape for m in loaded], target.tp, target.device, features_bytes
    )
    if draft is not None and isinstance(draft.model, EagleHead):
        chunk, _ = prefill_chunk(config.args.chunked_prefill_size, target.model, config.offline)
        rows = _head_rows(draft.config, chunk)
        attach_head(draft.model, target.model, tokens + 1, rows, target.device)
    runners = [_make_runner(m, tokens, stages) for m in loaded]
    return runners[0], runners[1] if draft is not None else None


def _head_rows(config: EngineConfig, chunk: int) -> int:
    """The most tokens one forward of an EAGLE head runs: a catch-up chunk (at most the
    target's prefill `chunk`; speculative/eagle.py), a batch of the running cap, or a graph's
    shape."""
    shapes = [s for phase in ("decode", "prefill") for s in config.cuda_graphs.phase(phase).shapes]
    assert config.args.max_running_requests is not None
    return max(chunk, config.args.max_running_requests, *shapes)


@dataclass
class _Loaded:
    """A model on its device, its runner not made yet (the KV budget waits for every model)."""

    config: EngineConfig
    model: LlamaForCausalLM
    attn_backend: AttentionBackend
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV pool's: `dtype`, or float8 e4m3 (`--kv-cache-dtype`)
    tp: TPPlace
    kernels: str
    label: str  # "" for the served model, "draft " for a draft model (in stage names and logs)

    @property
    def kv_shape(self) -> KVShape:
        cfg = self.model.config
        shard = HeadShard.for_rank(cfg.num_attention_heads, cfg.num_key_value_heads, self.tp)
        return KVShape(cfg.num_hidden_layers, shard.kv_heads, cfg.head_dim, self.kv_dtype)


def _load(
    config: EngineConfig,
    stages: StartupStages,
    tp_rank: int,
    device: torch.device | None = None,
    label: str = "",
) -> _Loaded:
    """Load `config`'s model: on this rank's device, joining the tensor-parallel group first,
    or (a draft model) on `device`."""
    args = config.args
    if device is None:
        device = _place_device(args, tp_rank)
        check_pdl(args.enable_pdl is True, device)
        if device.type == "cuda":  # the CUDA context, made here to be a stage of its own
            torch.zeros(1, device=device)
            # the Engine's, beside its model's loading (a scheduler process started it earlier)
            hash_triton_in_background()
    attn_backend = create_phase_backends(
        config.attention.decode, config.attention.prefill, args.deterministic
    )
    stages.mark(f"{label}device init")
    path = resolve_model_path(args.model_path)
    model_config = load_model_config(path)
    dtype = resolve_dtype(args.dtype, device, model_config.torch_dtype)
    kv_dtype = _kv_cache_dtype(args, dtype, device)
    if args.deterministic and resolve_quantization(model_config.hf_config, args.quantization):
        raise ValueError(DETERMINISTIC_FP8)
    tp = TPPlace(tp_rank, args.tp_size)
    _join_tensor_parallel(args, model_config, tp, device, dtype)
    stages.mark(f"{label}model config")
    with loading_threads(device):
        model = load_model(
            path,
            model_config,
            args.load_format,
            dtype,
            device,
            args.seed,
            stages,
            args.quantization,
            kv_scales=kv_dtype == FP8_DTYPE,
        )
    attn_backend.init_model(attention_layers(model), dtype)
    kernels = _choose_kernels(args, model, device)
    return _Loaded(config, model, attn_backend, device, dtype, kv_dtype, tp, kernels, label)


DETERMINISTIC_FP8 = (
    "--deterministic does not cover FP8 weights: the FP8 GEMMs (torch._scaled_mm, the "
    "block-scaled Triton GEMM) pick their kernels by batch size"
)
# float8 e4m3 in Triton's kernels (the KV stores and attention): Ada and Hopper or newer
FP8_KV_CAPABILITY = (8, 9)


def _kv_cache_dtype(args: ServerArgs, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype (`--kv-cache-dtype`); ValueError naming the flag for an fp8 cache on
    a GPU whose Triton has no float8 e4m3."""
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    if (
        kv_dtype == FP8_DTYPE
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < FP8_KV_CAPABILITY
    ):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"--kv-cache-dtype {args.kv_cache_dtype} needs a GPU of compute capability 8.9+ "
            f"(Triton's float8 e4m3); {torch.cuda.get_device_name(device)} has {major}.{minor}"
        )
    return kv_dtype


def _make_runner(loaded: _Loaded, kv_tokens: int, stages: StartupStages) -> ModelRunner:
    """The KV cache of `kv_tokens` tokens, the runner, its CUDA graphs captured."""
    config, args, device, label = loaded.config, loaded.config.args, loaded.device, loaded.label
    cfg = loaded.model.config
    assert args.max_running_requests is not None  # resolve_engine_config sets it for the device
    with loading_threads(device):
        kv = KVCache.allocate(
            loaded.kv_shape,
            kv_tokens,
            args.max_running_requests,
            args.context_length or cfg.max_position_embeddings,
            device,
        )
    stages.mark(f"{label}KV allocation")
    logger.info(
        "%smodel runner ready: %s on %s%s, KV cache %d tokens in %s (%.2f GiB), attention %s, %s%s",
        label,
        loaded.dtype,
        device,
        f" (tensor-parallel rank {loaded.tp.rank} of {args.tp_size})" if args.tp_size > 1 else "",
        kv.size,
        kv.pool.dtype,
        kv.pool.memory_bytes() / 2**30,
        config.attention.describe(),
        loaded.kernels,
        " (--deterministic: batch-invariant kernels)" if args.deterministic else "",
    )
    stages.mark(f"{label}runner setup")
    runner = ModelRunner(loaded.model, kv, loaded.attn_backend, config.cuda_graphs, loaded.tp)
    logger.info("%sCUDA graphs: %s", label, config.cuda_graphs.summary())
    runner.capture_cuda_graphs(stages)
    return runner


def _place_device(args: ServerArgs, tp_rank: int) -> torch.device:
    """This process's device: one GPU per rank of a node under tensor parallelism."""
    device = resolve_device(args.device)
    if device.type == "cuda" and args.tp_size > 1:
        device = torch.device("cuda", tp_rank % args.ranks_per_node)
        torch.cuda.set_device(device)
    return device


def _join_tensor_parallel(
    args: ServerArgs, cfg: ModelConfig, tp: TPPlace, device: torch.device, dtype: torch.dtype
) -> None:
    """Check the model splits over `--tp-size` (a mixture of experts' experts too: whole with
    `--enable-expert-parallel`) and join the group (nothing at size 1), with the all-reduce
    `--tp-all-reduce` resolves to here."""
    if args.tp_size == 1:
        return
    all_reduce, why = choose_all_reduce(
        args.tp_all_reduce, device, args.tp_size, args.ranks_per_node
    )
    if all_reduce == "one-shot" and device.type != "cuda":
        raise ValueError(
            f"--tp-all-reduce one-shot needs CUDA GPUs (peer memory); on {device} "
            "the ranks sum with gloo (--tp-all-reduce nccl)"
        )
    check_model_split(
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, tp.size
    )
    check_expert_split(get_model_class(cfg.architecture), cfg, tp.size, args.enable_expert_parallel)
    assert args.dist_init_addr is not None  # the launcher picks one
    init_tensor_parallel(
        tp.rank,
        args.tp_size,
        args.dist_init_addr,
        device,
        one_shot_dtype=dtype if all_reduce == "one-shot" else None,
        expert_parallel=args.enable_expert_parallel,
    )
    logger.info("tensor-parallel sums: %s (%s)", all_reduce, why)


def _choose_kernels(args: ServerArgs, model: LlamaForCausalLM, device: torch.device) -> str:
    """Set the matmul kernels and PDL (before any Triton kernel is launched or captured);
    what was chosen, for the ready line."""
    matmul = "invariant" if args.deterministic else args.small_batch_matmul
    if args.deterministic and args.small_batch_matmul != "auto":
        logger.warning(
            "--deterministic overrides --small-batch-matmul %s: every matmul runs "
            "the batch-invariant kernel",
            args.small_batch_matmul,
        )
    layers = set_matmul(model, matmul)
    # the layers' own test, on a weight: where it fails they run their torch code, whatever
    # kernel set_matmul chose
    triton_kernels = use_triton_kernels(next(model.parameters()))
    if not triton_kernels:
        logger.info("matmuls and fused ops: torch code on %s", device)
    elif matmul == "auto":
        logger.info(
            "--small-batch-matmul auto: the skinny triton kernel for %d matmul layers "
            "(the LM head and weights up to %d MiB), cuBLAS for %d (larger weights)",
            layers["triton"],
            AUTO_SKINNY_MAX_BYTES // 2**20,
            layers["cublas"],
        )
    if layers["fp8"]:
        logger.info(
            "%d FP8 linear layers: %s, whatever --small-batch-matmul says",
            layers["fp8"],
            (
                "torch._scaled_mm per channel, a Triton GEMM per block"
                if device.type == "cuda"
                else "emulated (dequantized per matmul)"
            ),
        )
    set_batch_invariant(args.deterministic)
    _log_experts(model, device, triton_kernels, args.deterministic)
    pdl, why = choose_pdl(args.enable_pdl, pdl_supported(device))
    set_pdl(pdl)
    if device.type == "cuda":  # PDL is a launch mode of CUDA kernels only
        logger.info("programmatic dependent launch %s (%s)", "on" if pdl else "off", why)
    return f"matmul {matmul if triton_kernels else 'torch'}" + (
        ", programmatic dependent launch" if pdl else ""
    )


def _log_experts(
    model: LlamaForCausalLM, device: torch.device, triton_kernels: bool, deterministic: bool
) -> None:
    """Say what runs a mixture of experts' layers: the kernel, and where its block configs
    come from (a tuned table of this GPU, or the default)."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        return
    moe = layers[0]
    what = f"{len(layers)} mixture-of-experts layers of {moe.num_experts} experts (top {moe.top_k})"
    if moe.local_experts.size < moe.num_experts:
        what += f", {moe.local_experts.size} of them on this rank (expert parallelism)"
    if not triton_kernels:
        logger.info("%s: torch code on %s", what, device)
        return
    _, source = moe_block_config(
        moe.local_experts.size,  # the kernels' E: this rank's experts
        moe.w2_weight.shape[2],
        moe.hidden_size,
        1,
        moe.w13_weight.dtype,
        device_name(device),
        None if moe.quant is None else moe.quant.block_size,
    )
    tables = (
        "the defaults (no tuned table for this GPU and shape)"
        if source == "default"
        else f"the tuned {source}"
    )
    logger.info(
        "%s: fused Triton kernels, block configs: %s%s",
        what,
        tables,
        " (--deterministic: one config for every batch)" if deterministic else "",
    )


def _kv_budget_tokens(
    args: ServerArgs,
    shapes: list[KVShape],
    tp: TPPlace,
    device: torch.device,
    extra_bytes_per_token: int = 0,
) -> int:
    """Tokens every model's KV cache holds: what `--mem-fraction-static` leaves after the
    weights (1 GiB on the CPU) over their bytes per token together (and
    `extra_bytes_per_token`: an EAGLE head's features), capped by `--max-total-tokens`."""
    per_token = sum(shape.bytes_per_token for shape in shapes) + extra_bytes_per_token
    mem_fraction = args.mem_fraction_static
    if device.type != "cuda":
        tokens = CPU_KV_CACHE_BYTES // per_token
    else:
        free, total = torch.cuda.mem_get_info(device)
        budget = total * mem_fraction - (total - free)
        if budget < per_token:
            raise RuntimeError(
                f"--mem-fraction-static {mem_fraction} leaves no room for the KV cache after "
                f"the weights ({(total - free) / 2**30:.1f} GiB used of "
                f"{total / 2**30:.1f} GiB); raise it"
            )
        tokens = int(budget // per_token)
        # every rank's scheduler must see the same pool: the smallest any rank can hold
        tokens = tokens if tp.size == 1 else min_over_ranks(tokens)
    return min(tokens, args.max_total_tokens or tokens)
