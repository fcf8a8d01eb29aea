"""`--kv-cache-dtype fp8_e4m3` on the CPU (the torch_native backend, float32 tiny models): the
flag and its refusal, the pool's dtype and token budget, the store's quantization with a layer's
scales, a tiny model's logits and greedy tokens against the float32 cache's, and KV-cache
scales read from a checkpoint into the attention layers.

Tolerance of the logits: float8 e4m3 keeps 3 mantissa bits, so each cached K and V element is
off by up to 1/16 of itself; the tiny models' logits (drawn to vary strongly with every input)
then move by a few percent of their norm, so 0.15 by norm, where a float32 cache matches itself
to rounding. A greedy token flips only where the top two logits are that close.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replaylm import launch_server
from replaylm.distributed.parallel_state import TPPlace
from replaylm.entrypoints.engine import Engine
from replaylm.layers.attention.layer import Attention, attention_layers
from replaylm.mem_cache.kv_cache import KVShape
from replaylm.mem_cache.kv_pool import KVPool
from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import _kv_budget_tokens, load_model_runner
from replaylm.runtime.batch_ops import prepare_decode, prepare_extend, release
from replaylm.runtime.request import Req
from replaylm.sampling_params import SamplingParams
from replaylm.server_args import ServerArgs

from model_parity import rel_error, scripted_logits
from tiny_checkpoints import write_tiny_checkpoint

FP8 = torch.float8_e4m3fn
LOGITS_TOL = 0.15  # relative error by norm, per step: see the module docstring
TOP1_AGREEMENT = 0.9  # teacher-forced positions whose top-1 token is the float32 cache's
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def _runner(folder: Path | str, kv_cache_dtype: str = "auto", **args) -> ModelRunner:
    return load_model_runner(
        resolve_engine_config(
            ServerArgs(
                model_path=str(folder),
                device="cpu",
                max_total_tokens=1024,
                max_running_requests=8,
                kv_cache_dtype=kv_cache_dtype,
                **args,
            )
        )
    )


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def checkpoint(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_checkpoint(request.param, folder)
    return folder


@pytest.mark.parametrize("bad", ["fp8_e5m2", "int8", "bfloat16"])
def test_a_bad_value_of_the_flag_is_refused_naming_it(bad, capsys):
    """By the engine's arguments and by the command line: one line naming the flag."""
    with pytest.raises(ValueError) as err:
        Engine(kv_cache_dtype=bad)
    assert str(err.value) == f"--kv-cache-dtype must be one of auto, fp8_e4m3, fp8, got '{bad}'"
    with pytest.raises(SystemExit) as exit_:
        launch_server.parse_args(["--kv-cache-dtype", bad])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--kv-cache-dtype" in errors[0]


@pytest.mark.parametrize("flag", ["fp8_e4m3", "fp8"])
def test_the_pool_holds_float8_e4m3_whatever_the_model_dtype(checkpoint, flag):
    """fp8 (vLLM's name) is fp8_e4m3; a float32 model's cache is float8 all the same."""
    runner = _runner(checkpoint, flag)
    assert next(runner.model.parameters()).dtype == torch.float32
    pool = runner.kv.pool
    assert pool.dtype == FP8
    assert {b.dtype for b in pool.k_buffers + pool.v_buffers} == {FP8}
    assert _runner(checkpoint).kv.pool.dtype == torch.float32


def test_the_same_memory_holds_twice_the_tokens_of_a_16_bit_cache():
    """The budget's token count comes from the cache dtype's bytes per token."""
    args = ServerArgs(device="cpu")
    tp, cpu = TPPlace(0, 1), torch.device("cpu")
    tokens = {
        dtype: _kv_budget_tokens(args, [KVShape(28, 8, 128, dtype)], tp, cpu)
        for dtype in (torch.bfloat16, FP8, torch.float32)
    }
    assert tokens[FP8] == 2 * tokens[torch.bfloat16] == 4 * tokens[torch.float32]
    pools = [KVPool(1000, 2, 2, 16, dtype, "cpu") for dtype in (torch.bfloat16, FP8)]
    assert pools[0].memory_bytes() == 2 * pools[1].memory_bytes()


def test_the_store_quantizes_with_the_layers_scale_and_saturates():
    """K / k_scale rounded to e4m3 (off by at most 2**-4 of itself, or half the subnormal
    step, 2**-10), saturated at +-448; read back times the scale. A float32 pool stores as it
    is."""
    pool = KVPool(8, 1, 2, 16, FP8, "cpu")
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, 16, generator=gen) * 4
    v = torch.randn(3, 2, 16, generator=gen)
    k[0, 0, :2] = torch.tensor([1e4, -1e4])  # past 448 * k_scale
    slots = torch.tensor([2, 7, 5])
    k_scale, v_scale = 0.3, 0.01
    pool.store(0, slots, k, v, k_scale, v_scale)
    k_back = pool.k_buffers[0][slots].float() * k_scale
    v_back = pool.v_buffers[0][slots].float() * v_scale
    assert k_back[0, 0, :2].tolist() == pytest.approx([448 * k_scale, -448 * k_scale])
    inside = k.abs() < 448 * k_scale
    assert torch.all((k_back - k)[inside].abs() <= k[inside].abs() / 16 + k_scale * 2**-10)
    assert torch.all((v_back - v).abs() <= v.abs() / 16 + v_scale * 2**-10)
    assert not torch.equal(k_back[inside], k[inside])  # rounded: a real float8 round trip
    assert pool.k_buffers[0][[0, 1, 3, 4, 6, 8]].float().abs().sum() == 0
    exact = KVPool(8, 1, 2, 16, torch.float32, "cpu")
    exact.store(0, slots, k, v)
    assert torch.equal(exact.k_buffers[0][slots], k)


def test_copying_slots_copies_float8_bytes():
    """The copy of a request's KV to its forks (index_copy_ has no float8 kernel)."""
    pool = KVPool(8, 2, 2, 16, FP8, "cpu")
    pool.store(1, torch.tensor([1, 2]), torch.randn(2, 2, 16), torch.randn(2, 2, 16), 0.5, 0.5)
    pool.copy(torch.tensor([1, 2]), torch.tensor([6, 4]))
    for buf in pool.k_buffers + pool.v_buffers:
        raw = buf.view(torch.uint8)
        assert torch.equal(raw[[6, 4]], raw[[1, 2]])


def _forced_logits(
    runner: ModelRunner, prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """Logits `[steps, B, V]` of a prefill of `prompts` then decode steps fed `outputs` (teacher
    forcing: every runner sees the same tokens)."""
    steps = len(outputs[0])
    reqs = [Req(i, p, SamplingParams(), 0, steps) for i, p in enumerate(prompts)]
    logits = [runner.forward(prepare_extend(reqs, runner)).float().clone()]
    for step in range(steps - 1):
        for req, out in zip(reqs, outputs, strict=True):
            req.output_ids.append(out[step])
        logits.append(runner.forward(prepare_decode(reqs, runner)).float().clone())
    for req in reqs:
        release(req, runner.kv)
    return torch.stack(logits)


def test_greedy_text_of_an_fp8_cache_stays_close_to_the_float32_caches(checkpoint):
    """The float32 cache's greedy tokens fed to both caches (teacher forcing): every step's
    logits within LOGITS_TOL, most positions' top-1 token the same. The fp8 engine's own greedy
    text is the fp8 cache's top-1 up to where it departs from the float32 cache's text: it
    departs exactly at a top-1 disagreement measured here."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (3 + 5 * i,), generator=gen).tolist() for i in range(8)]
    engines = {
        kv: Engine(
            model_path=str(checkpoint), device="cpu", max_total_tokens=2048, kv_cache_dtype=kv
        )
        for kv in ("auto", "fp8_e4m3")
    }
    texts = {
        kv: [r["output_ids"] for r in e.generate(input_ids=prompts, sampling_params=GREEDY)]
        for kv, e in engines.items()
    }
    want = texts["auto"]
    ref = _forced_logits(engines["auto"].runner, prompts, want)
    got = _forced_logits(engines["fp8_e4m3"].runner, prompts, want)
    assert ref.argmax(-1).T.tolist() == want  # teacher forcing replays the greedy run
    errors = [rel_error(a, b) for a, b in zip(got, ref, strict=True)]
    assert max(errors) < LOGITS_TOL, errors
    assert min(errors) > 1e-3  # the cache is really float8: a float32 one matches to 1e-6
    agreement = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agreement >= TOP1_AGREEMENT, agreement
    for i, (mine, theirs) in enumerate(zip(texts["fp8_e4m3"], want, strict=True)):
        same = [a == b for a, b in zip(mine, theirs, strict=True)]
        k = same.index(False) if False in same else len(mine) - 1  # the first departure
        assert got[: k + 1, i].argmax(-1).tolist() == mine[: k + 1]


def test_scripted_prefill_and_decode_logits_stay_close(checkpoint):
    """Ragged prefill (prompts up to 60 tokens) and eight decode steps of fixed tokens."""
    kwargs = {"prompt_lens": (5, 60, 33), "decode_steps": 8, "first_decode_id": 200}
    ref = scripted_logits(_runner(checkpoint), **kwargs)
    got = scripted_logits(_runner(checkpoint, "fp8_e4m3"), **kwargs)
    for a, b in zip(got, ref, strict=True):
        assert rel_error(a, b) < LOGITS_TOL


# checkpoint layouts of KV-cache scales: (name of layer i's k scale, of its v scale (None: one
# tensor for both), the tensors' shape)
SCALE_LAYOUTS = {
    "self_attn": ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale", ()),
    "attn": (
        "model.layers.{i}.self_attn.attn.k_scale",
        "model.layers.{i}.self_attn.attn.v_scale",
        (),
    ),
    "modelopt": (
        "model.layers.{i}.self_attn.k_proj.k_scale",
        "model.layers.{i}.self_attn.v_proj.v_scale",
        (),
    ),
    "compressed_tensors": (
        "model.layers.{i}.self_attn.k_proj.output_scale",
        "model.layers.{i}.self_attn.v_proj.output_scale",
        (1,),
    ),
    "kv_scale": ("model.layers.{i}.self_attn.kv_scale", None, ()),
}


def _with_scales(src: Path, dst: Path, layout: str, scales: list[tuple[float, float]]) -> Path:
    """A copy of checkpoint `src` in `dst` with layer i's KV-cache scales `scales[i]`."""
    k_name, v_name, shape = SCALE_LAYOUTS[layout]
    tensors = load_file(str(src / "model.safetensors"))
    for i, (k, v) in enumerate(scales):
        tensors[k_name.format(i=i)] = torch.full(shape, k)
        if v_name is not None:
            tensors[v_name.format(i=i)] = torch.full(shape, v)
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _scales(runner: ModelRunner) -> list[tuple[float, float]]:
    return [(a.k_scale, a.v_scale) for a in attention_layers(runner.model)]


@pytest.mark.parametrize("layout", SCALE_LAYOUTS)
def test_scales_from_the_checkpoint_reach_the_layers_for_an_fp8_cache_only(
    checkpoint, tmp_path, layout
):
    """Each layout's scales land on its layer for an fp8 cache; with `auto` they are skipped
    (the layers keep 1.0, the model loads as without them)."""
    scales = [(0.25, 0.5), (0.125, 0.75)]
    if layout == "kv_scale":
        scales = [(k, k) for k, _ in scales]
    folder = _with_scales(checkpoint, tmp_path / layout, layout, scales)
    assert _scales(_runner(folder, "fp8_e4m3")) == scales
    assert _scales(_runner(folder)) == [(1.0, 1.0)] * 2


def test_the_pool_holds_k_and_v_divided_by_the_checkpoints_scales(checkpoint, tmp_path):
    """The same prompt through a cache of scales 1 and one of the checkpoint's: layer 0's
    cached K and V (from the embeddings alone: only the grids differ), times their scales,
    agree to float8's precision, and the logits stay close to the float32 cache's."""
    scales = [(0.3, 0.7), (1.7, 0.11)]  # not powers of two: another grid than scale 1's
    folder = _with_scales(checkpoint, tmp_path / "scaled", "self_attn", scales)
    prompt = list(range(10, 50))
    layer0, logits = [], []
    for path, kv in ((checkpoint, "fp8_e4m3"), (folder, "fp8_e4m3"), (checkpoint, "auto")):
        runner = _runner(path, kv)
        req = Req(0, prompt, SamplingParams(), 0, 1)
        logits.append(runner.forward(prepare_extend([req], runner)).float().clone())
        slots = torch.tensor(req.kv_slots)
        pool = runner.kv.pool
        layer0.append((pool.k_buffers[0][slots].float(), pool.v_buffers[0][slots].float()))
    (k1, v1), (ks, vs) = layer0[:2]
    k_scale, v_scale = scales[0]
    assert rel_error(ks * k_scale, k1) < 0.08 and rel_error(vs * v_scale, v1) < 0.08
    assert not torch.equal(ks * k_scale, k1)  # on another grid: the scale was applied
    assert rel_error(logits[1], logits[2]) < LOGITS_TOL


@pytest.mark.parametrize(
    ("value", "match"), [(0.0, "scale of 0.0, not > 0"), (float("nan"), "scale of nan")]
)
def test_a_scale_that_is_not_positive_is_refused_naming_the_tensor(
    checkpoint, tmp_path, value, match
):
    folder = _with_scales(checkpoint, tmp_path / "bad", "self_attn", [(value, 1.0), (1.0, 1.0)])
    with pytest.raises(ValueError, match=f"model.layers.0.self_attn.k_scale' .*{match}"):
        _runner(folder, "fp8_e4m3")


def test_the_start_up_log_names_the_caches_dtype(checkpoint, caplog):
    with caplog.at_level("INFO"):
        _runner(checkpoint, "fp8_e4m3")
    assert "KV cache 1024 tokens in torch.float8_e4m3fn" in caplog.text
    assert "the checkpoint has no KV-cache scales" in caplog.text


def test_forked_choices_decode_from_a_copy_of_an_fp8_cache(checkpoint):
    """Choices forked without the prefix cache decode from a copy of the prompt's KV: greedy,
    each gives the parent's tokens."""
    engine = Engine(
        model_path=str(checkpoint),
        device="cpu",
        max_total_tokens=512,
        kv_cache_dtype="fp8_e4m3",
        disable_radix_cache=True,
    )
    params = SamplingParams(**GREEDY)
    parent = Req("p", list(range(5, 30)), params, 0, 16, forks=[("c1", 0), ("c2", 0)])
    engine.scheduler.add(parent)
    engine.scheduler.step()  # the prefill and the forks
    children = [r for r in engine.scheduler.running if r is not parent]
    assert len(children) == 2 and all(c.kv_slots != parent.kv_slots for c in children)
    engine.scheduler.run_to_completion()
    assert all(c.output_ids == parent.output_ids for c in children)


def test_attention_layers_default_to_unit_scales():
    layer = Attention(4, 2, 16, 0.25, layer_id=0)
    assert (layer.k_scale, layer.v_scale) == (1.0, 1.0)
