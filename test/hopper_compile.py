"""Compile the decode path's Triton kernels for Hopper (sm_90) with no GPU present: Triton's own
front end, its passes and ptxas, as a GPU's first launch would run them (CPU tensors run the
kernels through the interpreter, which takes code the compiler refuses).

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


def _skinny_cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    variants = [  # (dot swapped, K slices, gated, input, norm prologue): each branch once at least
        (False, 1, True, "bf16", None),
        (True, 4, False, "bf16", None),
        (True, 4, False, "fp8", None),
        (True, 1, True, "fp8", None),
        (False, 4, False, "quantize", None),
        (True, 4, True, "quantize", None),
        (True, 4, False, "bf16", "residual"),
        (False, 1, True, "bf16", "plain"),
        (True, 4, True, "quantize", "residual"),
    ]
    for swap, split, gated, mode, norm in variants:
        fp8 = mode != "bf16"
        args = {
            "X": "*fp8e4nv" if mode == "fp8" else "*bf16",
            "W": "*fp8e4nv" if fp8 else "*bf16",
            "B": "*bf16",
            "Scale": "*fp32",
            "XScale": "*fp32",
            "Y": "*bf16",
            "Partials": "*fp32",
            "Arrivals": "*i32",
            **dict(R="*bf16", NormW="*bf16", ResOut="*bf16", eps="fp32", stride_r="i32"),
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
            "QUANTIZE_X": mode == "quantize",
            "NORM": norm is not None,
            "HAS_RESIDUAL": norm == "residual",
            "SWAP": swap,
            "USE_PDL": True,
        }
        label = f"skinny_matmul swap={swap} split_k={split} gated={gated} {mode} norm={norm}"
        cases.append(("replaylm.layers.kernels.skinny_matmul._skinny_matmul_kernel", label, args))
    return cases


def _moe_cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    common = {"TOP_K": 8, "BLOCK_M": 16, "BLOCK_K": 128, "PRECISION": Const("ieee")}
    for swap, fp8 in ((False, False), (True, True)):
        weight = "*fp8e4nv" if fp8 else "*bf16"
        gate_up = {
            **dict(X="*bf16", W13=weight, W13Scale="*fp32", Ids="*i32", Act="*bf16"),
            **dict.fromkeys(["N", "K", "num_experts", "stride_xm", "stride_wn"], "i32"),
            **dict(stride_we="i64", stride_se="i32", stride_am="i32"),
            **common,
            **dict(BLOCKS=16, BLOCK_N=32, SWAP=swap, FP8=fp8, USE_PDL=True),
        }
        down = {
            **dict(Act="*bf16", W2=weight, W2Scale="*fp32", Ids="*i32", Weights="*fp32"),
            **dict(Out="*bf16", Partials="*fp32", Arrivals="*i32"),
            **dict.fromkeys(["N", "K", "num_experts", "stride_am", "stride_wn"], "i32"),
            **dict(stride_we="i64", stride_se="i32", stride_om="i32"),
            **common,
            **dict(BLOCKS=6, BLOCK_N=64, SWAP=swap, FP8=fp8, USE_PDL=True),
        }
        module = "replaylm.layers.moe.pair_experts"
        cases.append(
            (f"{module}._pair_gate_up_kernel", f"pair gate_up swap={swap} fp8={fp8}", gate_up)
        )
        cases.append((f"{module}._pair_down_kernel", f"pair down swap={swap} fp8={fp8}", down))
    for gated, combine, fp8 in ((True, 0, False), (False, 8, False), (False, 8, True)):
        grouped = {
            **dict(A="*fp8e4nv" if fp8 else "*bf16", B="*fp8e4nv" if fp8 else "*bf16", C="*bf16"),
            **dict(SortedIds="*i32", ExpertIds="*i32", NumPostPad="*i32"),
            **dict.fromkeys(["N", "K", "num_pairs", "max_rows", "stride_am", "stride_bn"], "i32"),
            **dict(stride_be="i64", stride_cm="i32", AScale="*fp32", BScale="*fp32"),
            **dict.fromkeys(["stride_asm", "stride_ask", "stride_bse", "stride_bsn"], "i32"),
            **dict(stride_bsk="i32", Weights="*fp32", Out="*bf16", Arrivals="*i32"),
            **dict(stride_om="i32", PAIRS_PER_ROW=8 if gated else 1, COMBINE_TOP_K=combine),
            **dict(GATED=gated, FP8=fp8, GROUP_N=1, GROUP_K=0, BLOCK_M=16, BLOCK_N=64),
            **dict(BLOCK_K=128, GROUP_M=1, PRECISION=Const("ieee"), USE_PDL=True),
        }
        label = f"grouped gemm gated={gated} combine_top_k={combine} fp8={fp8}"
        cases.append(("replaylm.layers.moe.triton_experts._grouped_gemm_kernel", label, grouped))
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
    return cases


def _quantize_cases() -> list[tuple[str, str, dict[str, Any]]]:
    args = {
        **dict(X="*bf16", Q="*fp8e4nv", Scale="*fp32", Static="*fp32"),
        **dict.fromkeys(["n_cols", "group", "num_static", "stride_x"], "i32"),
        **dict(BLOCK=4096, STATIC_BLOCK=1, HAS_STATIC=False, USE_PDL=True),
    }
    name = "replaylm.layers.quantization.fp8_kernels._quantize_kernel"
    return [(name, "quantize activation", args)]


CASES = _skinny_cases() + _moe_cases() + _quantize_cases()


def _kernel(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


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
