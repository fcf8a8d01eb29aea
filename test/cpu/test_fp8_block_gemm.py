"""The FP8 kernels (`fp8_kernels`) on the CPU, through Triton's interpreter: the activation
quantization against `fp8.quantize_activation` bit for bit, the block-scaled GEMM against the
float32 emulation (`fp8_linear._emulated`) at ragged and real shapes, `fp8_linear`'s GPU route
with the kernel device pointed at the CPU (block scales, bias, output dtypes; the per-channel
path's quantization kernel; one custom op under torch.compile), the launch configs; and
benchmark/bench_fp8_gemm.py's shapes and arithmetic (timing needs a CUDA GPU).

Tolerances: the GEMM sums the same float32 products as the emulation in another order and
scales each block's sum at once, so the two differ by float32 rounding alone, checked against
1e-6 of `|x| @ |w|^T` (the dequantized operands': what the sum's rounding error scales with).
bf16 results may differ by one bf16 step more: the interpreter truncates float32 -> bf16 (the
GPU rounds to nearest).
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import require_triton_interpreter, scalar_loop_bounds

require_triton_interpreter()

from replaylm.layers import kernels  # noqa: E402
from replaylm.layers.kernels import native_only  # noqa: E402
from replaylm.layers.kernels.rmsnorm import rms_norm  # noqa: E402
from replaylm.layers.kernels.silu_mul import silu_and_mul  # noqa: E402
from replaylm.layers.kernels.skinny_matmul import (  # noqa: E402
    FP8_MAX_ROWS,
    MAX_ROWS,
    MatmulConfig,
    skinny_matmul,
)
from replaylm.layers.layernorm import RMSNorm  # noqa: E402
from replaylm.layers.linear import GateUpLinear, Linear  # noqa: E402
from replaylm.layers.quantization import fp8_kernels  # noqa: E402
from replaylm.layers.quantization import fp8_linear as fp8_linear_module  # noqa: E402
from replaylm.layers.quantization.config import Fp8Config  # noqa: E402
from replaylm.layers.quantization.fp8 import (  # noqa: E402
    FP8_DTYPE,
    QuantizedRows,
    dequantize_activation,
    dequantize_weight,
    quantize_activation,
    quantize_weight,
)
from replaylm.layers.quantization.fp8_kernels import (  # noqa: E402
    BlockGemmConfig,
    block_fp8_matmul,
    block_gemm_config,
)
from replaylm.layers.quantization.fp8_linear import (  # noqa: E402
    SKINNY_ROWS,
    fp8_linear,
    gated_fp8_linear,
    takes_skinny,
)

from script_import import import_script  # noqa: E402

BLOCK = (128, 128)
ROUNDING = 1e-6  # of |x| @ |w|^T: float32 rounding of the sums (the module docstring)
BF16_STEP = 2.0**-7  # bf16's largest spacing relative to a value
EMULATED = fp8_linear_module._emulated  # the reference, kept from before any test replaces it


@pytest.fixture(autouse=True, scope="module")
def _interpreter_scalar_index():
    with scalar_loop_bounds():
        yield


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _activations(tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of magnitudes 1e-4 to 1e3 (the smallest quantize partly to e4m3 subnormals), row 1
    all zeros, and the columns past 128 ten times larger than those before."""
    x = torch.randn(tokens, width, generator=_gen(seed))
    x *= torch.logspace(-4, 3, tokens)[:, None] if tokens > 1 else 1.0
    x[:, 128:] *= 10.0
    if tokens > 1:
        x[1] = 0.0
    return x.to(dtype)


def _block_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 `[n, k]` weight and its 128x128 block scales, the blocks' magnitudes far apart
    (a scale applied to the wrong rows or columns shows)."""
    rows = torch.where(torch.arange(n) < 128, 1.0, 30.0)
    cols = torch.tensor([1.0, 0.02, 5.0, 0.3])[torch.arange(k) // 128 % 4]
    w = torch.randn(n, k, generator=_gen(seed)) * rows[:, None] * cols[None, :] / k**0.5
    return quantize_weight(w, BLOCK)


def _rounding_bound(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """ROUNDING of `|x| @ |w|^T` over the block-quantized operands."""
    x_deq = dequantize_activation(*quantize_activation(x, BLOCK[1]), BLOCK[1])
    return ROUNDING * x_deq.abs() @ dequantize_weight(weight, scale, BLOCK).abs().T


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- activation quantization --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [None, 128, 48], ids=["per_token", "group128", "group48"])
def test_quantization_is_the_torch_codes_bit_for_bit(dtype: torch.dtype, group: int | None):
    """320 columns: groups of 128 end with one of 64, groups of 48 with one of 32; the input a
    column slice of a wider tensor (its row stride not its width)."""
    wide = _activations(6, 400, dtype, seed=1)
    x = wide[:, :320]
    q, scale = fp8_kernels.quantize_activation(x, group)
    want_q, want_scale = quantize_activation(x, group)
    groups = {None: 1, 128: 3, 48: 7}[group]
    assert scale.shape == (6, groups) and scale.is_contiguous() and q.shape == (6, 320)
    assert _same_bits(q, want_q)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q[1].float(), torch.zeros(320)) and (scale[1] > 0).all()


@pytest.mark.parametrize("rows", [1, fp8_kernels.SPLIT_ROWS, fp8_kernels.SPLIT_ROWS + 1])
def test_decode_rows_split_into_pieces_quantize_bit_for_bit(rows: int) -> None:
    """Up to SPLIT_ROWS rows wider than a piece (2,500 columns: three pieces of 1,024, the last
    ragged; a column slice of a wider tensor) take a program a piece; past them one a row: the
    torch code's numbers either way, and the pieces' scale is the whole row's."""
    assert fp8_kernels.SPLIT_PIECE < 2500 <= 3 * fp8_kernels.SPLIT_PIECE
    x = _activations(rows, 2600, torch.bfloat16, seed=3)[:, :2500]
    q, scale = fp8_kernels.quantize_activation(x)
    want_q, want_scale = quantize_activation(x)
    assert scale.shape == (rows, 1) and q.shape == (rows, 2500)
    assert _same_bits(q, want_q)
    assert torch.equal(scale, want_scale)


def test_ties_round_to_even_and_signed_zeros_stay():
    """A row whose amax is 448 has scale 1: e4m3's midpoints (ties) and their float32
    neighbours quantize as torch's cast does, and -0.0 keeps its sign."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite() & (grid.abs() <= 448)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    row = torch.cat([torch.tensor([448.0, -0.0]), mids, up.clamp(-448, 448), down])
    q, scale = fp8_kernels.quantize_activation(row[None, :])
    assert float(scale) == 1.0
    assert _same_bits(q, quantize_activation(row[None, :])[0])


@pytest.mark.parametrize("static", [[0.01, 0.04, 0.02], 0.03], ids=["shards", "one"])
def test_a_static_scale_is_the_largest_and_saturates(static: list[float] | float):
    """Values past 448 times the scale saturate at +-448; every row's scale is the largest."""
    x = torch.randn(4, 200, generator=_gen(2)).to(torch.bfloat16) * 20
    scale_in = torch.tensor(static)
    q, scale = fp8_kernels.quantize_activation(x, static_scale=scale_in)
    want_q, want_scale = quantize_activation(x, static_scale=scale_in)
    assert _same_bits(q, want_q) and torch.equal(scale, want_scale)
    assert torch.equal(scale, torch.full((4, 1), max(scale_in.reshape(-1).tolist())))
    assert float(q.float().abs().max()) == 448.0


# ---- the block-scaled GEMM ----------------------------------------------------------------

CONFIGS = {
    "default": None,
    "16x128": BlockGemmConfig(16, 128, num_warps=4, num_stages=2, group_m=2),
    # a tile wider than a weight block: its columns' scales come from two block rows
    "16x256": BlockGemmConfig(16, 256, num_warps=4, num_stages=2, group_m=2),
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_block_gemm_equals_the_emulation(tokens: int, config: BlockGemmConfig | None):
    """N = 200 and K = 320 (the last block of each ragged), 1 to 3 row tiles."""
    weight, scale = _block_weight(200, 320, seed=3)
    x = _activations(tokens, 320, torch.bfloat16, seed=4)
    x_q, x_scale = fp8_kernels.quantize_activation(x, BLOCK[1])
    got = block_fp8_matmul(x_q, x_scale, weight, scale, BLOCK, torch.float32, config)
    want = EMULATED(x, weight, scale, BLOCK, None)
    bound = _rounding_bound(x, weight, scale)
    assert got.dtype == torch.float32 and got.shape == (tokens, 200)
    assert want.abs().max() > 1e3 * bound.max()
    assert ((got - want).abs() <= bound).all()


def test_block_gemm_at_qwen3_0_6b_o_projection():
    """Qwen3-0.6B's o projection (N 1024, K 2048: 16 steps of K), two tokens, default launch."""
    weight, scale = _block_weight(1024, 2048, seed=5)
    x = _activations(2, 2048, torch.bfloat16, seed=6)
    got = fp8_kernels.block_fp8_linear(x, weight, scale, BLOCK, torch.float32)
    want = EMULATED(x, weight, scale, BLOCK, None)
    assert ((got - want).abs() <= _rounding_bound(x, weight, scale)).all()


def test_operands_it_does_not_take_are_refused():
    weight, scale = _block_weight(64, 96, seed=7)
    x_q, x_scale = fp8_kernels.quantize_activation(torch.ones(2, 96), 96)
    with pytest.raises(ValueError, match="block k must be a power of two >= 16, not 96"):
        block_fp8_matmul(x_q, x_scale, weight, torch.ones(1, 1), (128, 96), torch.float32)
    x_q, x_scale = fp8_kernels.quantize_activation(torch.ones(2, 96), 128)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[1, 1\], not \[64\]"):
        block_fp8_matmul(x_q, x_scale, weight, torch.ones(64), BLOCK, torch.float32)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        block_fp8_matmul(x_q.float(), x_scale, weight, scale, BLOCK, torch.float32)


def test_launch_configs_by_rows_and_width():
    """Decode: 16-row tiles, columns as wide as still make 128 programs (else 32); prefill:
    128 x 128 tiles on 8 warps."""
    assert block_gemm_config(1, 28672) == BlockGemmConfig(16, 128, num_warps=4, num_stages=4)
    assert block_gemm_config(8, 12288).block_n == 64
    assert block_gemm_config(1, 4096).block_n == 32  # 32 tiles of 128 would leave SMs idle
    assert [block_gemm_config(m, 4096).block_m for m in (16, 17, 32, 64, 256, 257)] == [
        16,
        32,
        32,
        64,
        64,
        128,
    ]
    assert block_gemm_config(8192, 28672) == BlockGemmConfig(128, 128, num_warps=8, num_stages=3)
    assert block_gemm_config(1024, 1024).block_n == 64  # 8 x 16 tiles


# ---- fp8_linear's GPU route on the CPU ----------------------------------------------------


@pytest.fixture
def kernel_device_cpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Point the kernel device at the CPU (fp8_linear takes its GPU route there; the emulation
    would raise) and count the quantization kernel's calls."""
    monkeypatch.setattr(kernels, "KERNEL_DEVICE_TYPE", "cpu")
    calls = {"quantize": 0}
    quantize = fp8_kernels.quantize_activation

    def counted(*args, **kwargs):
        calls["quantize"] += 1
        return quantize(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the emulation ran on the kernel device")

    monkeypatch.setattr(fp8_kernels, "quantize_activation", counted)
    monkeypatch.setattr(fp8_linear_module, "_emulated", refuse)
    return calls


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_runs_block_scales_on_the_kernels(
    out_dtype: torch.dtype, kernel_device_cpu: dict[str, int]
):
    """A 3-D bf16 input and a bias in the output dtype: the emulation's numbers, up to the
    rounding of adding the bias (bf16: and a step for the truncating cast)."""
    weight, scale = _block_weight(200, 320, seed=8)
    x = _activations(6, 320, torch.bfloat16, seed=9)
    bias = torch.randn(200, generator=_gen(10)).to(out_dtype)
    want = EMULATED(x, weight, scale, BLOCK, None).reshape(2, 3, 200)
    bound = _rounding_bound(x, weight, scale).reshape(2, 3, 200)
    got = fp8_linear(x.reshape(2, 3, 320), weight, scale, BLOCK, bias, out_dtype=out_dtype)
    assert kernel_device_cpu["quantize"] == 1
    assert got.dtype == out_dtype and got.shape == (2, 3, 200)
    want = want + bias.float()
    step = BF16_STEP if out_dtype == torch.bfloat16 else 2.0**-23  # the bias add's rounding
    bound = bound + step * ((want - bias.float()).abs() + want.abs())
    assert ((got.float() - want).abs() <= bound).all()


@pytest.mark.parametrize("static", [None, torch.tensor([0.05, 0.2])], ids=["dynamic", "static"])
def test_the_per_channel_path_quantizes_with_the_kernel(
    static: torch.Tensor | None, kernel_device_cpu: dict[str, int]
):
    """Per-channel weights on the kernel device, more rows than the skinny kernel's: one
    quantization kernel call, then torch._scaled_mm (where this torch runs it on the CPU);
    inside native_only() the torch quantization. Both give the emulation's numbers, rounded to
    bf16 (row-wise scaling's output) before the cast to float32."""
    weight, scale = quantize_weight(torch.randn(64, 96, generator=_gen(11)), None)
    x = torch.randn(SKINNY_ROWS + 3, 96, generator=_gen(12)).to(torch.bfloat16)
    try:
        got = fp8_linear(x, weight, scale, None, out_dtype=torch.float32, input_scale=static)
    except RuntimeError as err:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {err}")
    assert kernel_device_cpu["quantize"] == 1
    with native_only():
        native = fp8_linear(x, weight, scale, None, out_dtype=torch.float32, input_scale=static)
    assert kernel_device_cpu["quantize"] == 1
    assert torch.equal(got, native)
    x_q, x_scale = quantize_activation(x, static_scale=static)
    want = dequantize_activation(x_q, x_scale) @ dequantize_weight(weight, scale, None).T
    bound = (
        ROUNDING
        * dequantize_activation(x_q, x_scale).abs()
        @ (dequantize_weight(weight, scale, None).abs().T)
    ) + want.abs() * 2.0**-8
    assert ((got - want).abs() <= bound).all()


def test_the_block_path_traces_as_one_custom_op(kernel_device_cpu: dict[str, int]):
    """Under torch.compile (fullgraph) the quantization and GEMM are the custom op
    `replaylm::fp8_block_linear`, with the eager numbers."""
    weight, scale = _block_weight(200, 320, seed=13)
    x = _activations(3, 320, torch.bfloat16, seed=14)
    eager = fp8_linear(x, weight, scale, BLOCK, out_dtype=torch.float32)
    targets: list[object] = []

    def recording(gm: torch.fx.GraphModule, _inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fp8_linear, backend=recording, fullgraph=True)
    got = compiled(x, weight, scale, BLOCK, out_dtype=torch.float32)
    assert torch.ops.replaylm.fp8_block_linear in targets
    assert torch.equal(got, eager)


# ---- benchmark/bench_fp8_gemm.py ----------------------------------------------------------


def test_the_benchmark_takes_the_models_projections_and_counts_flops(capsys):
    bench = import_script("benchmark/bench_fp8_gemm.py")
    assert bench.projections(bench.model_config("llama-3.1-8b")) == {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }
    assert bench.projections(bench.model_config("qwen3-0.6b")) == {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "gate_up": (6144, 1024),
        "down": (1024, 3072),
    }
    assert bench.tflops(1000, 2000, 3000, us=1e6) == pytest.approx(1.2e-2)
    l2 = 50 * 2**20
    assert bench.weight_copies(1024, 2048, l2) == 50  # 2 MiB each, L2 twice over
    assert bench.weight_copies(28672, 4096, l2) == 1
    assert bench.weight_copies(16, 16, l2) == bench.MAX_COPIES
    with pytest.raises(SystemExit) as done:
        bench.main(["--help"])
    assert done.value.code == 0 and "do_bench_cudagraph" in capsys.readouterr().out


@pytest.mark.parametrize("rows", [1, 5, 40, SKINNY_ROWS])
def test_decode_rows_run_the_skinny_kernel_on_the_quantized_input(
    rows: int, kernel_device_cpu: dict[str, int]
) -> None:
    """Up to SKINNY_ROWS rows, per-channel weights run the skinny matmul on the input quantized
    per token (one quantization launch, FP8 dots, both scales on the float32 sums): the
    emulation's numbers; K over several split-K slices up to 16 rows, in 64-row tiles past."""
    assert SKINNY_ROWS == FP8_MAX_ROWS
    weight, scale = quantize_weight(torch.randn(48, 1024, generator=_gen(13)), None)
    x = torch.randn(rows, 1024, generator=_gen(14))
    got = fp8_linear(x, weight, scale, None, out_dtype=torch.float32)
    assert kernel_device_cpu["quantize"] == 1
    torch.testing.assert_close(got, EMULATED(x, weight, scale, None, None), rtol=1e-5, atol=1e-4)
    if rows <= MAX_ROWS:  # the dot taken the other way round: the same sums
        x_q, x_scale = fp8_kernels.quantize_activation(x)
        swapped = MatmulConfig(64, 128, 2, num_warps=4, num_stages=2, swap=True)
        torch.testing.assert_close(
            skinny_matmul(
                x_q,
                weight,
                config=swapped,
                out_dtype=torch.float32,
                weight_scale=scale,
                x_scale=x_scale,
            ),
            got,
        )


def _gated_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """SiluAndMul of the emulated FP8 matmul of `x` and the `[gate; up]` weight, in float32."""
    gate, up = EMULATED(x.float(), weight, scale, None, None).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("rows", [1, SKINNY_ROWS])
def test_decode_rows_run_gate_up_and_silu_in_one_skinny_launch(
    rows: int, kernel_device_cpu: dict[str, int]
) -> None:
    """A `[gate; up]` per-channel weight at decode rows (what `GateUpLinear` takes when
    `takes_skinny`): the quantization, then one launch with SiluAndMul in its epilogue, the
    numbers of the matmul then SiluAndMul's kernel; more rows or block scales go fp8_linear's
    way."""
    weight, scale = quantize_weight(torch.randn(2 * 40, 512, generator=_gen(21)), None)
    x = torch.randn(rows, 512, generator=_gen(22))
    assert takes_skinny(x, None) and not takes_skinny(x, BLOCK)
    assert not takes_skinny(torch.zeros(SKINNY_ROWS + 1, 512), None)
    got = gated_fp8_linear(x, weight, scale)
    assert got.shape == (rows, 40) and got.dtype == torch.float32
    assert kernel_device_cpu["quantize"] == 1
    torch.testing.assert_close(got, silu_and_mul(fp8_linear(x, weight, scale, None)))
    torch.testing.assert_close(got, _gated_reference(x, weight, scale), rtol=1e-4, atol=1e-3)


def test_bf16_decode_rows_within_a_bf16_step_of_the_emulation(
    kernel_device_cpu: dict[str, int],
) -> None:
    """A bf16 input at decode rows: the emulation's float32 numbers rounded to bf16 (within a
    step), and the gated launch is that product then SiluAndMul's kernel."""
    weight, scale = quantize_weight(torch.randn(2 * 40, 512, generator=_gen(25)), None)
    x = torch.randn(3, 512, generator=_gen(26)).bfloat16()
    got = fp8_linear(x, weight, scale, None)
    assert got.dtype == torch.bfloat16
    want = EMULATED(x, weight, scale, None, None)
    torch.testing.assert_close(got.float(), want, rtol=BF16_STEP, atol=1e-2)
    torch.testing.assert_close(gated_fp8_linear(x, weight, scale), silu_and_mul(got))


def test_an_fp8_gate_up_layer_takes_the_one_launch_at_decode_rows(
    kernel_device_cpu: dict[str, int],
) -> None:
    """GateUpLinear with per-channel FP8 weights: SiluAndMul's own kernel runs only past the
    skinny kernel's rows; at decode rows the gated launch, on the quantized input."""
    layer = GateUpLinear(512, 40, quant=Fp8Config("channel"))
    weight, scale = quantize_weight(torch.randn(80, 512, generator=_gen(23)), None)
    layer.weight.data.copy_(weight)
    layer.weight_scale.data.copy_(scale)
    separate = layer.act.forward
    activations: list[int] = []
    layer.act.forward = lambda y: activations.append(y.shape[0]) or separate(y)
    x = torch.randn(SKINNY_ROWS + 1, 512, generator=_gen(24))
    assert layer(x).shape == (SKINNY_ROWS + 1, 40) and activations == [SKINNY_ROWS + 1]
    got = layer(x[:3])
    assert activations == [SKINNY_ROWS + 1]  # the 3 rows: one gated launch
    torch.testing.assert_close(got, _gated_reference(x[:3], weight, scale), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(
    ("rows", "width"),
    [(5, 320), (1, 2500), (fp8_kernels.SPLIT_ROWS, 2500), (fp8_kernels.SPLIT_ROWS + 1, 2500)],
)
def test_rms_norm_quantize_is_the_norm_then_the_quantization(
    with_residual: bool, rows: int, width: int
) -> None:
    """One launch gives what RMSNorm's kernel then the quantization kernel give, bit for bit:
    the same e4m3 values and scales, and the same residual sum; also where decode rows wider
    than a piece (2,500 columns: three pieces, the last ragged) take a program a piece."""
    x = torch.randn(rows, width, generator=_gen(31)).bfloat16()
    residual = torch.randn(rows, width, generator=_gen(32)).bfloat16() if with_residual else None
    weight = (torch.rand(width, generator=_gen(33)) + 0.5).bfloat16()
    got, summed = fp8_kernels.rms_norm_quantize(x, weight, 1e-6, residual)
    normed = rms_norm(x, weight, 1e-6, residual)
    if residual is not None:
        normed, want_sum = normed
        assert summed is not None and torch.equal(summed, want_sum)
    else:
        assert summed is None
    want_q, want_scale = fp8_kernels.quantize_activation(normed)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(got.scale, want_scale)


@pytest.mark.parametrize("quant", [Fp8Config("channel"), Fp8Config("block", block_size=BLOCK)])
def test_a_norm_feeding_a_per_channel_layer_hands_it_quantized_rows(
    quant: Fp8Config, kernel_device_cpu: dict[str, int]
) -> None:
    """An RMSNorm that `quantizes_for` an FP8 layer hands it `QuantizedRows` where the layer
    takes them (per-channel weights, dynamic scales: no quantization launch of its own, the
    unfused numbers) and a plain tensor where it does not (block scales)."""
    layer = GateUpLinear(256, 128, quant=quant)
    weight, scale = quantize_weight(torch.randn(256, 256, generator=_gen(34)), quant.block_size)
    layer.weight.data.copy_(weight)
    layer.weight_scale.data.copy_(scale)
    norm = RMSNorm(256).bfloat16()
    norm.weight.data.copy_(torch.rand(256, generator=_gen(35)) + 0.5)
    norm.quantizes_for(layer)
    x = torch.randn(3, 256, generator=_gen(36)).bfloat16()
    normed = norm(x)
    assert isinstance(normed, QuantizedRows) == (quant.block_size is None)
    calls = kernel_device_cpu["quantize"]
    got = layer(normed)
    assert kernel_device_cpu["quantize"] == calls + (quant.block_size is not None)
    assert torch.equal(got, layer(rms_norm(x, norm.weight, norm.eps)))


@pytest.mark.parametrize("chunk", [None, 128])
def test_silu_and_mul_quantize_is_the_activation_then_the_quantization(chunk: int | None) -> None:
    """One launch gives what SiluAndMul's kernel then the quantization kernel give, bit for bit
    (a width that is no power of two: the last block's columns masked), the row held whole or
    read in chunks (three of 128 columns, the last one ragged)."""
    x = torch.randn(4, 2 * 300, generator=_gen(41)).bfloat16() * 3
    rows = fp8_kernels.silu_and_mul_quantize(x, chunk=chunk)
    want_q, want_scale = fp8_kernels.quantize_activation(silu_and_mul(x))
    assert rows.dtype == torch.bfloat16 and rows.q.shape == (4, 300)
    assert torch.equal(rows.q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(rows.scale, want_scale)


def test_a_gate_up_layer_past_the_skinny_rows_hands_down_quantized_rows(
    kernel_device_cpu: dict[str, int],
) -> None:
    """Past the skinny kernel's rows a per-channel FP8 gate-up layer that `quantizes_for` its
    down projection gives it SiluAndMul's output quantized in the same launch: the down
    projection quantizes nothing itself, and its numbers are the unfused ones."""
    gate_up = GateUpLinear(96, 64, quant=Fp8Config("channel"))
    down = Linear(64, 48, quant=Fp8Config("channel"))
    for layer, seed in ((gate_up, 42), (down, 43)):
        weight, scale = quantize_weight(torch.randn(layer.weight.shape, generator=_gen(seed)), None)
        layer.weight.data.copy_(weight)
        layer.weight_scale.data.copy_(scale)
    x = torch.randn(SKINNY_ROWS + 3, 96, generator=_gen(44)).bfloat16()
    try:
        unfused = down(gate_up(x))
    except RuntimeError as err:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {err}")
    gate_up.quantizes_for(down)
    calls = kernel_device_cpu["quantize"]
    rows = gate_up(x)
    assert isinstance(rows, QuantizedRows)
    assert torch.equal(down(rows), unfused)
    assert kernel_device_cpu["quantize"] == calls + 1  # gate-up's input alone
