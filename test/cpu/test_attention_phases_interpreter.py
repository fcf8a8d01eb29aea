"""Attention per phase on the CPU, the Triton kernels in Triton's interpreter: the page-table
gather FlashInfer plans read (`kv_indices`), and a model whose decode and prefill steps run
through different backends (`--prefill-attention-backend`) over one KV pool."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import require_triton_interpreter, scalar_loop_bounds

require_triton_interpreter()

from replaylm.layers.attention import selection  # noqa: E402
from replaylm.layers.attention.kv_indices import kv_indices  # noqa: E402
from replaylm.layers.attention.per_phase import PerPhaseAttnBackend  # noqa: E402
from replaylm.layers.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from replaylm.layers.attention.triton.backend import TritonAttnBackend  # noqa: E402

from model_parity import scripted_logits, tiny_dummy_runner  # noqa: E402


def test_kv_indices_lists_each_requests_slots_in_order():
    """Rows in any order, lengths over one block of the kernel, of one slot, and of a block and
    a bit; nothing past the last request's slots is written."""
    table = torch.randint(1, 10**6, (6, 1100), dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    lens = torch.tensor([1100, 1, 513])
    indptr = torch.tensor([0, 1100, 1101, 1614], dtype=torch.int32)
    out = torch.full((1700,), -1, dtype=torch.int32)
    with scalar_loop_bounds():
        kv_indices(table, rows, lens, indptr, out)
    want = torch.cat([table[r, :n] for r, n in zip(rows.tolist(), lens.tolist(), strict=True)])
    assert torch.equal(out[:1614], want)
    assert bool((out[1614:] == -1).all())


def test_kv_indices_of_no_request_writes_nothing():
    out = torch.full((4,), -1, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int64)
    kv_indices(torch.zeros(2, 4, dtype=torch.int32), empty, empty, torch.zeros(1), out)
    assert bool((out == -1).all())


@pytest.fixture
def attention_calls(monkeypatch) -> list[tuple[str, str]]:
    """(backend, phase) of every attention call, in order; triton allowed on the CPU."""
    monkeypatch.setattr(selection, "GPU_ONLY_BACKENDS", ())
    calls: list[tuple[str, str]] = []
    for cls in (TritonAttnBackend, TorchNativeAttnBackend):
        for phase in ("extend", "decode"):
            method = getattr(cls, f"forward_{phase}")

            def recorded(self, *args, _method=method, _phase=phase):
                calls.append((self.name, _phase))
                return _method(self, *args)

            monkeypatch.setattr(cls, f"forward_{phase}", recorded)
    return calls


@pytest.mark.parametrize(
    ("decode", "prefill"), [("torch_native", "triton"), ("triton", "torch_native")]
)
def test_each_phase_runs_its_own_backend_and_the_model_computes_the_same(
    tmp_path, attention_calls, decode, prefill
):
    """A prefill through one backend stores the K/V the other backend's decode reads: logits
    of a prefill and two decode steps equal those of one backend for both phases."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    single = tiny_dummy_runner(
        tmp_path / "one", "qwen3-0.6b.json", attention_backend="torch_native"
    )
    with scalar_loop_bounds():
        want = scripted_logits(single, prompt_lens=(5, 9, 1), decode_steps=2)
    runner = tiny_dummy_runner(
        tmp_path / "two",
        "qwen3-0.6b.json",
        attention_backend=decode,
        prefill_attention_backend=prefill,
    )
    assert isinstance(runner.attn_backend, PerPhaseAttnBackend)
    attention_calls.clear()
    with scalar_loop_bounds():
        got = scripted_logits(runner, prompt_lens=(5, 9, 1), decode_steps=2)
    # 2 layers: one prefill step, then two decode steps
    assert attention_calls == [(prefill, "extend")] * 2 + [(decode, "decode")] * 4
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_one_backend_for_both_phases_is_not_wrapped(tmp_path, attention_calls):
    runner = tiny_dummy_runner(
        tmp_path, "qwen3-0.6b.json", attention_backend="triton", prefill_attention_backend="triton"
    )
    assert isinstance(runner.attn_backend, TritonAttnBackend)
