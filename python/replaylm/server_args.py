"""ServerArgs: every option of the engine and server, in one dataclass.

The argparse flags are generated from the fields (`model_path` -> `--model-path`), so a new option
is one field with its help text. `validate()` checks values and names the flag in its message.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from replaylm.dtype_names import DTYPE_NAMES
from replaylm.model_loader.builtin_models import DEFAULT_MODEL


def _opt(help_text: str, choices: tuple[str, ...] | None = None) -> Any:
    return {"help": help_text, "choices": choices}


ATTENTION_BACKEND_CHOICES = ("auto", "torch_native", "triton")
# Choices named here, not imported from the modules that use them: the HTTP process parses its
# command line without importing torch (it starts the scheduler process first; see launch_server).
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class ServerArgs:
    # HTTP server
    host: str = field(default="127.0.0.1", metadata=_opt("address the HTTP server binds"))
    port: int = field(default=30000, metadata=_opt("port the HTTP server listens on"))
    served_model_name: str | None = field(
        default=None,
        metadata=_opt(
            "model name in the API (/v1/models, the `model` field); default: --model-path"
        ),
    )
    api_key: str | None = field(
        default=None, metadata=_opt("if set, requests must send `Authorization: Bearer <key>`")
    )
    # model and loading
    model_path: str = field(
        default=DEFAULT_MODEL,
        metadata=_opt("HF folder, .gguf file, config .json (dummy load) or built-in model name"),
    )
    tokenizer_path: str | None = field(
        default=None, metadata=_opt("tokenizer location when it differs from --model-path")
    )
    load_format: str = field(
        default="auto",
        metadata=_opt("weights format; dummy = random weights of the right shapes", LOAD_FORMATS),
    )
    dtype: str = field(
        default="auto",
        metadata=_opt(
            "weights/activations dtype; auto = float32 on CPU, the checkpoint's 16-bit type on GPU",
            ("auto", *DTYPE_NAMES),
        ),
    )
    device: str = field(default="auto", metadata=_opt("where to run", ("auto", "cuda", "cpu")))
    seed: int = field(
        default=0,
        metadata=_opt("seed for dummy weights and for requests that give no sampling seed"),
    )
    # memory
    mem_fraction_static: float = field(
        default=0.80, metadata=_opt("GPU: fraction of device memory for weights + KV cache")
    )
    max_total_tokens: int | None = field(
        default=None,
        metadata=_opt(
            "KV cache size in tokens (default: from --mem-fraction-static on GPU, 1 GiB on CPU)"
        ),
    )
    max_running_requests: int = field(
        default=256, metadata=_opt("most requests held in the request table at once")
    )
    context_length: int | None = field(
        default=None,
        metadata=_opt(
            "longest sequence (prompt + output); default: the model's max_position_embeddings"
        ),
    )
    # scheduling
    chunked_prefill_size: int = field(
        default=2048,
        metadata=_opt("prompts longer than this are prefilled in chunks of this many tokens"),
    )
    max_prefill_tokens: int | None = field(
        default=None,
        metadata=_opt(
            "most new tokens in one prefill batch (default: --chunked-prefill-size, so a batch "
            "fits the largest prefill graph bucket; one prompt chunk is always admitted)"
        ),
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata=_opt(
            "read each decode step's tokens back before launching the next (by default the next "
            "step is launched first, its input tokens copied on the device, so the host's work "
            "overlaps the GPU's)"
        ),
    )
    # kernels
    attention_backend: str = field(
        default="auto", metadata=_opt("attention implementation", ATTENTION_BACKEND_CHOICES)
    )
    # CUDA graphs: resolved per phase by model_executor/cuda_graph/config.py (precedence: JSON >
    # per-phase > legacy > defaults)
    cuda_graph_mode: str | None = field(
        default=None,
        metadata=_opt(
            'per-phase modes as JSON, e.g. \'{"decode": "full", "prefill": "breakable"}\'; '
            "modes: full, breakable, tc_piecewise, disabled"
        ),
    )
    decode_cuda_graph_mode: str | None = field(
        default=None, metadata=_opt("decode mode: full, breakable, tc_piecewise or disabled")
    )
    prefill_cuda_graph_mode: str | None = field(
        default=None, metadata=_opt("prefill mode: breakable, tc_piecewise or disabled")
    )
    decode_disable_cuda_graph: bool = field(default=False, metadata=_opt("run decode eagerly"))
    prefill_disable_cuda_graph: bool = field(default=False, metadata=_opt("run prefill eagerly"))
    disable_cuda_graph: bool = field(
        default=False, metadata=_opt("deprecated: both phases eager (use --cuda-graph-mode)")
    )
    disable_piecewise_cuda_graph: bool = field(
        default=False, metadata=_opt("deprecated: prefill eager (use --prefill-disable-cuda-graph)")
    )
    enable_breakable_cuda_graph: bool = field(
        default=False,
        metadata=_opt("deprecated: prefill breakable (use --prefill-cuda-graph-mode breakable)"),
    )
    decode_cuda_graph_bs: list[int] | None = field(
        default=None,
        metadata=_opt(
            "decode batch sizes to capture (default 1 2 4 8 16 24 ... 256, clipped to "
            "--max-running-requests)"
        ),
    )
    decode_cuda_graph_max_bs: int | None = field(
        default=None, metadata=_opt("largest decode batch size to capture (with the default list)")
    )
    prefill_cuda_graph_tokens: list[int] | None = field(
        default=None,
        metadata=_opt("prefill token counts to capture (default up to --chunked-prefill-size)"),
    )
    prefill_cuda_graph_max_tokens: int | None = field(
        default=None,
        metadata=_opt("largest prefill token count to capture (with the default list)"),
    )
    debug_cuda_graph: bool = field(
        default=False,
        metadata=_opt(
            "breakable and tc_piecewise graphs capture nothing and run eagerly through the same "
            "path, on any device (to bisect wrong outputs)"
        ),
    )
    tc_piecewise_compiler: str = field(
        default="inductor",
        metadata=_opt(
            "how tc_piecewise compiles the pieces of the forward (eager: split only, no fusion)",
            ("inductor", "eager"),
        ),
    )
    small_batch_matmul: str = field(
        default="auto",
        metadata=_opt(
            "kernel of the matmuls of at most 16 rows (decode batches) on CUDA: triton (a split-K "
            "kernel whose rows do not depend on the batch's size), cublas, or auto: triton for the "
            "LM head and layer weights up to 64 MiB, cublas for larger ones (where it measured "
            "faster on the H100)",
            ("auto", "cublas", "triton"),
        ),
    )
    deterministic: bool = field(
        default=False,
        metadata=_opt(
            "batch-invariant kernels: a request's outputs do not depend on the batches it shares "
            "or on how its prompt is chunked (matmuls, attention); needs the triton attention "
            "backend"
        ),
    )
    enable_pdl: bool | None = field(
        default=None,
        metadata=_opt(
            "launch replaylm's Triton kernels with programmatic dependent launch (Hopper or "
            "newer): each may start while the kernel before it finishes, the matmuls loading "
            "weights meanwhile; same numbers. Default: on where supported (compute capability "
            "9.0+); --no-enable-pdl turns it off"
        ),
    )
    tc_piecewise_kernels: str = field(
        default="fused",
        metadata=_opt(
            "what tc_piecewise pieces run for norms, rope and SiluAndMul: fused (replaylm's "
            "Triton kernels kept whole: the eager model's numbers) or native (the torch code, "
            "fused by the compiler itself)",
            ("fused", "native"),
        ),
    )
    compile_cache_dir: str | None = field(
        default=None,
        metadata=_opt(
            "directory where tc_piecewise keeps compiled pieces, so a later start reuses them "
            "(default: Inductor's own cache directory)"
        ),
    )
    log_level: str = field(
        default="info", metadata=_opt("logging level", ("debug", "info", "warning", "error"))
    )

    def validate(self) -> None:
        """Raise ValueError naming the offending flag."""
        for name in (
            "max_total_tokens",
            "context_length",
            "chunked_prefill_size",
            "max_prefill_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_running_requests < 1:
            raise ValueError(
                f"--max-running-requests must be >= 1, got {self.max_running_requests}"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}"
            )
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"--{f.name.replace('_', '-')} must be one of {', '.join(choices)}, "
                    f"got '{getattr(self, f.name)}'"
                )
        if self.deterministic and self.tc_piecewise_kernels == "native":
            raise ValueError(
                "--deterministic needs --tc-piecewise-kernels fused (with native, "
                "compiled pieces would run the compiler's matmuls and fusions)"
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            kind = type(f.default) if f.default is not None else _optional_type(f.type)
            kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help")}
            if f.type.startswith("list[int]"):
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
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _optional_type(annotation: str) -> type:
    """`'int | None'` -> int (annotations are strings under postponed evaluation)."""
    base = annotation.replace("| None", "").strip()
    return {"int": int, "float": float, "str": str, "bool": bool, "list[int]": list}[base]
