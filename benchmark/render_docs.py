"""docs/benchmarks.md from the results committed under benchmark/results/<gpu>/.

    python benchmark/render_docs.py            rewrite docs/benchmarks.md
    python benchmark/render_docs.py --check    exit 1 when the committed page differs from it
    python benchmark/render_docs.py --plots    also redraw the page's plots (benchmark/plot.py)

Every section renders one benchmark: its JSON `<name>.json` (serving: one per server mode) from
the first GPU folder of GPU_PREFERENCE that holds it (the CPU's folder for the CPU's sections),
a paragraph on what its table shows, the command, GPU, versions, commit and date its JSON
records, the table, and its plot where it has one. The numbers all come from the JSON; a JSON
that no section renders is named on stderr.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common import REPO, RESULTS, gpu_slug
from doc_tables import (
    SERVING_MODES,
    Doc,
    Source,
    Table,
    accuracy_table,
    attention_table,
    backends_table,
    capture_table,
    decode_host_table,
    fp8_gemm_table,
    http_table,
    modes_table,
    moe_kernel_table,
    offline_table,
    prefix_table,
    rates_table,
    sampling_table,
    serving_name,
    serving_table,
    speculative_table,
    startup_table,
    tp_table,
)

PAGE = REPO / "docs" / "benchmarks.md"
IMAGES = PAGE.parent / "img"
CPU = gpu_slug(None)
GPU_PREFERENCE = ("h200", "h100")  # the GPU the project measures on first: its result is shown


@dataclass(frozen=True)
class Plot:
    """A benchmark/plot.py figure of a section's JSON: the flag that draws it, the PNG it writes."""

    flag: str
    image: str
    names: tuple[str, ...] = ()  # the section's JSON it draws, without .json; () -> all


@dataclass(frozen=True)
class Section:
    """One benchmark's part of the page; `table` builds its table from its JSON."""

    title: str
    names: tuple[str, ...]  # the JSON it renders, without .json
    prose: str
    table: Callable[[list[Source]], Table]
    plot: Plot | None = None
    folders: tuple[str, ...] = ()  # () -> the GPU folders, GPU_PREFERENCE's first


# ---- the page ------------------------------------------------------------------------------------

SECTIONS = (
    Section(
        "One batch per mode (`bench_one_batch.py`)",
        ("one_batch",),
        "One prefill or decode step per CUDA-graph mode, decode over `--context` cached tokens a "
        "request. A cell: graph ms with the GPU waiting for each step (as a server reading its "
        "tokens), back to back in parentheses. *floor*: a decode step's bytes (weights, KV) over "
        "the run's copy bandwidth.",
        modes_table,
    ),
    Section(
        "Every mode over the fused kernels and the torch code (`bench_one_batch.py --kernels`)",
        ("one_batch_native",),
        "Qwen3-0.6B's steps in every mode over the fused kernels and over the layers' torch code "
        "(*native*; tc_piecewise fused by Inductor). breakable and tc_piecewise run attention "
        "eagerly between graph segments: their decode steps are host-bound and vary between runs.",
        modes_table,
        Plot("--one-batch", "one_batch_qwen3-0.6b.png"),
    ),
    Section(
        "Mixture of experts: one batch per mode (`bench_one_batch.py --models qwen3-30b-a3b`)",
        ("one_batch_moe",),
        "Dummy Qwen3-30B-A3B (128 experts, top 8, 48 layers) per CUDA-graph mode, as above. "
        "*floor*: attention, norms and LM head plus the experts a step's routing reaches (8 a "
        "layer at bs 1; E(1 - (1 - k/E)^bs) expected at larger batches) over the copy bandwidth.",
        modes_table,
    ),
    Section(
        "Mixture of experts: every mode",
        ("one_batch_moe_modes",),
        "Dummy Qwen3-30B-A3B in every CUDA-graph mode at bs 1 and 8 (each mode's decode and "
        "prefill), columns and floor as above.",
        modes_table,
    ),
    Section(
        "Mixture of experts: tensor parallelism",
        ("one_batch_moe_tp",),
        "Dummy Mixtral-8x7B (8 experts, top 2, 32 layers) at TP 2, one GPU per rank (NVLink "
        "multicast off): every expert's columns split over the ranks, one all-reduce a layer. "
        "Columns as in the tensor-parallel table below; *floor*: one rank's bytes, the experts "
        "a step's routing reaches.",
        tp_table,
    ),
    Section(
        "Mixture of experts: one layer's experts (`bench_moe_kernel.py`)",
        ("moe_kernel",),
        "Qwen3-30B-A3B's MoE layer alone (routing given): the fused Triton kernels the layer "
        "takes (*route*: pairs, each routed pair on its own expert, for 1 or 2 tokens; else "
        "sorted: the sort by expert, grouped gate_up with SiLU-and-mul, grouped down, weighted "
        "sum), the sorted route at every count, a cuBLAS matmul per reached expert, and the "
        "floor: the reached experts' weights over the copy bandwidth.",
        moe_kernel_table,
    ),
    Section(
        "Mixture of experts: offline throughput",
        ("offline_moe",),
        "nano-vllm's offline workload on dummy Qwen3-30B-A3B, full decode graphs. H200s differ "
        'by up to about 2% on it (docs/tuning.md, "MoE offline workload: where the time goes").',
        offline_table,
    ),
    Section(
        "Mixture of experts: prefill",
        ("prefill_moe",),
        "64 prompts of 512 tokens and one output token each (`bench_offline.py --num-seqs 64 "
        "--min-len 512 --max-len 512 --output-len 1`) on dummy Qwen3-30B-A3B: *seconds* is the "
        "prefill + 1.",
        offline_table,
    ),
    Section(
        "FP8 weights: one batch (`bench_one_batch.py --server-args`)",
        ("one_batch_fp8",),
        "Dummy Llama-3.1-8B and Qwen3-0.6B in bf16, with `--quantization fp8` (e4m3 weights per "
        "channel, activations per token) and with the FP8 KV cache too (`--kv-cache-dtype "
        "fp8_e4m3`), full decode graphs and breakable prefill, columns as in the first table; "
        "*floor* and *best / floor* are the bf16 run's (FP8's weights read in about half the "
        "time).",
        modes_table,
    ),
    Section(
        "FP8 weights: mixture of experts (`bench_one_batch.py --models qwen3-30b-a3b`)",
        ("one_batch_fp8_moe",),
        "Dummy Qwen3-30B-A3B in bf16, with `--quantization fp8` (as the dense models above; the "
        "experts e4m3 per channel, run w8a8 through the sorted route at every batch) and with "
        "the FP8 KV cache too, full decode graphs and breakable prefill, columns as in the first "
        "table; *floor* and *best / floor* are the bf16 run's.",
        modes_table,
    ),
    Section(
        "FP8 weights: offline throughput",
        ("offline_fp8_llama-3.1-8b",),
        "nano-vllm's offline workload on dummy Llama-3.1-8B, full decode graphs: with "
        "`--quantization fp8` (in the default prefill chunks, in chunks of 2,048, and with the "
        "FP8 KV cache too) and in bf16.",
        offline_table,
    ),
    Section(
        "FP8 weights: offline throughput, Qwen3-0.6B",
        ("offline_fp8_qwen3-0.6b",),
        "nano-vllm's offline workload on dummy Qwen3-0.6B, full decode graphs, in bf16, with "
        "`--quantization fp8` and with the FP8 KV cache too.",
        offline_table,
    ),
    Section(
        "FP8 weights: prefill",
        ("prefill_fp8_llama-3.1-8b",),
        "64 prompts of 512 tokens and one output token each on dummy Llama-3.1-8B, in bf16 and "
        "with `--quantization fp8`: *seconds* is the prefill + 1.",
        offline_table,
    ),
    Section(
        "FP8 weights: prefill, Qwen3-0.6B",
        ("prefill_fp8_qwen3-0.6b",),
        "The same 64 x 512 prefill + 1 on dummy Qwen3-0.6B, in bf16, with `--quantization fp8` "
        "and with the FP8 KV cache too. Host-bound: its GPU is busy for 0.05-0.07 s of each run, "
        "and the wall varies from run to run (0.08-0.20 s).",
        offline_table,
    ),
    Section(
        "FP8 GEMMs (`bench_fp8_gemm.py`)",
        ("fp8_gemm",),
        "Each projection of a model alone, bf16 cuBLAS against FP8 (e4m3) weights and "
        "activations, CUDA-graph replays over enough weight copies to miss L2.",
        fp8_gemm_table,
    ),
    Section(
        "Tensor parallelism (`bench_one_batch.py --tp-size`)",
        ("one_batch_tp",),
        "Llama-3.1-8B per tensor-parallel size and server arguments, one GPU per rank (NVLink "
        "multicast off); `--tp-all-reduce one-shot` sums the partials over NVLink in one kernel "
        "with the residual add and norms. *floor*: one rank's bytes; *all-reduce*: the "
        "collectives' median ms a step (torch.profiler).",
        tp_table,
    ),
    Section(
        "Tensor parallelism, Llama-3.1-70B",
        ("one_batch_70b",),
        "Llama-3.1-70B's shape at the tensor-parallel sizes a host holds, columns as above.",
        tp_table,
    ),
    Section(
        "Offline throughput (`bench_offline.py`)",
        ("offline",),
        "The in-process Engine on nano-vllm's workload (random token ids, prompt and output "
        "lengths uniform in `--min-len`..`--max-len`, temperature 0.6, EOS ignored), dummy "
        "Qwen3-0.6B, per decode mode. The overlap schedule launches each decode step before "
        "reading the last one back.",
        offline_table,
    ),
    Section(
        "Offline, one request",
        ("offline_bs1",),
        "The same Engine on one request, full decode graphs: a server's step for one client.",
        offline_table,
    ),
    Section(
        "Offline with tensor parallelism",
        ("offline_tp",),
        "nano-vllm's workload on Llama-3.1-8B, full decode graphs, on one GPU and on `tp_size`.",
        offline_table,
    ),
    Section(
        "Serving per mode (`bench_serving.py`)",
        tuple(serving_name(m) for m in SERVING_MODES),
        "One server per decode / prefill mode, the built-in SmolLM2-135M-Instruct, all requests "
        "sent at once, at most *in flight* running, greedy, streamed. *json_schema*: prompts "
        "asking for a JSON record under one `response_format` schema (the output budget cuts the "
        "outputs that do not parse). Runs after a workload's first find its prompts cached.",
        serving_table,
        Plot("--serving", "serving.png"),
    ),
    Section(
        "Serving at fixed request rates (`bench_serving.py --request-rate`)",
        ("serving_rates_defaults", "serving_multi_turn_defaults"),
        "The built-in SmolLM2-135M-Instruct server, its defaults, Poisson arrivals at each rate "
        "for `--rate-seconds` (`inf`: all at once), lognormal lengths, greedy, EOS ignored, "
        "streamed. A finite rate's output tok/s is its tokens over the run's duration; the "
        "capacity shows at `inf`. *multi_turn*: then 64 conversations of 4 turns at once, each "
        "turn's prompt the last one, its answer and a new message.",
        rates_table,
        Plot("--serving-rates", "serving_rates.png", ("serving_rates_defaults",)),
    ),
    Section(
        "HTTP server against the Engine (`bench_http.py`)",
        ("http",),
        "1,024 requests of 512 random prompt tokens and 128 output tokens (EOS ignored) sent at "
        "once: through the in-process Engine, then streamed from `launch_server` per "
        "`--api-server-count` (bench_serving from 6 client processes). Dummy weights; Qwen3-0.6B "
        "and Llama-3.1-8B with their vocabulary cut to SmolLM2's 49,152, so that SmolLM2's "
        "tokenizer detokenizes every token. *front-end CPU*: the front-end processes' CPU "
        "seconds per streamed token; the Engine's *mean step*: its seconds over the output "
        "length.",
        http_table,
    ),
    Section(
        "HTTP front end on the CPU (`bench_http.py --device cpu`)",
        ("http",),
        "The front end's own cost: 256 requests of 32 random prompt tokens and 128 output tokens "
        "at once, SmolLM2's vocabulary on a tiny body served on the CPU with the built-in "
        "tokenizer; the scheduler is the slow part, so every chunk carries one token. *front-end "
        "CPU*: the front-end processes' CPU seconds per streamed token (the client and the "
        "scheduler share the machine's cores).",
        http_table,
        folders=(CPU,),
    ),
    Section(
        "Speculative decoding (`bench_speculative.py`)",
        ("speculative",),
        "Greedy requests, plain and speculating: a replay drafter (the tokens plain decoding "
        "produced, a share of them corrupted: a set acceptance) on dummy models made copying "
        "ones (so no rounding changes the text), a Llama-3.2-1B-shaped draft model for "
        "Llama-3.1-8B (both copying: every draft right), and the n-gram drafter on the built-in "
        "SmolLM2 asked to repeat texts of three gsm8k questions word for word (at least 16 "
        "prompts per batch size, in waves of that size). Output tok/s, *timed* over the "
        "decode phase (from every request's first token on) or the whole run; per batch size the "
        "speed-up over plain decoding and, in brackets, the tokens a request gains per verify "
        "step. Below the table: verify and draft steps against a decode step, the draft steps "
        "of that draft model and of an EAGLE-3 head for Llama-3.1-8B (dummy weights; the "
        "target writing the head's features).",
        speculative_table,
    ),
    Section(
        "Prefix cache (`bench_prefix.py`)",
        ("prefix",),
        "The prefix cache through the in-process Engine, dummy Qwen3-0.6B, a fresh Engine per "
        "workload with the cache on and off. *shared_prefix*: one long prefix shared; "
        "*multi_turn*: each turn's prompt the last one, its answer and a new message; *cached*: "
        "prompt tokens reported cached.",
        prefix_table,
    ),
    Section(
        "Sampling adjustments (`bench_sampling.py`)",
        ("sampling",),
        "Decode ms per step through the scheduler (overlap schedule, full decode graphs, dummy "
        "Qwen3-0.6B), plain requests against requests with presence, frequency and repetition "
        "penalties and a `logit_bias` entry.",
        sampling_table,
    ),
    Section(
        "Start-up (`bench_startup.py`)",
        ("startup",),
        "Seconds from spawning `launch_server` to the first token of `POST /generate`: *cold* "
        "with empty compile, Triton and tokenizer caches, *warm* on those the cold start filled; "
        "each start reads a bytecode cache filled before the first. The JSON's `rows` hold every "
        "stage's seconds.",
        startup_table,
    ),
    Section(
        "Start-up on the CPU",
        ("startup",),
        "The same on the CPU with the built-in SmolLM2 GGUF (float32, eager), and the Engine.",
        startup_table,
        folders=(CPU,),
    ),
    Section(
        "Accuracy per mode (`test/accuracy/test_mode_accuracy.py`)",
        ("accuracy",),
        "gsm8k and mgsm_en asked of one server per decode x prefill cell accepted on CUDA and of "
        "an eager one, SmolLM2-135M-Instruct, `--deterministic`, greedy. A cell passes when its "
        "accuracy lies in eager's 95% interval and enough completions (the JSON's "
        "`min_identical`) equal eager's.",
        accuracy_table,
    ),
    Section(
        "Attention backends (`bench_attention_backends.py`)",
        ("attention_backends",),
        "One attention layer through each backend's interface, bf16, random KV slots: decode "
        "replayed from a CUDA graph, prefill eagerly (as breakable graphs run it). *hook*: the "
        "backend's per-step work before its kernels (replay hook, `init_forward_metadata`).",
        backends_table,
    ),
    Section(
        "Attention kernels (`bench_attention.py`)",
        ("attention",),
        "The Triton attention kernels alone with Qwen3-0.6B's heads, bf16 (decode also over an "
        "fp8 cache, its bytes counted at one a value), against ceilings "
        "measured in the run (the copy rate counts bytes read and written, so pure reads can pass "
        "it). Decode: the model's launch, graphed; *mixed*: lengths uniform in 100-2048, in "
        "request order or longest first.",
        attention_table,
    ),
    Section(
        "Host time per decode step at scale (`tuning/bench_decode_host.py`)",
        ("decode_host_scale",),
        "The host side of a server's decode step with hundreds of running requests (dummy "
        "Qwen3-0.6B): `prepare_decode` builds the batch, `runner.forward` launches the graph; the "
        "whole step includes the GPU's work.",
        decode_host_table,
    ),
    Section(
        "CUDA-graph capture (`tuning/bench_capture.py`)",
        ("capture",),
        "A capture's seconds per phase, warm Triton cache: *start* in a fresh process, *again* "
        "repeated in it, *no empty_cache* with `torch.cuda.empty_cache` a no-op; *rest*: the "
        "captured forwards.",
        capture_table,
    ),
)

INTRO = """# Benchmarks

<!-- Generated by benchmark/render_docs.py from benchmark/results/: edit those, not this page. -->

The current result of each benchmark, from its JSON under `benchmark/results/<gpu>/` (history in
git); [benchmark/README.md](../benchmark/README.md) describes the scripts, [tuning.md](tuning.md)
the kernel choices. Named models: `benchmark/configs/`, random bf16 weights; step times: CUDA-event
medians after warm-up; compare within a table (hosts of one GPU kind differ by a few percent).
"""


def gpu_folders(results: Path) -> tuple[str, ...]:
    """The GPU folders under `results`, GPU_PREFERENCE's first, then the others by name."""
    names = [p.name for p in results.iterdir() if p.is_dir() and p.name != CPU]
    rank = {name: i for i, name in enumerate(GPU_PREFERENCE)}
    return tuple(sorted(names, key=lambda name: (rank.get(name, len(rank)), name)))


def section_files(section: Section, results: Path) -> list[Path]:
    """The section's JSON in the first of its folders that holds any ([] where none does)."""
    for folder in section.folders or gpu_folders(results):
        found = [results / folder / f"{name}.json" for name in section.names]
        if any(path.is_file() for path in found):
            return [path for path in found if path.is_file()]
    return []


def load(path: Path) -> Doc:
    """The JSON at `path`; SystemExit where its environment's device is another folder's."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    gpu = doc.get("environment", {}).get("gpu")
    if gpu_slug(gpu) != path.parent.name:
        raise SystemExit(
            f"{path}: measured on {gpu or 'the CPU'}, so it belongs in {gpu_slug(gpu)}/"
        )
    return doc


def provenance(sources: list[tuple[Path, Doc]]) -> list[str]:
    """List items: each distinct command, then each distinct device, versions, commit and date
    with links to the JSON that record them."""
    commands = dict.fromkeys(
        doc.get("environment", {}).get("command") or "command not recorded" for _, doc in sources
    )
    runs: dict[str, list[str]] = {}
    for path, doc in sources:
        env = doc.get("environment", {})
        cuda = f" (CUDA {env['cuda']})" if env.get("cuda") else ""
        versions = [f"torch {env.get('torch')}{cuda}", f"triton {env.get('triton')}"]
        versions += [f"driver {env['driver']}"] if env.get("driver") else []
        commit = f"commit `{env['commit']}`" if env.get("commit") else "commit not recorded"
        run = (
            f"{env.get('gpu') or 'CPU'}, {', '.join(versions)}; {commit}, "
            f"{env.get('date') or 'date not recorded'}"
        )
        link = Path(os.path.relpath(path, PAGE.parent)).as_posix()
        runs.setdefault(run, []).append(f"[{path.name}]({link})")
    return [f"- `{command}`" for command in commands] + [
        f"- {run}: {', '.join(links)}" for run, links in runs.items()
    ]


def markdown_table(table: Table) -> list[str]:
    """The table's lines, leaving out the columns that no row fills."""
    keep = [i for i in range(len(table.header)) if any(row[i] for row in table.rows)]
    align = ["---" if i < table.labels else "---:" for i in keep]
    lines = [
        [table.header[i] for i in keep],
        align,
        *([row[i] for i in keep] for row in table.rows),
    ]
    out = ["| " + " | ".join(cells) + " |" for cells in lines]
    return out + ([f"\n{table.note}"] if table.note else [])


def render_section(section: Section, paths: list[Path]) -> list[str]:
    docs = [load(path) for path in paths]
    sources = [(path.stem, doc) for path, doc in zip(paths, docs, strict=True)]
    lines = [f"## {section.title}", "", textwrap.fill(section.prose, 100), ""]
    lines += provenance(list(zip(paths, docs, strict=True)))
    lines += ["", *markdown_table(section.table(sources)), ""]
    if section.plot and (IMAGES / section.plot.image).is_file():
        lines += [f"![{section.title.replace('`', '')}](img/{section.plot.image})", ""]
    return lines


def render(results: Path = RESULTS) -> str:
    """The page: INTRO, then every section whose JSON `results` holds, in SECTIONS' order."""
    lines = [INTRO]
    for section in SECTIONS:
        paths = section_files(section, results)
        if paths:
            lines += render_section(section, paths)
    return "\n".join(lines).rstrip("\n") + "\n"


def unrendered(results: Path) -> list[Path]:
    """The JSON under `results` that no section shows (another GPU's beside the one shown, or a
    benchmark without a section)."""
    shown = {path for section in SECTIONS for path in section_files(section, results)}
    return sorted(set(results.glob("*/*.json")) - shown)


def draw_plots(results: Path) -> None:
    """Redraw every section's plot from the JSON the page shows, with benchmark/plot.py."""
    for section in SECTIONS:
        paths = section_files(section, results)
        if section.plot and section.plot.names:
            paths = [path for path in paths if path.stem in section.plot.names]
        if section.plot and paths:
            cmd = [sys.executable, str(REPO / "benchmark" / "plot.py"), section.plot.flag]
            subprocess.run([*cmd, *map(str, paths), "--out", str(IMAGES)], check=True)


def check(page: str) -> int:
    """0 when the committed page is `page`; else 1, with the difference on stderr."""
    committed = PAGE.read_text(encoding="utf-8") if PAGE.is_file() else ""
    if committed == page:
        return 0
    diff = difflib.unified_diff(
        committed.splitlines(), page.splitlines(), "committed", "rendered", lineterm="", n=0
    )
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    print(
        f"{os.path.relpath(PAGE, REPO)} differs from its render of benchmark/results: "
        "run python benchmark/render_docs.py",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--plots", action="store_true", help="redraw the plots first")
    args = parser.parse_args(argv)
    if args.plots:
        draw_plots(RESULTS)
    for path in unrendered(RESULTS):
        print(f"not on the page: {path.relative_to(REPO)}", file=sys.stderr)
    page = render()
    if args.check:
        return check(page)
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
