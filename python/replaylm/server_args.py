"""ServerArgs: every option of the engine and server, in one dataclass.

The argparse flags are generated from the fields (`model_path` -> `--model-path`), so a new option
is one field with its help text. Fields marked `server_only` (the HTTP front end's options) are
left out of `python -m replaylm.generate`; fields marked `secret` are redacted wherever the args
are shown (the log, /get_server_info). `validate()` checks values and `check_paths()` that the
model and tokenizer exist, each naming the flag in its message.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from replaylm.cuda_graph_modes import PHASES, modes_help
from replaylm.dtype_names import DTYPE_NAMES
from replaylm.layers.attention.registry import ATTENTION_BACKENDS
from replaylm.layers.quantization.config import QUANTIZATION_METHODS
from replaylm.model_loader.builtin_models import DEFAULT_MODEL, resolve_model_path
from replaylm.model_loader.formats import LOAD_FORMATS


def _opt(
    help_text: str,
    choices: tuple[str, ...] | None = None,
    server_only: bool = False,
    secret: bool = False,
) -> dict[str, Any]:
    return {"help": help_text, "choices": choices, "server_only": server_only, "secret": secret}


# choices from torch-free tables: the HTTP process parses its command line without importing
# torch (it starts the scheduler process first; see launch_server)
ATTENTION_BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")  # fp8: vLLM's name of fp8_e4m3
REDACTED = "<set>"
SPECULATIVE_ALGORITHMS = ("ngram", "draft_model", "eagle", "eagle3")
# the algorithms whose drafter is a model at --speculative-draft-model-path
DRAFT_MODEL_ALGORITHMS = ("draft_model", "eagle", "eagle3")
DEFAULT_SPECULATIVE_STEPS = 3
# speculating pays at up to this many running requests at middling acceptance (benchmarks.md,
# "Speculative decoding"): past it a verify step's rows outweigh the tokens they win
DEFAULT_SPECULATIVE_MAX_BS = 32
# a request's run of verify rows (its last token and drafts) fits the look-back of the decode
# kernel that takes them together (triton/decode.py's MAX_RUN)
MAX_SPECULATIVE_STEPS = 63
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
# a dense model's prefill chunk on a small GPU or the CPU (model_executor/prefill_chunk.py:
# larger on a large GPU and for a mixture of experts)
DEFAULT_PREFILL_CHUNK = 2048


@dataclass(repr=False)
class ServerArgs:
    # HTTP server
    host: str = field(
        default="127.0.0.1",
        metadata=_opt(
            "Address the HTTP server listens on. The default, 127.0.0.1, accepts connections "
            "from this machine only; use 0.0.0.0 to serve other machines (and set --api-key).",
            server_only=True,
        ),
    )
    port: int = field(
        default=30000, metadata=_opt("TCP port the HTTP server listens on.", server_only=True)
    )
    api_server_count: int | None = field(
        default=None,
        metadata=_opt(
            "HTTP front-end processes, sharing the port and the scheduler (as vLLM's flag of "
            "this name). Each parses, tokenizes, detokenizes and streams its own requests, so "
            "several keep up with a fast engine where one process's CPU would cap the tokens "
            "per second streamed; each holds its own tokenizer. With more than one, /metrics "
            "sums them all. Default: on a GPU half the CPU cores, at most 8; 1 on the CPU.",
            server_only=True,
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=_opt(
            "Model name that clients send in the `model` field and see in /v1/models. Default: "
            "the --model-path value. Set it to give clients a name that does not change with "
            "where the weights are stored.",
            server_only=True,
        ),
    )
    api_key: str | None = field(
        default=None,
        metadata=_opt(
            "Require `Authorization: Bearer <key>` on every route except /health and /metrics. "
            "Set it whenever others can reach the server. The key is never logged nor shown by "
            "/get_server_info; to keep it out of the process list too, set the REPLAYLM_API_KEY "
            "environment variable instead of this flag.",
            server_only=True,
            secret=True,
        ),
    )
    max_request_body_bytes: int = field(
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        metadata=_opt(
            "Largest request body accepted, in bytes; a larger one is answered with status 413 "
            "before it is read. The default (32 MiB) is far above any prompt that fits a model's "
            "context (a 128k-token prompt is about 1 MB as text or as token ids) and keeps a "
            "misbehaving client from making the server buffer and tokenize unbounded input. "
            "Raise it only if your prompts really are larger.",
            server_only=True,
        ),
    )
    enable_vllm_metrics: bool = field(
        default=False,
        metadata=_opt(
            "Also serve the /metrics series that have a vLLM equivalent under vLLM's names "
            "(vllm:num_requests_running, vllm:time_to_first_token_seconds, ...), labelled with "
            "model_name (--served-model-name), so dashboards and autoscalers written for vLLM "
            "work unchanged. The replaylm_* series are served either way.",
            server_only=True,
        ),
    )
    # model and loading
    model_path: str = field(
        default=DEFAULT_MODEL,
        metadata=_opt(
            "What to serve: a built-in model name (the default), a Hugging Face model folder "
            "(config.json and *.safetensors), a single .gguf file, or, with --load-format dummy, "
            "a config .json file."
        ),
    )
    tokenizer_path: str | None = field(
        default=None,
        metadata=_opt(
            "Where to load the tokenizer from, when --model-path holds none (for example a "
            "folder with weights only). Default: --model-path."
        ),
    )
    load_format: str = field(
        default="auto",
        metadata=_opt(
            "How to read the weights. auto: gguf for a .gguf file, safetensors otherwise. dummy: "
            "random weights of the right shapes, to test or benchmark without a checkpoint.",
            LOAD_FORMATS,
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=_opt(
            "Data type of the weights and activations. auto: float32 on the CPU; on a GPU the "
            "checkpoint's 16-bit type (float16 when its config says so, else bfloat16).",
            ("auto", *DTYPE_NAMES),
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=_opt(
            "Serve the weights in FP8 (e4m3). fp8: quantize an unquantized (bfloat16, float16 "
            "or float32) checkpoint as it loads, one float32 scale per output channel, and "
            "quantize each matmul's input per token. A checkpoint whose config.json carries an "
            "FP8 quantization_config (quant_method fp8, block-scaled or per-tensor, or "
            "compressed-tensors FP8) is served in FP8 without this flag, and with it alike; "
            "one quantized otherwise is refused. The embedding and the LM head stay "
            "unquantized, so do a mixture of experts' routers. On a GPU (compute capability "
            "8.9+) per-channel weights run a Triton kernel at decode rows (at most 64) and "
            "torch._scaled_mm above, block-scaled weights a Triton GEMM and FP8 experts "
            "the fused MoE kernels; on the CPU they are emulated. Not with "
            "--deterministic. Default: as the checkpoint is.",
            QUANTIZATION_METHODS,
        ),
    )
    device: str = field(
        default="auto",
        metadata=_opt(
            "Where the model runs. auto: the GPU when there is one, else the CPU.",
            ("auto", "cuda", "cpu"),
        ),
    )
    tp_size: int = field(
        default=1,
        metadata=_opt(
            "Tensor parallelism: split each layer's heads, MLP columns and vocabulary over this "
            "many ranks, one scheduler process and one GPU each (gloo processes on the CPU), "
            "joined by torch.distributed. The model's attention heads and MLP size must divide "
            "by it."
        ),
    )
    tp_all_reduce: str = field(
        default="auto",
        metadata=_opt(
            "How the GPUs of --tp-size sum each layer's partial outputs. nccl: NCCL's "
            "all-reduce, then the residual add and RMSNorm. one-shot: for messages up to 512 "
            "KiB (decode steps) one kernel writes this GPU's part into every peer's memory over "
            "NVLink (torch's symmetric memory, no multicast), sums, adds the residual and norms; "
            "larger ones and torch.compile'd pieces go by NCCL. auto: one-shot where the GPUs "
            "are of one machine and reach each other's memory, else nccl.",
            ("auto", "nccl", "one-shot"),
        ),
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata=_opt(
            "Mixture-of-experts models under --tp-size: place each layer's experts whole on the "
            "ranks, an even share each (rank r of N holds experts r*E/N to (r+1)*E/N - 1), "
            "instead of a slice of every expert's columns on every rank; attention, the router, "
            "dense layers and a shared expert stay split as without it. Every rank holds the "
            "whole hidden states already, so each runs its own experts on the tokens routed to "
            "them and the layer's outputs are summed by the same all-reduce as before: no "
            "all-to-all, no extra collective. The model's experts must divide by --tp-size. A "
            "dense model is refused with an error rather than served as if the flag were "
            "absent: a flag that silently changes nothing hides a wrong model or a wrong "
            "expectation of memory per rank."
        ),
    )
    nnodes: int = field(
        default=1,
        metadata=_opt(
            "Machines the --tp-size ranks are spread over, --tp-size / --nnodes on each; start "
            "the server on every machine with the same flags and its --node-rank.",
            server_only=True,
        ),
    )
    node_rank: int = field(
        default=0,
        metadata=_opt(
            "This machine's index among --nnodes. Node 0 serves HTTP and runs rank 0; the "
            "others run their ranks only and exit when the group ends.",
            server_only=True,
        ),
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata=_opt(
            "Where the tensor-parallel ranks meet, HOST:PORT (node 0's address, a free port); "
            "needed with --nnodes above 1. Default on one machine: a free port on 127.0.0.1.",
            server_only=True,
        ),
    )
    seed: int = field(
        default=0,
        metadata=_opt(
            "Seed of dummy weights and of the sampling of requests that give no seed of their "
            "own; fix it to get the same sampled outputs across restarts."
        ),
    )
    # memory
    mem_fraction_static: float = field(
        default=0.80,
        metadata=_opt(
            "GPU only: fraction of the GPU's memory for the weights plus the KV cache; the rest "
            "is left for activations and CUDA graphs. Lower it when start-up runs out of memory "
            "or the GPU is shared; raise it for a larger KV cache (more requests at once)."
        ),
    )
    max_total_tokens: int | None = field(
        default=None,
        metadata=_opt(
            "Size of the KV cache in tokens, shared by all running requests. Default: what "
            "--mem-fraction-static leaves on a GPU, 1 GiB worth on the CPU. Set it to cap the "
            "server's memory."
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_opt(
            "Data type of the KV cache. auto: the model's (--dtype). fp8_e4m3 (or fp8, vLLM's "
            "name for it): float8 e4m3, one byte an element, so the same memory holds twice the "
            "tokens of a 16-bit cache, for a small loss of accuracy; each layer stores K / "
            "k_scale and V / v_scale saturated at +-448, the scales an FP8 checkpoint's "
            "(k_scale / v_scale, or k_proj / v_proj output_scale), else 1.0. Every attention "
            "backend reads it; on the CPU the torch_native backend runs it (torch's float8 "
            "type), whatever --dtype.",
            KV_CACHE_DTYPES,
        ),
    )
    max_running_requests: int | None = field(
        default=None,
        metadata=_opt(
            "Most requests running at once; further requests wait in the queue. Default: from "
            "the GPU's memory, 1024 from 60 GiB, 512 from 30 GiB, else 256 (256 on the CPU). "
            "Decode batches up to this many replay CUDA graphs by default."
        ),
    )
    context_length: int | None = field(
        default=None,
        metadata=_opt(
            "Longest sequence (prompt plus output) a request may reach; longer prompts are "
            "rejected. Default: the model's max_position_embeddings."
        ),
    )
    # scheduling
    chunked_prefill_size: int | None = field(
        default=None,
        metadata=_opt(
            "Prompts longer than this many tokens are prefilled in chunks of this size, between "
            "decode steps, so that one long prompt does not stall the other requests' output. "
            "Smaller chunks keep streams smoother; larger ones finish long prompts sooner. "
            "Default: 2048, or 8192 on a GPU of 35 GiB or more; for a mixture of experts at least "
            "enough tokens that each expert gets about 512 rows a step (experts x 512 / top-k, at "
            "most 8192), which its grouped GEMMs need to run near peak; in the offline Engine "
            "about 1024 rows, at most 16384."
        ),
    )
    max_prefill_tokens: int | None = field(
        default=None,
        metadata=_opt(
            "Most prompt tokens prefilled in one step, over all requests (one prompt chunk is "
            "always admitted). Default: --chunked-prefill-size, so that a prefill batch fits the "
            "largest prefill CUDA graph."
        ),
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata=_opt(
            "Read each decode step's tokens back before launching the next step. By default the "
            "next step is launched first, so the scheduler's host work overlaps the GPU's; use "
            "this to rule the overlap out when debugging."
        ),
    )
    enable_mixed_chunk: bool = field(
        default=False,
        metadata=_opt(
            "Decode the running requests in prefill steps too: their tokens ride in the same "
            "forward as the prompt chunks (counted in --max-prefill-tokens), so a long prompt "
            "does not pause every other request's output. By default a prefill step pauses "
            "decoding."
        ),
    )
    speculative_algorithm: str | None = field(
        default=None,
        metadata=_opt(
            "Speculative decoding: each decode step verifies draft tokens, so a request can gain "
            "several tokens a step, its output unchanged. ngram: drafts from the request's own "
            "prompt and output (what followed the latest earlier occurrence of its last tokens; "
            "no draft model). draft_model: a smaller model of the same vocabulary "
            "(--speculative-draft-model-path) proposes greedily, one decode step a token. "
            "eagle / eagle3: an EAGLE or EAGLE-3 draft head (--speculative-draft-model-path, "
            "an HF folder whose config names LlamaForCausalLMEagle or LlamaForCausalLMEagle3) "
            "drafts from the target's hidden states, one head step a token (tensor-parallel "
            "size 1). "
            "Requests with penalties, logit_bias, min_tokens, allowed or banned ids, a "
            "grammar or logprobs decode one token a step beside the others. The overlap "
            "schedule is off under speculation. Default: off.",
            SPECULATIVE_ALGORITHMS,
        ),
    )
    speculative_draft_model_path: str | None = field(
        default=None,
        metadata=_opt(
            "For draft_model, the draft model (any model replaylm loads, its vocabulary the "
            "target's; loaded with the target's --load-format and --dtype); for eagle and "
            "eagle3, the head's folder."
        ),
    )
    speculative_num_steps: int | None = field(
        default=None,
        metadata=_opt(
            "Draft tokens proposed per request per verify step (a chain: top-k 1). Default: "
            f"{DEFAULT_SPECULATIVE_STEPS}, or --speculative-num-draft-tokens less one."
        ),
    )
    speculative_num_draft_tokens: int | None = field(
        default=None,
        metadata=_opt(
            "Tokens a verify step computes per request: its last token and its drafts, so "
            "--speculative-num-steps plus one (SGLang's meaning for a chain; give either)."
        ),
    )
    speculative_ngram_min_match_window_size: int = field(
        default=2,
        metadata=_opt(
            "For ngram, the fewest trailing tokens matched against the request's earlier tokens "
            "(one-token matches propose almost every step and are rarely right)."
        ),
    )
    speculative_ngram_max_match_window_size: int = field(
        default=4,
        metadata=_opt(
            "For ngram, the most trailing tokens matched; longer matches are tried first."
        ),
    )
    speculative_max_bs: int | None = field(
        default=None,
        metadata=_opt(
            "The most running requests that speculate: a larger batch decodes plainly (its "
            "verify step's rows cost more than the drafts they accept win). Default: "
            f"{DEFAULT_SPECULATIVE_MAX_BS}."
        ),
    )
    disable_radix_cache: bool = field(
        default=False,
        metadata=_opt(
            "Turn the prefix cache off: every prompt is prefilled in full. By default a radix tree "
            "over the KV pool keeps finished requests' tokens, and a prompt starting with cached "
            "tokens prefills only the rest."
        ),
    )
    # kernels
    attention_backend: str = field(
        default="auto",
        metadata=_opt(
            "Attention kernels (of both phases unless --prefill-attention-backend names "
            "prefill's). triton: replaylm's Triton kernels (GPU only; the only ones for "
            "--deterministic). flashinfer: FlashInfer's (GPU only; the flashinfer-python package, "
            "`pip install replaylm[gpu]`). torch_native: PyTorch's, on any device. auto: triton "
            "on a GPU, torch_native on the CPU. A full decode graph needs triton or flashinfer.",
            ATTENTION_BACKEND_CHOICES,
        ),
    )
    prefill_attention_backend: str | None = field(
        default=None,
        metadata=_opt(
            "Attention kernels of prefill and mixed steps, if not those of --attention-backend "
            "(same choices).",
            ATTENTION_BACKEND_CHOICES,
        ),
    )
    # CUDA graphs, resolved per phase by model_executor/cuda_graph/config.py (precedence: JSON >
    # per-phase > legacy flags > defaults)
    cuda_graph_mode: str | None = field(
        default=None,
        metadata=_opt(
            "CUDA-graph mode of each phase as one JSON object, e.g. "
            '\'{"decode": "full", "prefill": "breakable"}\' (the default on a GPU; the CPU runs '
            f"eagerly). It overrides the per-phase flags. Phases: {', '.join(PHASES)}. Modes: "
            f"{modes_help()}. "
            "`launch_server --print-cuda-graph-config` shows what a command line resolves to."
        ),
    )
    decode_cuda_graph_mode: str | None = field(
        default=None,
        metadata=_opt(f"CUDA-graph mode of the decode phase: {modes_help('decode')}."),
    )
    prefill_cuda_graph_mode: str | None = field(
        default=None,
        metadata=_opt(f"CUDA-graph mode of the prefill phase: {modes_help('prefill')}."),
    )
    verify_cuda_graph_mode: str | None = field(
        default=None,
        metadata=_opt(
            "CUDA-graph mode of speculative decoding's verify steps: "
            f"{modes_help('verify')}. Default: the decode phase's mode where it can serve "
            "verify steps, else breakable (off without --speculative-algorithm)."
        ),
    )
    draft_cuda_graph_mode: str | None = field(
        default=None,
        metadata=_opt(
            "CUDA-graph mode of a draft model's or EAGLE head's decode steps (draft_model, eagle, "
            "eagle3): "
            f"{modes_help('draft')}. Default: the decode phase's mode."
        ),
    )
    decode_disable_cuda_graph: bool = field(
        default=False, metadata=_opt("Run decode eagerly (no CUDA graph).")
    )
    prefill_disable_cuda_graph: bool = field(
        default=False, metadata=_opt("Run prefill eagerly (no CUDA graph).")
    )
    verify_disable_cuda_graph: bool = field(
        default=False, metadata=_opt("Run speculative decoding's verify steps eagerly.")
    )
    draft_disable_cuda_graph: bool = field(
        default=False, metadata=_opt("Run a draft model's or EAGLE head's decode steps eagerly.")
    )
    disable_cuda_graph: bool = field(
        default=False,
        metadata=_opt(
            "Run both phases eagerly. Deprecated: use "
            '--cuda-graph-mode \'{"decode": "disabled", "prefill": "disabled"}\'.'
        ),
    )
    disable_piecewise_cuda_graph: bool = field(
        default=False,
        metadata=_opt("Run prefill eagerly. Deprecated: use --prefill-disable-cuda-graph."),
    )
    enable_breakable_cuda_graph: bool = field(
        default=False,
        metadata=_opt(
            "Capture prefill as breakable graphs. Deprecated: use --prefill-cuda-graph-mode "
            "breakable."
        ),
    )
    decode_cuda_graph_bs: list[int] | None = field(
        default=None,
        metadata=_opt(
            "Decode batch sizes to capture; a batch runs the smallest captured size that fits "
            "it. Default: 1 2 4 8, every multiple of 8 up to 256, every 64 up to 512, then "
            "every 128, up to --max-running-requests."
        ),
    )
    decode_cuda_graph_max_bs: int | None = field(
        default=None,
        metadata=_opt(
            "Largest decode batch size to capture from the default list (default "
            "--max-running-requests); lower it to capture fewer graphs (a shorter start-up, "
            "less memory) when batches stay small."
        ),
    )
    prefill_cuda_graph_tokens: list[int] | None = field(
        default=None,
        metadata=_opt(
            "Prefill token counts to capture; a prefill batch runs the smallest captured count "
            "that fits it. Default: 16 32 64 128 256, then every multiple of 256, up to "
            "--chunked-prefill-size."
        ),
    )
    prefill_cuda_graph_max_tokens: int | None = field(
        default=None,
        metadata=_opt(
            "Largest prefill token count to capture from the default list (default: 2048 or "
            "--chunked-prefill-size, the smaller); larger prefill steps run eagerly. Each "
            "captured size costs capture time and some GPU memory; lower it to capture fewer "
            "graphs when prompts are short."
        ),
    )
    debug_cuda_graph: bool = field(
        default=False,
        metadata=_opt(
            "Run the breakable and tc_piecewise modes' graph path without capturing anything, "
            "on any device: use it to find out whether a wrong output comes from graph capture "
            "or from the code path itself."
        ),
    )
    tc_piecewise_compiler: str = field(
        default="inductor",
        metadata=_opt(
            "How the tc_piecewise mode compiles its pieces. inductor: torch.compile's compiler. "
            "eager: split the forward only, without compiling (to debug the compiler).",
            ("inductor", "eager"),
        ),
    )
    small_batch_matmul: str = field(
        default="auto",
        metadata=_opt(
            "Kernel of the matmuls of at most 16 rows (decode batches) on a GPU. triton: a "
            "split-K kernel whose rows do not depend on the batch's size. cublas: cuBLAS. auto: "
            "triton for the LM head and weights up to 64 MiB, cuBLAS for larger weights. Set it "
            "to compare the two kernels when profiling a model's decode step.",
            ("auto", "cublas", "triton"),
        ),
    )
    deterministic: bool = field(
        default=False,
        metadata=_opt(
            "Use batch-invariant kernels: a request's outputs no longer depend on which requests "
            "share its batches or on how its prompt is chunked, so the same request always gets "
            "the same output. Needs a GPU and the triton attention backend."
        ),
    )
    enable_pdl: bool | None = field(
        default=None,
        metadata=_opt(
            "Programmatic dependent launch (Hopper GPUs or newer): each of replaylm's Triton "
            "kernels may start while the kernel before it finishes; results are unchanged. "
            "Default: on where the GPU supports it. --no-enable-pdl turns it off, e.g. to rule "
            "it out when debugging."
        ),
    )
    tc_piecewise_kernels: str = field(
        default="fused",
        metadata=_opt(
            "What the tc_piecewise pieces run for norms, rope and SiLU-and-multiply. fused: "
            "replaylm's Triton kernels, kept whole (the same numbers as eager). native: the "
            "PyTorch code, fused by the compiler itself.",
            ("fused", "native"),
        ),
    )
    compile_cache_dir: str | None = field(
        default=None,
        metadata=_opt(
            "Directory where the tc_piecewise mode keeps its compiled pieces, so that a later "
            "start reuses them instead of compiling again. Default: torch.compile's own cache "
            "directory."
        ),
    )
    log_level: str = field(
        default="info",
        metadata=_opt(
            "How much to log. debug adds the traceback of a start-up failure.",
            ("debug", "info", "warning", "error"),
        ),
    )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.redacted().items())
        return f"ServerArgs({fields})"

    def redacted(self) -> dict[str, Any]:
        """The fields as a dict, each secret that is set replaced by `<set>`: what may be shown."""
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata.get("secret") and out[f.name] is not None:
                out[f.name] = REDACTED
        return out

    def validate(self) -> None:
        """Raise ValueError naming the offending flag."""
        for name in (
            "max_total_tokens",
            "context_length",
            "chunked_prefill_size",
            "max_prefill_tokens",
            "max_running_requests",
            "max_request_body_bytes",
            "api_server_count",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        self._validate_tensor_parallel()
        self._validate_speculative()
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}"
            )
        for f in dataclasses.fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(
                    f"--{f.name.replace('_', '-')} must be one of {', '.join(choices)}, "
                    f"got '{value}'"
                )
        if self.deterministic and self.tc_piecewise_kernels == "native":
            raise ValueError(
                "--deterministic needs --tc-piecewise-kernels fused (with native, "
                "compiled pieces would run the compiler's matmuls and fusions)"
            )

    def _validate_speculative(self) -> None:
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        for flag, value in (
            ("--speculative-num-steps", steps),
            ("--speculative-num-draft-tokens", tokens and tokens - 1),
            ("--speculative-max-bs", self.speculative_max_bs),
            (
                "--speculative-ngram-min-match-window-size",
                self.speculative_ngram_min_match_window_size,
            ),
        ):
            if value is not None and value < 1:
                minimum = 2 if flag == "--speculative-num-draft-tokens" else 1
                raise ValueError(f"{flag} must be >= {minimum}")
        if self.speculative_steps > MAX_SPECULATIVE_STEPS:
            raise ValueError(
                f"--speculative-num-steps {self.speculative_steps} is above "
                f"{MAX_SPECULATIVE_STEPS}, the most drafts a verify step takes per request"
            )
        if steps is not None and tokens is not None and tokens != steps + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens {tokens} must be --speculative-num-steps + 1 "
                f"({steps + 1}) for a chain of drafts; give one of them"
            )
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if high < low:
            raise ValueError(
                f"--speculative-ngram-max-match-window-size {high} is below "
                f"--speculative-ngram-min-match-window-size {low}"
            )
        draft_path = self.speculative_draft_model_path
        if self.speculative_algorithm in DRAFT_MODEL_ALGORITHMS and draft_path is None:
            raise ValueError(
                f"--speculative-algorithm {self.speculative_algorithm} needs "
                "--speculative-draft-model-path"
            )
        if self.speculative_algorithm not in DRAFT_MODEL_ALGORITHMS and draft_path is not None:
            raise ValueError(
                "--speculative-draft-model-path needs --speculative-algorithm "
                f"{', '.join(DRAFT_MODEL_ALGORITHMS[:-1])} or {DRAFT_MODEL_ALGORITHMS[-1]}"
            )
        if self.speculative_algorithm in ("eagle", "eagle3") and self.tp_size > 1:
            raise ValueError(
                f"--speculative-algorithm {self.speculative_algorithm} runs at --tp-size 1 (its "
                "head reads the target's whole embedding, which tensor parallelism splits)"
            )
        if self.speculative_algorithm is None and (steps or tokens or self.speculative_max_bs):
            raise ValueError(
                "--speculative-num-steps, --speculative-num-draft-tokens and "
                "--speculative-max-bs need --speculative-algorithm"
            )

    @property
    def speculative_steps(self) -> int:
        """Draft tokens per request per verify step, from either flag (or the default)."""
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        return DEFAULT_SPECULATIVE_STEPS

    @property
    def speculative_batch_limit(self) -> int:
        """The most running requests that speculate (the flag, or the default)."""
        return self.speculative_max_bs or DEFAULT_SPECULATIVE_MAX_BS

    def _validate_tensor_parallel(self) -> None:
        for name in ("tp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.enable_expert_parallel and self.tp_size == 1:
            raise ValueError(
                "--enable-expert-parallel needs --tp-size 2 or more (one rank holds every "
                "expert already)"
            )
        if self.tp_size % self.nnodes:
            raise ValueError(
                f"--tp-size {self.tp_size} is not a multiple of --nnodes {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes {self.nnodes}, "
                f"got {self.node_rank}"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, got '{self.dist_init_addr}'")

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks each node runs."""
        return self.tp_size // self.nnodes

    def check_paths(self) -> None:
        """FileNotFoundError naming the flag when the model or tokenizer path does not exist (a
        check that needs no torch, so a typo is reported before anything heavy loads)."""
        for flag, value in (
            ("--model-path", self.model_path),
            ("--tokenizer-path", self.tokenizer_path),
            ("--speculative-draft-model-path", self.speculative_draft_model_path),
        ):
            if value is not None and not os.path.exists(resolve_model_path(value)):
                raise FileNotFoundError(f"{flag} '{value}' does not exist")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, server: bool = True) -> None:
        """Add one flag per field; with `server=False`, none for the HTTP front end's fields."""
        for f in dataclasses.fields(ServerArgs):
            if f.metadata.get("server_only") and not server:
                continue
            flag = "--" + f.name.replace("_", "-")
            annotation = f.type
            assert isinstance(annotation, str)  # postponed evaluation: annotations are strings
            kind = type(f.default) if f.default is not None else _optional_type(annotation)
            help_text = f.metadata["help"]
            if f.default is not None and kind is not bool and "default" not in help_text.lower():
                help_text += " Default: %(default)s."
            kwargs: dict[str, Any] = {"default": f.default, "help": help_text}
            if annotation.startswith("list[int]"):
                kwargs.update(type=int, nargs="+")
            elif kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = kind
                if f.metadata.get("choices"):
                    kwargs["choices"] = f.metadata["choices"]
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """The fields parsed by `add_cli_args`; those it left out keep their defaults."""
        values: dict[str, Any] = {
            f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)
        }
        return cls(**values)


def _optional_type(annotation: str) -> type:
    """`'int | None'` -> int (annotations are strings under postponed evaluation)."""
    base = annotation.replace("| None", "").strip()
    return {"int": int, "float": float, "str": str, "bool": bool, "list[int]": list}[base]


# running-request caps by GPU memory: a larger batch reads more KV per weight read (offline
# throughput), and costs a request-table row and penalty state per request (docs/benchmarks.md,
# "Scale")
RUNNING_REQUESTS_BY_GPU_GIB = ((60, 1024), (30, 512))
DEFAULT_MAX_RUNNING_REQUESTS = 256  # the CPU, and GPUs under 30 GiB


MAX_DEFAULT_API_SERVERS = 8  # past it a 16-core host's clients and scheduler lose their cores


def default_api_server_count(device_type: str, cpu_count: int | None) -> int:
    """The front ends for a `device_type` server on `cpu_count` cores: on a GPU, half of them
    (the scheduler and the clients want the rest), at most MAX_DEFAULT_API_SERVERS; one on the
    CPU, whose cores the model needs."""
    if device_type != "cuda":
        return 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, (cpu_count or 1) // 2))


def default_max_running_requests(gpu_memory_bytes: int | None) -> int:
    """The running-request cap for a GPU of `gpu_memory_bytes` (None: the CPU)."""
    if gpu_memory_bytes is None:
        return DEFAULT_MAX_RUNNING_REQUESTS
    gib = gpu_memory_bytes / 2**30
    return next(
        (cap for least, cap in RUNNING_REQUESTS_BY_GPU_GIB if gib >= least),
        DEFAULT_MAX_RUNNING_REQUESTS,
    )
