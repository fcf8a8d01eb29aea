"""tc_piecewise's compile path on the CPU: the attention custom op, the graph-splitting pass on a
toy FX graph, the compiled forward of a real tiny model through the graph runners (equal to the
eager model, one compile for every token count), and the compile-failure error."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from replaylm.compilation.compile_model import (
    CompiledForward,
    TcPiecewiseCompileError,
    TcPiecewiseOptions,
)
from replaylm.compilation.split import split_at_ops
from replaylm.layers.attention.layer import attention_layers
from replaylm.layers.attention.ops import attention_context
from replaylm.model_executor.cuda_graph.backend.tc_piecewise import TcPiecewiseCudaGraphBackend
from replaylm.model_executor.cuda_graph.runner.base import RunnerContext
from replaylm.model_executor.cuda_graph.runner.decode import DecodeCudaGraphRunner
from replaylm.model_executor.cuda_graph.runner.prefill import PrefillCudaGraphRunner
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams

from model_parity import tiny_dummy_runner


@torch.library.custom_op("replaylm_test::mix", mutates_args=())
def mix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * 2 - b


@mix.register_fake
def _mix_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(a)


class ToyLayers(nn.Module):
    """`n` opaque `mix` calls with compute before, between and after them."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(8, 8) for _ in range(n + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linears[0](x).relu()
        for linear in self.linears[1:]:
            x = linear(torch.ops.replaylm_test.mix(x, x.sin()))
        return x


@pytest.mark.parametrize("n", [0, 1, 5])
def test_split_gives_one_compute_piece_more_than_opaque_calls(n):
    toy = ToyLayers(n)
    gm = fx.symbolic_trace(toy)
    split_ops = {torch.ops.replaylm_test.mix.default, torch.ops.replaylm_test.mix}
    split = split_at_ops(gm, split_ops)
    assert len(split.compute_pieces) == n + 1
    assert [p.opaque for p in split.pieces] == [False] + [True, False] * n  # in call order
    for piece in split.pieces:  # an opaque piece holds exactly its one call
        calls = [
            node.target
            for node in getattr(split.module, piece.name).graph.nodes
            if node.op == "call_function"
        ]
        assert (len(calls) == 1 and calls[0] in split_ops) == piece.opaque
    x = torch.randn(3, 8)
    torch.testing.assert_close(split.module(x), toy(x), rtol=0, atol=0)


def test_attention_custom_ops_need_their_context_and_have_fakes():
    q = torch.randn(4, 2, 8)
    with pytest.raises(RuntimeError, match="outside attention_context"):
        torch.ops.replaylm.store_kv(q, q)
    with pytest.raises(RuntimeError, match="outside attention_context"):
        torch.ops.replaylm.attention(q, q, q, torch.empty_like(q), q.new_empty(0), 0)
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        stored = torch.ops.replaylm.store_kv(fq, fq)
        assert torch.ops.replaylm.attention(fq, fq, fq, torch.empty_like(fq), stored, 0) is None
    assert stored.numel() == 0


@pytest.fixture(scope="module")
def runner(tiny_qwen3_runner) -> ModelRunner:
    return tiny_qwen3_runner


def _reqs(lens: list[int]) -> list[Req]:
    return [
        Req(i, [(7 * i + j) % 300 + 3 for j in range(n)], SamplingParams(), 0, 16)
        for i, n in enumerate(lens)
    ]


def runner_context(runner: ModelRunner) -> RunnerContext:
    return RunnerContext(runner.model, runner.kv, runner.attn_backend)


def _run(graph_runner, live, shape: int) -> torch.Tensor:
    """The graph runner's captured function, run eagerly on `live` padded to `shape`."""
    padded = graph_runner.fill(live, shape)
    graph_runner.context.attn_backend.init_forward_metadata(padded)
    with attention_context(padded, attention_layers(graph_runner.context.model)):
        return graph_runner.finish(graph_runner.forward_fn(padded), live)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@torch.inference_mode()
def test_compiled_forward_equals_eager_for_prefill_and_decode(runner, compiler):
    options = TcPiecewiseOptions(compiler)
    prefill = PrefillCudaGraphRunner(
        runner_context(runner),
        TcPiecewiseCudaGraphBackend(runner.attn_backend, options),
        shapes=[16, 32],
    )
    decode = DecodeCudaGraphRunner(
        runner_context(runner),
        TcPiecewiseCudaGraphBackend(runner.attn_backend, options),
        shapes=[1, 4],
    )
    prefill.backend.prepare(prefill.capture_context())  # compiles
    decode.backend.prepare(decode.capture_context())  # reuses the model's compiled forward
    compiled = prefill.backend.compiled
    assert decode.backend.compiled is compiled and compiled.compile_seconds > 0
    # the backend reports its compile time through stats(), as cuda_graph_stats shows it
    assert prefill.backend.stats() == {"compile_s": round(compiled.compile_seconds, 2)}
    layers = runner.config.num_hidden_layers
    assert len(compiled.backend.split.compute_pieces) == layers + 1
    assert len(compiled.backend.split.pieces) == 2 * layers + 1

    reqs = _reqs([5, 9, 3])
    live = prepare_extend(reqs, runner)
    expected = runner.forward(live)
    torch.testing.assert_close(_run(prefill, live, 32), expected, atol=1e-5, rtol=1e-5)
    for r in reqs:
        r.output_ids.append(11)
    for n, shape in ((1, 1), (3, 4)):  # one token (no 0/1 specialisation) and padding
        live = prepare_decode(reqs[:n], runner)
        expected = runner.forward(live)
        torch.testing.assert_close(_run(decode, live, shape), expected, atol=1e-5, rtol=1e-5)
    assert compiled.backend.num_compiles == 1  # every token count ran the one compiled graph
    for r in reqs:
        release(r, runner.kv)


@torch.inference_mode()
def test_the_pieces_between_attention_calls_compile_once(tmp_path, monkeypatch):
    """store_kv names no layer, so the compute pieces between two attention calls of a 4-layer
    model trace to one graph: Inductor compiles the first of the three and takes the other two
    from its (fresh) cache; the first and last pieces (embedding, final norm) differ. The
    compiled prefill still equals eager (each store lands in its own layer's cache)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    shape = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "head_dim": 16,
        "num_hidden_layers": 4,
        "vocab_size": 512,
    }
    runner = tiny_dummy_runner(tmp_path, "qwen3-0.6b.json", shape)
    prefill = PrefillCudaGraphRunner(
        runner_context(runner),
        TcPiecewiseCudaGraphBackend(runner.attn_backend, TcPiecewiseOptions("inductor")),
        shapes=[16],
    )
    prefill.backend.prepare(prefill.capture_context())
    backend = prefill.backend.compiled.backend
    assert len(backend.split.compute_pieces) == 5 and backend.cache_hits == 2
    reqs = _reqs([5, 9])
    live = prepare_extend(reqs, runner)
    expected = runner.forward(live)
    torch.testing.assert_close(_run(prefill, live, 16), expected, atol=1e-5, rtol=1e-5)
    for r in reqs:
        release(r, runner.kv)


@torch.library.custom_op("replaylm_test::no_fake", mutates_args=())
def no_fake(a: torch.Tensor) -> torch.Tensor:
    return a.clone()


class UnsupportedOpModel(nn.Module):
    """A forward with an op torch.compile cannot trace (a custom op without a fake kernel)."""

    def forward_hidden(self, input_ids, positions, batch):
        return torch.ops.replaylm_test.no_fake(input_ids.float())


def test_compile_failure_is_a_clear_error_naming_the_op_and_suggesting_breakable():
    compiled = CompiledForward(UnsupportedOpModel(), TcPiecewiseOptions("eager"))
    with pytest.raises(TcPiecewiseCompileError) as info:
        compiled(torch.arange(8), torch.arange(8))
    message = str(info.value)
    assert "replaylm_test.no_fake" in message and "'breakable'" in message
    assert "\n" not in message
