"""Speculative decoding: what verify and draft steps cost, and output tokens per second end
to end.

    python benchmark/bench_speculative.py [--models llama-3.1-8b qwen3-0.6b] [--bs 1 8 16 32 64]
        [--verify-tokens 2 4 8] [--steps 3] [--corrupt 0 0.2 0.5] [--output-len 128]
        [--context 512] [--draft-model llama-3.2-1b] [--head eagle3-llama-3.1-8b]
        [--ngram-model-path GGUF]
        [--ngram-steps 3 5 7] [--ngram-prompts 16] [--parts replay head draft_model ngram]
        [--device cuda] [--json out.json]

Per model (a `benchmark/configs/` config, dummy weights, default CUDA-graph modes):

- *step*: one decode step of `bs` requests over `--context` cached tokens against one verify
  step of each `--verify-tokens` tokens per request (ForwardMode.TARGET_VERIFY), the forward
  alone, milliseconds by CUDA events;
- *replay*: `bs` requests of `--context` random prompt tokens, greedy, `--output-len` tokens
  each, through the Scheduler: plain decoding, then speculation with a replay drafter, which
  proposes the tokens plain decoding produced for the request at that position, each replaced
  by another with probability `--corrupt` (a set acceptance), output tokens per second of the
  decode phase (from every request's first token on: the prompts' prefill is the same work
  either way). The dummy model is made a copying
  model first (`make_copying`): random weights leave the top logits of a step near-tied, so any
  rounding difference between a decode and a verify step would change the text, while a
  copying model's next token wins by a wide margin and the replayed tokens are always the
  target's: acceptance is as high as the machinery allows. The speed-up over plain, tokens per
  verify step, and whether the outputs equal plain decoding's.

With `--draft-model` (a config, dummy weights) and the first of `--models` as its target:

- *draft_step*: the draft model's decode step against the target's, per batch size;
- *draft_model*: `--speculative-algorithm draft_model` through an Engine's scheduler, both
  models copying ones (the draft proposes the target's own tokens), against the plain Engine,
  the decode phase timed as in *replay*.

With `--head` (an EAGLE-3 head's config, dummy weights) and the first of `--models` as its
target: *draft_step* of the head (one head step, reading its own output feature) against the
target's decode step, the target writing the head's features as it does when serving it.

`--ngram-model-path`: also the n-gram drafter end to end on that model (the built-in SmolLM2's
GGUF) with a quoting workload (chat prompts asking to repeat a text of three gsm8k questions
word for word), greedy, `--output-len` tokens at most, plain and with `--speculative-algorithm
ngram` at each of `--ngram-steps` drafts per verify step, through the Engine, the whole run
timed (the chat prompts are short); each batch size runs `--ngram-prompts` (16) prompts at
least, in waves of bs. `--models` with no name skips the dummy models.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from replaylm.entrypoints.engine import Engine
from replaylm.eval.data import default_data_dir, read_jsonl
from replaylm.model_executor.forward_batch import ForwardBatch
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.models.eagle import EagleHead
from replaylm.models.llama import LlamaForCausalLM
from replaylm.runtime.batch_ops import prepare_verify, truncate_kv
from replaylm.runtime.request import Req
from replaylm.runtime.scheduler import Scheduler
from replaylm.sampling_params import SamplingParams
from replaylm.speculative.drafter import Drafter, DraftTarget, Speculation

from common import (
    PREFILL_CHUNK,
    build_runner,
    build_runners,
    config_path,
    cuda_time_ms,
    decode_batch,
    release_memory,
    write_json,
)


class ReplayDrafter(Drafter):
    """Proposes what plain decoding produced for each request (`reference`, by rid) at its
    current output position, each token replaced by another with probability `corrupt`."""

    name = "replay"

    def __init__(self, reference: dict[str, list[int]], vocab: int, corrupt: float) -> None:
        self.reference, self.vocab, self.corrupt = reference, vocab, corrupt
        self.rng = random.Random(0)

    def propose(self, reqs: Sequence[DraftTarget], limits: Sequence[int]) -> list[list[int]]:
        drafts = []
        for req, limit in zip(reqs, limits, strict=True):
            assert isinstance(req, Req)
            done = len(req.output_ids)
            drafts.append([self._maybe_corrupt(t) for t in self.reference[req.rid][done:][:limit]])
        return drafts

    def _maybe_corrupt(self, token: int) -> int:
        if self.rng.random() >= self.corrupt:
            return token
        return (token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab


COPYING_EMBED_STD = 50.0  # against layers' outputs of a few units: the token's own row wins


@torch.no_grad()
def make_copying(model: LlamaForCausalLM) -> None:
    """Make a dummy-weight model copy its input: embedding rows scaled far above what the
    layers add to the residual stream, and the LM head those rows, so each position's top logit
    is its own token by a wide margin. The shapes, and so the kernels and their costs, stay."""
    embed = model.model.embed_tokens.weight
    embed.mul_(COPYING_EMBED_STD / embed.float().std().item())
    if model.lm_head is not None:
        model.lm_head.weight.copy_(embed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_ms(runner: ModelRunner, batch: ForwardBatch) -> float:
    """Milliseconds per forward of `batch`: CUDA events on a GPU, else wall time."""
    if runner.device.type == "cuda":
        return cuda_time_ms(lambda: runner.forward(batch), calls=10)
    start = time.perf_counter()
    for _ in range(3):
        runner.forward(batch)
    return (time.perf_counter() - start) / 3 * 1e3


def step_rows(
    runner: ModelRunner, model: str, bs_list: list[int], verify_tokens: list[int], context: int
) -> list[dict[str, Any]]:
    """A decode step against verify steps of each size, per batch size (forward only)."""
    rows = []
    for bs in bs_list:
        reqs, batch = decode_batch(runner, bs, context)
        decode_ms = _forward_ms(runner, batch)
        rows.append(_step_row(model, bs, 1, decode_ms, decode_ms))
        for req in reqs:
            truncate_kv(req, req.kv_len - 1, runner.kv)  # the decode token's slot
        for tokens in verify_tokens:
            drafts = [[7] * (tokens - 1) for _ in reqs]
            verify = prepare_verify(reqs, drafts, runner)
            ms = _forward_ms(runner, verify)
            rows.append(_step_row(model, bs, tokens, ms, decode_ms))
            for req in reqs:
                truncate_kv(req, req.kv_len - tokens, runner.kv)
        for req in reqs:
            truncate_kv(req, 0, runner.kv)
            runner.kv.req_to_token.free(req.req_pool_idx)
    return rows


def _step_row(model: str, bs: int, tokens: int, ms: float, decode_ms: float) -> dict[str, Any]:
    return {
        "part": "step",
        "model": model,
        "bs": bs,
        "tokens_per_request": tokens,
        "ms": round(ms, 4),
        "vs_decode": round(ms / decode_ms, 3),
    }


def _decode_tok_s(sched: Scheduler, reqs: list[Req]) -> float:
    """Output tokens per second of the decode phase: timed from when every request of `reqs`
    has its first token (its prompt prefilled) until all have finished."""
    device = sched.runner.device
    for req in reqs:
        sched.add(req)
    while any(not r.output_ids for r in reqs):
        sched.step()
    _sync(device)
    start = time.perf_counter()
    before = sum(len(r.output_ids) for r in reqs)
    sched.run_to_completion()
    _sync(device)
    seconds = time.perf_counter() - start
    sched.prefix_cache.flush()
    return (sum(len(r.output_ids) for r in reqs) - before) / seconds


def _replay_requests(bs: int, context: int, output_len: int, vocab: int, tag: str) -> list[Req]:
    rng = random.Random(bs)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    return [
        Req(f"{tag}{i}", [rng.randrange(vocab) for _ in range(context)], params, i, output_len)
        for i in range(bs)
    ]


def replay_rows(
    runner: ModelRunner,
    model: str,
    bs_list: list[int],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Plain decoding, then the replay drafter at each corruption rate, per batch size."""
    vocab = runner.config.vocab_size
    rows = []
    for bs in bs_list:
        plain_sched = Scheduler(runner, frozenset(), None, PREFILL_CHUNK, None, prefix_cache=False)
        plain = _replay_requests(bs, args.context, args.output_len, vocab, "p")
        _decode_tok_s(plain_sched, _replay_requests(1, args.context, 4, vocab, "warm"))
        plain_tok_s = _decode_tok_s(plain_sched, plain)
        for corrupt in args.corrupt:
            reference = {f"s{i}": r.output_ids for i, r in enumerate(plain)}
            drafter = ReplayDrafter(reference, vocab, corrupt)
            spec = Speculation(drafter, args.steps)
            sched = Scheduler(
                runner,
                frozenset(),
                None,
                PREFILL_CHUNK,
                None,
                prefix_cache=False,
                speculation=spec,
            )
            reqs = _replay_requests(bs, args.context, args.output_len, vocab, "s")
            tok_s = _decode_tok_s(sched, reqs)
            stats = spec.stats
            rows.append(
                {
                    "part": "replay",
                    "model": model,
                    "bs": bs,
                    "steps": args.steps,
                    "corrupt": corrupt,
                    "timed": "decode",
                    "output_tok_s": round(tok_s, 1),
                    "plain_output_tok_s": round(plain_tok_s, 1),
                    "speedup": round(tok_s / plain_tok_s, 3),
                    "tokens_per_verify": round(1 + stats.mean_accepted, 3),
                    "draft_acceptance": round(stats.accepted / max(stats.drafted, 1), 3),
                    "identical": [r.output_ids for r in reqs] == [r.output_ids for r in plain],
                }
            )
            print(rows[-1])
    return rows


QUOTE_PROMPT = "Repeat the following text exactly, word for word.\n\n{text}"
QUOTED_QUESTIONS = 3  # gsm8k questions per quoted text: longer than one answer's worth


def _engine_runs(
    engine: Engine, prompts: list[list[int]], bs_list: list[int], params: dict[str, Any]
) -> dict[int, tuple[float, list[list[int]], float]]:
    """Per batch size: output tok/s over all `prompts` run in waves of `bs` (so that a small
    batch's number is no single prompt's), their outputs, and tokens per verify step (1.0
    without speculation)."""
    engine.generate(input_ids=prompts[0], sampling_params={**params, "max_new_tokens": 4})
    runs = {}
    for bs in bs_list:
        todo = prompts
        _sync(engine.runner.device)
        start = time.perf_counter()
        out = [
            o
            for i in range(0, len(todo), bs)
            for o in engine.generate(input_ids=todo[i : i + bs], sampling_params=params)
        ]
        _sync(engine.runner.device)
        seconds = time.perf_counter() - start
        tokens = sum(len(o["output_ids"]) for o in out)
        verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in out)
        accepted = sum(o["meta_info"].get("spec_accepted_drafts", 0) for o in out)
        per_verify = (verify + accepted) / verify if verify else 1.0
        runs[bs] = (tokens / seconds, [o["output_ids"] for o in out], per_verify)
    return runs


def _compare_rows(
    part: str,
    model: str,
    plain: dict[int, tuple[float, list[list[int]], float]],
    spec: dict[int, tuple[float, list[list[int]], float]],
    steps: int,
    timed: str = "run",
) -> list[dict[str, Any]]:
    rows = []
    for bs, (plain_tok_s, plain_ids, _) in plain.items():
        tok_s, ids, per_verify = spec[bs]
        rows.append(
            {
                "part": part,
                "model": model,
                "bs": bs,
                "steps": steps,
                "timed": timed,
                "output_tok_s": round(tok_s, 1),
                "plain_output_tok_s": round(plain_tok_s, 1),
                "speedup": round(tok_s / plain_tok_s, 3),
                "tokens_per_verify": round(per_verify, 3),
                "identical": ids == plain_ids,
            }
        )
        print(rows[-1])
    return rows


def ngram_rows(model_path: str, bs_list: list[int], args: argparse.Namespace) -> list[dict]:
    """Plain against `--speculative-algorithm ngram` on the quoting workload, per batch size,
    at each of `--ngram-steps` drafts per verify step."""
    questions = [r["question"] for r in read_jsonl(str(default_data_dir() / "gsm8k/test.jsonl"))]
    k = QUOTED_QUESTIONS
    count = max(*bs_list, args.ngram_prompts)
    texts = ["\n\n".join(questions[k * i : k * i + k]) for i in range(count)]
    common = {
        "device": args.device,
        "max_running_requests": max(bs_list),
        "max_total_tokens": max(bs_list) * (args.output_len + 1024),
    }
    params = {"max_new_tokens": args.output_len, "temperature": 0.0}
    runs = []
    for extra in ({}, *(_spec_flags("ngram", args, k) for k in args.ngram_steps)):
        engine = Engine(model_path, **common, **extra)
        chats = [
            engine.encode_chat([{"role": "user", "content": QUOTE_PROMPT.format(text=t)}])
            for t in texts
        ]
        runs.append(_engine_runs(engine, chats, bs_list, params))
        engine.shutdown()
        release_memory()
    name = Path(model_path).name.split(".")[0]
    plain = runs[0]
    return [
        row
        for k, spec in zip(args.ngram_steps, runs[1:], strict=True)
        for row in _compare_rows("ngram", name, plain, spec, k)
    ]


def _model_path(model: str) -> str:
    """A config's name (`benchmark/configs/`), or a path as it is."""
    return model if Path(model).exists() else str(config_path(model))


def _model_name(model: str) -> str:
    return Path(model).name.removesuffix(".json")


def _spec_flags(
    algorithm: str, args: argparse.Namespace, steps: int | None = None
) -> dict[str, Any]:
    return {
        "speculative_algorithm": algorithm,
        "speculative_num_steps": steps or args.steps,
        "speculative_max_bs": max(args.bs),
    }


def _decode_step_ms(runner: ModelRunner, bs_list: list[int], context: int) -> dict[int, float]:
    """Milliseconds of `runner`'s decode step per batch size (requests of `context` tokens)."""
    one_at_a_time = isinstance(runner.model, EagleHead)
    ms = {}
    for bs in bs_list:
        reqs, batch = decode_batch(runner, bs, context, one_at_a_time)
        ms[bs] = _forward_ms(runner, batch)
        for req in reqs:
            truncate_kv(req, 0, runner.kv)
            runner.kv.req_to_token.free(req.req_pool_idx)
    return ms


def _draft_rows(
    draft: str, target: str, ms: dict[int, float], target_ms: dict[int, float]
) -> list[dict[str, Any]]:
    rows = []
    for bs, step in ms.items():
        rows.append(
            {
                "part": "draft_step",
                "model": _model_name(draft),
                "target": _model_name(target),
                "bs": bs,
                "ms": round(step, 4),
                "target_ms": round(target_ms[bs], 4),
                "vs_target_decode": round(step / target_ms[bs], 3),
            }
        )
        print(rows[-1])
    return rows


def draft_step_rows(target: str, draft: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The draft model's decode step against the target's, per batch size."""
    tokens_per_req = args.context + 8
    decode_ms = {}
    for model in (target, draft):
        runner = build_runner(_model_path(model), args.device, max(args.bs), tokens_per_req)
        decode_ms[model] = _decode_step_ms(runner, args.bs, args.context)
        runner.free_cuda_graphs()
        del runner
        release_memory()
    return _draft_rows(draft, target, decode_ms[draft], decode_ms[target])


def head_step_rows(target: str, head: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """An EAGLE-3 head's draft step against its target's decode step (the target writing the
    head's features, as it does when serving it), per batch size."""
    spec = {
        "speculative_algorithm": "eagle3",
        "speculative_draft_model_path": _model_path(head),
        "speculative_max_bs": max(args.bs),
        "verify_disable_cuda_graph": True,  # not timed here
    }
    runners = build_runners(_model_path(target), args.device, max(args.bs), args.context + 8, spec)
    target_runner, head_runner = runners
    assert head_runner is not None
    target_ms = _decode_step_ms(target_runner, args.bs, args.context)
    head_ms = _decode_step_ms(head_runner, args.bs, args.context)
    for runner in runners:
        runner.free_cuda_graphs()
    del runners, target_runner, head_runner
    release_memory()
    return _draft_rows(head, target, head_ms, target_ms)


def draft_model_rows(target: str, draft: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Plain against `--speculative-algorithm draft_model` (copying target and draft), per
    batch size, through an Engine's scheduler, the decode phase timed."""
    common = {
        "load_format": "dummy",
        "device": args.device,
        "max_running_requests": max(args.bs),
        "max_total_tokens": max(args.bs) * (args.context + args.output_len + 2 * args.steps + 8),
    }
    draft_flags = {
        **_spec_flags("draft_model", args),
        "speculative_draft_model_path": _model_path(draft),
    }
    runs: list[dict[int, tuple[float, list[list[int]], float]]] = []
    for extra in ({}, draft_flags):
        engine = Engine(_model_path(target), **common, **extra)
        for runner in (engine.runner, engine.draft_runner):
            if runner is not None:
                make_copying(runner.model)
        vocab = engine.runner.config.vocab_size
        sched = engine.scheduler
        _decode_tok_s(sched, _replay_requests(1, args.context, 4, vocab, "warm"))
        runs.append({})
        for bs in args.bs:
            reqs = _replay_requests(bs, args.context, args.output_len, vocab, f"b{bs}-")
            tok_s = _decode_tok_s(sched, reqs)
            verify = sum(r.spec_verify_ct for r in reqs)
            per_verify = (verify + sum(r.spec_accepted for r in reqs)) / verify if verify else 1.0
            runs[-1][bs] = (tok_s, [r.output_ids for r in reqs], per_verify)
        engine.shutdown()
        release_memory()
    name = f"{_model_name(target)} + {_model_name(draft)}"
    return _compare_rows("draft_model", name, *runs, args.steps, timed="decode")


PARTS = ("replay", "head", "draft_model", "ngram")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="*", default=["llama-3.1-8b", "qwen3-0.6b"])
    parser.add_argument("--bs", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    parser.add_argument("--verify-tokens", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=3, help="draft tokens per verify step")
    parser.add_argument("--corrupt", nargs="+", type=float, default=[0.0, 0.2, 0.5])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--draft-model", default="llama-3.2-1b", help="a config; '' skips")
    parser.add_argument(
        "--head", default="eagle3-llama-3.1-8b", help="an EAGLE-3 head's config; '' skips"
    )
    parser.add_argument("--ngram-model-path", default=None)
    parser.add_argument("--ngram-steps", nargs="+", type=int, default=[3, 5, 7])
    parser.add_argument(
        "--ngram-prompts", type=int, default=16, help="n-gram prompts per batch size, at least"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="what to run: step and replay per model, the head's and the draft model's steps "
        "and runs, n-gram",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []

    def save() -> None:  # after every part: a run cut short keeps what it measured
        if args.json:
            write_json(args.json, {"summary": rows})

    tokens_per_req = args.context + args.output_len + max(args.verify_tokens) + args.steps + 8
    for model in args.models if "replay" in args.parts else []:
        path, name = _model_path(model), _model_name(model)
        # the verify phase's graphs: rows up to the largest batch x the most tokens verified
        spec = {
            "speculative_algorithm": "ngram",
            "speculative_num_steps": max(args.verify_tokens + [args.steps + 1]) - 1,
            "speculative_max_bs": max(args.bs),
        }
        runner = build_runner(path, args.device, max(args.bs), tokens_per_req, spec)
        rows += step_rows(runner, name, args.bs, args.verify_tokens, args.context)
        make_copying(runner.model)
        rows += replay_rows(runner, name, args.bs, args)
        save()
        runner.free_cuda_graphs()
        del runner
        release_memory()
    if args.models and args.head and "head" in args.parts:
        rows += head_step_rows(args.models[0], args.head, args)
        save()
    if args.models and args.draft_model and "draft_model" in args.parts:
        rows += draft_step_rows(args.models[0], args.draft_model, args)
        rows += draft_model_rows(args.models[0], args.draft_model, args)
        save()
    if args.ngram_model_path and "ngram" in args.parts:
        rows += ngram_rows(args.ngram_model_path, args.bs, args)
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    save()


if __name__ == "__main__":
    main()
