"""Shared scenarios comparing our ModelRunner with HF transformers on tiny random checkpoints.

`test/cpu` runs them in float32 on the CPU (to 1e-4), `test/gpu` in bfloat16 on CUDA (relative
error by norm). Each scenario takes `close(ours, ref)`, which asserts one logits row is close.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import load_model_runner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

CONFIGS = Path(__file__).resolve().parents[1] / "benchmark" / "configs"

PROMPT_LENS = [7, 1, 19, 12]
Close = Callable[[torch.Tensor, torch.Tensor], None]


def make_runner(folder: str, device: str, dtype: str) -> ModelRunner:
    return load_model_runner(
        resolve_engine_config(
            ServerArgs(
                model_path=folder,
                device=device,
                dtype=dtype,
                max_total_tokens=1024,
                max_running_requests=8,
            )
        )
    )


def dummy_runner(config: str | Path, device: str, dtype: str, **args: Any) -> ModelRunner:
    """A ModelRunner on random weights (`--load-format dummy`) for the HF config file `config`;
    `args` are further ServerArgs fields."""
    return load_model_runner(
        resolve_engine_config(
            ServerArgs(
                **{
                    "model_path": str(config),
                    "load_format": "dummy",
                    "device": device,
                    "dtype": dtype,
                    "max_total_tokens": 2048,
                    "max_running_requests": 8,
                    "context_length": 1024,
                    **args,
                }
            )
        )
    )


TINY_SHAPE = {
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
}


def tiny_dummy_runner(
    folder: Path, config: str, shape: dict[str, int] | None = None, **args: Any
) -> ModelRunner:
    """A model of `config`'s architecture (a file of benchmark/configs) shrunk to TINY_SHAPE
    (`shape` overrides some of it), on dummy float32 weights on the CPU, its config written
    into `folder`; `args`: further ServerArgs fields."""
    cfg = json.loads((CONFIGS / config).read_text())
    cfg.update(TINY_SHAPE, **(shape or {}))
    (folder / "config.json").write_text(json.dumps(cfg))
    return dummy_runner(
        folder / "config.json", "cpu", "float32", max_total_tokens=256, context_length=64, **args
    )


def scripted_logits(
    runner: ModelRunner,
    prompt_lens: Sequence[int] = (5, 300, 33),
    decode_steps: int = 4,
    first_decode_id: int = 1000,
) -> list[torch.Tensor]:
    """Logits (float32 copies) of a ragged prefill of fixed prompts, then `decode_steps` decode
    steps of fixed tokens (`first_decode_id` on); the KV is freed after."""
    reqs = [
        Req(i, list(range(100 + i, 100 + i + n)), SamplingParams(), 0, decode_steps + 1)
        for i, n in enumerate(prompt_lens)
    ]
    out = [runner.forward(prepare_extend(reqs, runner)).float().clone()]
    for step in range(decode_steps):
        for req in reqs:
            req.output_ids.append(first_decode_id + step)
        out.append(runner.forward(prepare_decode(reqs, runner)).float().clone())
    for req in reqs:
        release(req, runner.kv)
    return out


def chunked_then_decode_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Ragged prefill (one prompt in two chunks), then 6 decode steps. Each step's logits are
    copied out: a replayed graph returns a view of its static output."""
    reqs = [
        Req(i, [(37 * i + 11 * j) % 150000 + 10 for j in range(n)], SamplingParams(), 0, 8)
        for i, n in enumerate([5, 1800, 333, 1])
    ]
    out = [runner.forward(prepare_extend(reqs, runner, chunk_sizes=[5, 700, 333, 1])).clone()]
    out.append(runner.forward(prepare_extend(reqs[1:2], runner)).clone())  # 1100 on 700 cached
    for step in range(6):
        for req in reqs:
            req.output_ids.append(1000 + 7 * step)
        out.append(runner.forward(prepare_decode(reqs, runner)).clone())
    for req in reqs:
        release(req, runner.kv)
    return [o.float() for o in out]


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in float32."""
    ours, ref = ours.float().cpu(), ref.float().cpu()
    return float((ours - ref).norm() / ref.norm())


def _hf_next_logits(hf_model, ids: list[int]) -> torch.Tensor:
    device = next(hf_model.parameters()).device
    with torch.no_grad():
        return hf_model(torch.tensor([ids], device=device)).logits[0, -1].float().cpu()


def _make_reqs(vocab: int, seed: int) -> list[Req]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Req(i, torch.randint(3, vocab, (n,), generator=gen).tolist(), SamplingParams(), 0, 64)
        for i, n in enumerate(PROMPT_LENS)
    ]


def _check(hf_model, runner: ModelRunner, reqs: list[Req], logits: torch.Tensor, close: Close):
    assert logits.shape == (len(reqs), runner.config.vocab_size)
    for req, row in zip(reqs, logits, strict=True):
        close(row.float().cpu(), _hf_next_logits(hf_model, req.all_ids))


def prefill_then_decode(hf_model, runner: ModelRunner, close: Close, steps: int = 8) -> None:
    """Ragged prefill, then `steps` paged-KV decode steps; every step checked; KV freed after."""
    reqs = _make_reqs(runner.config.vocab_size, seed=1)
    logits = runner.forward(prepare_extend(reqs, runner))
    _check(hf_model, runner, reqs, logits, close)
    for _ in range(steps):
        for req, token in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            req.output_ids.append(token)
        logits = runner.forward(prepare_decode(reqs, runner))
        _check(hf_model, runner, reqs, logits, close)
    for req in reqs:
        release(req, runner.kv)
    assert runner.kv.allocator.available_size() == runner.kv.size
    assert runner.kv.req_to_token.available_size() == 8


def chunked_prefill_over_prefix(hf_model, runner: ModelRunner, close: Close) -> None:
    """A first chunk, then the rest of each prompt attending to its cached prefix."""
    reqs = _make_reqs(runner.config.vocab_size, seed=2)
    runner.forward(prepare_extend(reqs, runner, chunk_sizes=[3, 1, 10, 12]))
    rest = [r for r in reqs if r.kv_len < len(r.input_ids)]
    assert [r.kv_len for r in rest] == [3, 10]  # a mixed batch: prefixes of different lengths
    logits = runner.forward(prepare_extend(rest, runner))
    _check(hf_model, runner, rest, logits, close)
    for req in reqs:
        release(req, runner.kv)


def divergence_gaps(
    runner: ModelRunner, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]
) -> dict[int, float]:
    """For each prompt whose generation `got` differs from the reference `want`: the top-2 logit
    gap of `runner` (the reference's runner) at the first token where they part."""
    gaps = {}
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            pairs = zip(a, b, strict=False)  # one may have stopped earlier
            k = next((j for j, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
            gaps[i] = top2_gap(runner, prompts[i] + b[:k])
    return gaps


def top2_gap(runner: ModelRunner, ids: list[int]) -> float:
    """Gap between the two largest next-token logits after `ids` (a near-tie when small)."""
    req = Req("gap", ids, SamplingParams(), 0, 1)
    with torch.inference_mode():
        logits = runner.forward(prepare_extend([req], runner))[0]
    release(req, runner.kv)
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def native_norm_rope(rotary, positions, q, k, norms):
    """LlamaAttention's native sequence (the fused kernel's reference): per-head norms `norms`
    (q norm, k norm) when given, then rope."""
    from replaylm.layers.kernels import native_only

    with native_only():
        if norms is not None:
            t, d = q.shape[0], rotary.head_dim
            q = norms[0](q.view(t, -1, d)).view(t, -1)
            k = norms[1](k.view(t, -1, d)).view(t, -1)
        return rotary(positions, q, k)
