"""ServerArgs: every option of the engine and server, in one dataclass.

The argparse flags are generated from the fields (`model_path` -> `--model-path`), so a new option
is one field with its help text. `validate()` checks values and names the flag in its message.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from replaylm.model_loader.builtin_models import DEFAULT_MODEL
from replaylm.model_loader.loader import LOAD_FORMATS
from replaylm.utils import DTYPES


def _opt(help_text: str, choices: tuple[str, ...] | None = None) -> Any:
    return {"help": help_text, "choices": choices}


ATTENTION_BACKEND_CHOICES = ("auto", "torch_native")


@dataclass
class ServerArgs:
    # HTTP server
    host: str = field(default="127.0.0.1", metadata=_opt("address the HTTP server binds"))
    port: int = field(default=30000, metadata=_opt("port the HTTP server listens on"))
    served_model_name: str | None = field(default=None, metadata=_opt(
        "model name in the API (/v1/models, the `model` field); default: --model-path"))
    api_key: str | None = field(default=None, metadata=_opt(
        "if set, requests must send `Authorization: Bearer <key>`"))
    # model and loading
    model_path: str = field(default=DEFAULT_MODEL, metadata=_opt(
        "HF folder, .gguf file, config .json (dummy load) or built-in model name"))
    tokenizer_path: str | None = field(default=None, metadata=_opt(
        "tokenizer location when it differs from --model-path"))
    load_format: str = field(default="auto", metadata=_opt(
        "weights format; dummy = random weights of the right shapes", LOAD_FORMATS))
    dtype: str = field(default="auto", metadata=_opt(
        "weights/activations dtype; auto = float32 on CPU, the checkpoint's 16-bit type on GPU",
        ("auto", *DTYPES)))
    device: str = field(default="auto", metadata=_opt("where to run", ("auto", "cuda", "cpu")))
    seed: int = field(default=0, metadata=_opt(
        "seed for dummy weights and for requests that give no sampling seed"))
    # memory
    mem_fraction_static: float = field(default=0.80, metadata=_opt(
        "GPU: fraction of device memory for weights + KV cache"))
    max_total_tokens: int | None = field(default=None, metadata=_opt(
        "KV cache size in tokens (default: from --mem-fraction-static on GPU, 1 GiB on CPU)"))
    max_running_requests: int = field(default=256, metadata=_opt(
        "most requests held in the request table at once"))
    context_length: int | None = field(default=None, metadata=_opt(
        "longest sequence (prompt + output); default: the model's max_position_embeddings"))
    # scheduling
    chunked_prefill_size: int = field(default=2048, metadata=_opt(
        "prompts longer than this are prefilled in chunks of this many tokens"))
    max_prefill_tokens: int = field(default=8192, metadata=_opt(
        "most new tokens in one prefill batch (one prompt chunk is always admitted)"))
    # kernels
    attention_backend: str = field(default="auto", metadata=_opt(
        "attention implementation", ATTENTION_BACKEND_CHOICES))
    # CUDA-graph flags go here (see cuda_graph_config.py once it lands)
    log_level: str = field(default="info", metadata=_opt(
        "logging level", ("debug", "info", "warning", "error")))

    def validate(self) -> None:
        """Raise ValueError naming the offending flag."""
        for name in ("max_total_tokens", "context_length", "chunked_prefill_size",
                     "max_prefill_tokens"):
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

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            kind = type(f.default) if f.default is not None else _optional_type(f.type)
            kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata.get("help")}
            if kind is bool:
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
    return {"int": int, "float": float, "str": str, "bool": bool}[base]
