"""Compile the decode path's Triton kernels (and the attention kernels' prefill pass) for Hopper
(sm_90) with no GPU present: Triton's own front end, its passes and ptxas, as a GPU's first launch
would run them (CPU tensors run the kernels through the interpreter, which takes code the
compiler refuses).

    python test/hopper_compile.py    # run with TRITON_INTERPRET unset; exit 1 on a failure

Each case names a kernel and its arguments: a pointer or scalar type string (`"*bf16"`, `"i32"`),
or a constexpr's value (`Const` for a string one). test/cpu/test_kernels_compile_for_hopper.py
runs it in a process of its own.
"""

from __future__ import annotations

import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


class Const(str):
    """A string constexpr, not a type."""


def _kernel(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


def _skinny_cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    variants = [  # (dot swapped, K slices, gated, input): each branch of the kernel at least once
        (False, 1, True, "bf16"),
        (True, 4, False, "bf16"),
        (True, 4, False, "fp8"),
        (True, 1, True, "fp8"),
    ]
    for swap, split, gated, mode in variants:
        fp8 = mode == "fp8"
        args = {
            "X": "*fp8e4nv" if fp8 else "*bf16",
            "W": "*fp8e4nv" if fp8 else "*bf16",
            "B": "*bf16",
            "Scale": "*fp32",
            "XScale": "*fp32",
            "Y": "*bf16",
            "Partials": "*fp32",
            "Arrivals": "*i32",
            **dict.fromkeys(["M", "N", "K", "stride_xm", "stride_wn", "stride_ym"], "i32"),
            "BLOCKS_PER_SPLIT": 4,
            "HAS_BIAS": False,
            "SPLIT_K": split,
            "BLOCK_M": 16,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "PRECISION": Const("ieee"),
            "GATED": gated,
            "FP8": fp8,
            "SWAP": swap,
            "USE_PDL": True,
        }
        label = f"skinny_matmul swap={swap} split_k={split} gated={gated} {mode}"
        cases.append(("replaylm.layers.kernels.skinny_matmul._skinny_matmul_kernel", label, args))
    return cases


def _moe_cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    common = {"TOP_K": 8, "BLOCK_M": 16, "BLOCK_K": 128, "PRECISION": Const("ieee")}
    for swap in (False, True):
        gate_up = {
            **dict(X="*bf16", W13="*bf16", Ids="*i32", Act="*bf16"),
            **dict.fromkeys(["N", "K", "num_experts", "stride_xm", "stride_wn"], "i32"),
            **dict(stride_we="i64", stride_am="i32"),
            **common,
            **dict(BLOCKS=16, BLOCK_N=32, SWAP=swap, USE_PDL=True),
        }
        down = {
            **dict(Act="*bf16", W2="*bf16", Ids="*i32", Weights="*fp32"),
            **dict(Out="*bf16", Partials="*fp32", Arrivals="*i32"),
            **dict.fromkeys(["N", "K", "num_experts", "stride_am", "stride_wn"], "i32"),
            **dict(stride_we="i64", stride_om="i32"),
            **common,
            **dict(BLOCKS=6, BLOCK_N=64, SWAP=swap, USE_PDL=True),
        }
        module = "replaylm.layers.moe.pair_experts"
        cases.append((f"{module}._pair_gate_up_kernel", f"pair gate_up swap={swap}", gate_up))
        cases.append((f"{module}._pair_down_kernel", f"pair down swap={swap}", down))
    for split in (1, 8):
        router = {
            **dict(X="*bf16", W="*bf16", Logits="*bf16", Weights="*fp32", Ids="*i32"),
            **dict(Counts="*i64", Slots="*i64", Partials="*fp32", Arrivals="*i32"),
            **dict.fromkeys(["M", "N", "K", "stride_xm", "stride_wn", "first_expert"], "i32"),
            **dict(BLOCKS_PER_SPLIT=2, SPLIT_K=split, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256),
            **dict(BLOCK_E=128, TOP_K=8, BLOCK_TOP_K=8, RENORMALIZE=True, HAS_SLOTS=True),
            **dict(PRECISION=Const("ieee"), SWAP=False, USE_PDL=True),
        }
        label = f"fused router split_k={split}"
        cases.append(("replaylm.layers.moe.fused_router._router_kernel", label, router))
    route = {
        **dict(Logits="*bf16", Weights="*fp32", Ids="*i32", Counts="*i64", Slots="*i64"),
        **dict.fromkeys(["stride_t", "num_tokens", "num_experts", "first_expert"], "i32"),
        **dict(TOP_K=8, BLOCK_E=128, BLOCK_K=8, RENORMALIZE=True, HAS_SLOTS=True, USE_PDL=True),
    }
    cases.append(("replaylm.layers.moe.fused_routing._route_kernel", "route", route))
    for count_all in (True, False):  # a decode step's pairs in one launch; more in three
        place = {
            **dict(Ids="*i32", Hist="*i32", Totals="*i32", Base="*i32", SortedIds="*i32"),
            **dict(ExpertIds="*i32", NumPostPad="*i32"),
            **dict.fromkeys(["numel", "num_experts", "num_chunks"], "i32"),
            **dict(BLOCK_M=16, BINS=256, SCAN=2048 if count_all else 1024, CHUNKS=1024),
            **dict(COUNT_ALL=count_all, USE_PDL=True),
        }
        label = f"moe align place count_all={count_all}"
        cases.append(("replaylm.layers.moe.moe_align._place_kernel", label, place))
    return cases


def _quantize_cases() -> list[tuple[str, str, dict[str, Any]]]:
    args = {
        **dict(X="*bf16", Q="*fp8e4nv", Scale="*fp32", Static="*fp32"),
        **dict.fromkeys(["n_cols", "group", "num_static", "stride_x"], "i32"),
        **dict(BLOCK=4096, STATIC_BLOCK=1, HAS_STATIC=False, USE_PDL=True),
    }
    module = "replaylm.layers.quantization.fp8_kernels"
    cases = [(f"{module}._quantize_kernel", "quantize activation", args)]
    split = {
        **dict(X="*bf16", Q="*fp8e4nv", Scale="*fp32", n_cols="i32", stride_x="i32"),
        **dict(BLOCK=16384, PIECE=1024, USE_PDL=True),
    }
    cases.append((f"{module}._split_quantize_kernel", "quantize activation in pieces", split))
    for chunks in (1, 4):
        silu = {
            **dict(X="*bf16", Q="*fp8e4nv", Scale="*fp32", width="i32", stride_x="i32"),
            **dict(CHUNK=4096, CHUNKS=chunks, USE_PDL=True),
        }
        cases.append((f"{module}._silu_mul_quantize_kernel", f"silu-mul quantize x{chunks}", silu))
    return cases


def _norm_cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    for top_k in (0, 8):  # 8: a MoE layer's rows, summed in the norm's launch
        norm = {
            **dict(X="*bf16", R="*bf16", W="*bf16", Out="*bf16", ResOut="*bf16"),
            **dict(ExpertWeights="*fp32", ExpertIds="*i32", eps="fp32"),
            **dict.fromkeys(["n_rows", "n_cols", "stride_x", "stride_r", "num_experts"], "i32"),
            **dict(HAS_RESIDUAL=True, BLOCK_ROWS=1, BLOCK_D=2048, TOP_K=top_k, USE_PDL=True),
        }
        label = f"rms norm top_k={top_k}"
        cases.append(("replaylm.layers.kernels.rmsnorm._rms_norm_kernel", label, norm))
        quantize = {
            **dict(X="*bf16", R="*bf16", W="*bf16", Q="*fp8e4nv", Scale="*fp32", ResOut="*bf16"),
            **dict(ExpertWeights="*fp32", ExpertIds="*i32", eps="fp32"),
            **dict.fromkeys(["n_rows", "n_cols", "stride_x", "stride_r", "num_experts"], "i32"),
            **dict(HAS_RESIDUAL=True, BLOCK_D=4096, TOP_K=top_k, USE_PDL=True),
        }
        module = "replaylm.layers.quantization.fp8_kernels"
        label = f"rms norm quantize top_k={top_k}"
        cases.append((f"{module}._rms_norm_quantize_kernel", label, quantize))
        split = {**quantize, "PIECE": 1024}  # decode rows: a program a piece
        cases.append((f"{module}._split_rms_norm_quantize_kernel", f"split {label}", split))
    return cases


def _attention_cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    module = "replaylm.layers.attention.triton"
    for cache in ("bf16", "fp8e4nv"):  # an fp8 cache's dots take float16 (`dot_operand`)
        decode = {
            **dict.fromkeys(["qk_scale", "v_scale"], "fp32"),
            **dict(Q="*bf16", KCache=f"*{cache}", VCache=f"*{cache}", ReqToToken="*i32"),
            **dict(ReqPoolIndices="*i64", SeqLens="*i64", Order="*i32", Out="*bf16"),
            **dict(MidO="*fp32", MidLse="*fp32", Arrivals="*i32"),
            **dict.fromkeys(["min_split_len", "num_splits", "has_order", "num_rows"], "i32"),
            **dict(NUM_KV_HEADS=8, GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_N=64),
            **dict(MERGE_UNROLL=4, PRECISION=Const("tf32"), SEPARATE_MERGE=True, USE_PDL=True),
            "ROWS": 1,
        }
        extend = {
            **dict(Q="*bf16", KNew="*bf16", VNew="*bf16", Out="*bf16", ReqToToken="*i32"),
            **dict(KCache=f"*{cache}", VCache=f"*{cache}", ReqPoolIndices="*i64"),
            **dict.fromkeys(["PrefixLens", "ExtendLens", "ExtendStart"], "*i64"),
            **dict.fromkeys(["qk_scale", "v_scale"], "fp32"),
            **dict(GROUP=4, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, PRECISION=Const("tf32")),
            **dict(ALIGNED=cache == "fp8e4nv", USE_PDL=True),
        }
        for name, args in (("decode", decode), ("extend", extend)):
            kernel = f"{module}.{name}._{name}_kernel"
            strides = [n for n in _kernel(kernel).arg_names if n.startswith("stride")]
            cases.append(
                (
                    kernel,
                    f"{name} attention {cache} cache",
                    {**args, **dict.fromkeys(strides, "i32")},
                )
            )
    return cases


CASES = _skinny_cases() + _moe_cases() + _quantize_cases() + _norm_cases() + _attention_cases()


def compile_for_hopper(path: str, args: dict[str, Any]) -> None:
    """Compile kernel `path` (module.name) with `args` for sm_90, 4 warps, 3 stages."""
    kernel = _kernel(path)
    signature, constants = {}, {}
    for name in kernel.arg_names:
        value = args[name]
        if isinstance(value, str) and not isinstance(value, Const):
            signature[name] = value
        else:
            signature[name] = "constexpr"
            constants[name] = str(value) if isinstance(value, Const) else value
    source = ASTSource(kernel, signature, constants)
    triton.compile(source, target=HOPPER, options={"num_warps": 4, "num_stages": 3})


def main() -> int:
    failures = 0
    for path, label, args in CASES:
        try:
            compile_for_hopper(path, args)
            print(f"ok {label}", flush=True)
        except Exception as err:  # a compile error of any kind is this tool's finding
            failures += 1
            print(f"FAIL {label}: {type(err).__name__}: {err}", flush=True)
    print(f"{len(CASES) - failures} of {len(CASES)} compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
