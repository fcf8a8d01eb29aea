"""The engine's settings resolved for the machine, once, before any model loads.

`resolve_engine_config` turns the server's flags into values: the device (`auto` becomes `cuda`
or `cpu`), the running-request cap (its default from the GPU's memory), each phase's attention
backend and the CUDA-graph config. The HTTP front end does it before it spawns the model
process (a bad combination is one `error:` line and exit code 2, before anything loads) and
hands the result over; the offline Engine does it in-process. Nothing downstream resolves again.
No torch here: the GPUs are probed through the driver (`device/gpu_probe.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

from replaylm.device.gpu_probe import GpuFacts, probe_gpus
from replaylm.layers.attention.registry import check_deterministic
from replaylm.layers.attention.selection import PhaseAttentionBackends, resolve_phase_backends
from replaylm.model_executor.cuda_graph.config import CudaGraphConfig, resolve_cuda_graph_config
from replaylm.server_args import (
    DRAFT_MODEL_ALGORITHMS,
    ServerArgs,
    default_api_server_count,
    default_max_running_requests,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """`args` with `device`, `api_server_count` and `max_running_requests` resolved (the cap
    stays None only for a CUDA device that this machine lacks, which only
    --print-cuda-graph-config asks about)."""

    args: ServerArgs
    attention: PhaseAttentionBackends
    cuda_graphs: CudaGraphConfig
    notes: tuple[str, ...] = ()  # how defaults were chosen
    # speculation with a draft model or an EAGLE head: the drafter's, at TP 1
    draft: EngineConfig | None = None
    # the offline Engine's, which streams to no one (its defaults favour throughput:
    # model_executor/prefill_chunk.py)
    offline: bool = False

    @property
    def device_type(self) -> str:
        return self.args.device.partition(":")[0]

    @property
    def api_server_count(self) -> int:
        """The HTTP front ends (always resolved)."""
        assert self.args.api_server_count is not None
        return self.args.api_server_count

    def log(self) -> None:
        """What was chosen and why, and the CUDA-graph config's warnings."""
        for note in self.notes + self.cuda_graphs.notes:
            logger.info("%s", note)
        for warning in self.cuda_graphs.warnings:
            logger.warning("%s", warning)
        graphs = self.cuda_graphs
        verify = f", verify from {graphs.verify.source}" if graphs.verify.enabled else ""
        logger.info(
            "CUDA graphs: %s (decode from %s, prefill from %s%s); attention: %s",
            graphs.summary(),
            graphs.decode.source,
            graphs.prefill.source,
            verify,
            self.attention.describe(),
        )


def resolve_engine_config(args: ServerArgs, gpus: GpuFacts | None = None) -> EngineConfig:
    """Resolve `args` for this machine (`gpus`: probed when not given). ValueError (one line,
    naming the flag) for a combination that cannot run here."""
    device = args.device
    if device == "auto":
        gpus = gpus or probe_gpus()
        device = "cuda" if gpus is not None else "cpu"
    elif device.startswith("cuda"):
        gpus = gpus or probe_gpus()
    device_type = device.partition(":")[0]
    notes = []
    running = args.max_running_requests
    if running is None and (device_type != "cuda" or gpus is not None):
        memory = gpus.memory_bytes if device_type == "cuda" and gpus is not None else None
        running = default_max_running_requests(memory)
        where = f"a GPU of {memory / 2**30:.0f} GiB" if memory is not None else device
        notes.append(f"max running requests: {running} (the default for {where})")
    front_ends = args.api_server_count
    if front_ends is None:
        front_ends = default_api_server_count(device_type, os.cpu_count())
        notes.append(f"HTTP front-end processes: {front_ends} (the default for {device_type})")
    if args.enable_pdl and device_type != "cuda":
        raise ValueError(f"--enable-pdl needs a CUDA GPU of compute capability 9.0+, not {device}")
    resolved = dataclasses.replace(
        args, device=device, max_running_requests=running, api_server_count=front_ends
    )
    attention = resolve_phase_backends(
        args.attention_backend, args.prefill_attention_backend, device_type
    )
    if args.deterministic:
        for backend in {attention.decode, attention.prefill}:
            check_deterministic(backend)
    graphs = resolve_cuda_graph_config(resolved, device_type, attention)
    draft = None
    if args.speculative_algorithm in DRAFT_MODEL_ALGORITHMS:
        assert args.speculative_draft_model_path is not None  # ServerArgs.validate checks it
        draft = resolve_engine_config(draft_model_args(resolved, graphs), gpus)
    return EngineConfig(resolved, attention, graphs, tuple(notes), draft)


def draft_model_args(args: ServerArgs, graphs: CudaGraphConfig) -> ServerArgs:
    """The draft model's settings: the target's, for the draft's path, at tensor-parallel
    size 1, with no speculation of its own, quantized only as its own checkpoint says (not by
    `--quantization`, which is the target's); its decode steps in the target's draft phase's
    CUDA-graph mode, its catch-up prefills in the prefill phase's (an EAGLE head's breakable
    where those compile: torch.compile cannot trace the head's read of its features buffer at
    the batch's size, and a one-layer head has little for it to fuse)."""
    assert args.speculative_draft_model_path is not None
    modes = {"decode": graphs.draft.mode, "prefill": graphs.prefill.mode}
    if args.speculative_algorithm in ("eagle", "eagle3") and "tc_piecewise" in modes.values():
        modes = {phase: "breakable" if m == "tc_piecewise" else m for phase, m in modes.items()}
        logger.info("EAGLE head: breakable CUDA graphs where the target's phases compile")
    return dataclasses.replace(
        args,
        cuda_graph_mode=json.dumps(modes),
        model_path=args.speculative_draft_model_path,
        tokenizer_path=None,
        tp_size=1,
        nnodes=1,
        node_rank=0,
        dist_init_addr=None,
        speculative_algorithm=None,
        speculative_draft_model_path=None,
        speculative_num_steps=None,
        speculative_num_draft_tokens=None,
        speculative_max_bs=None,
        quantization=None,
    )
