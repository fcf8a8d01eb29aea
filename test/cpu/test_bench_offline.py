"""benchmark/bench_offline.py in-process on the CPU: a tiny checkpoint, a few short sequences,
two spellings of the eager mode, each with and without the overlap schedule. Every requested
token is generated and counted."""

from __future__ import annotations

import json

import pytest
import torch

from script_import import import_script
from tiny_checkpoints import write_tiny_checkpoint

NUM_SEQS, MIN_LEN, MAX_LEN, SEED = 6, 3, 20, 7
MODES = ["disabled", '{"decode": "disabled", "prefill": "disabled"}']


def test_offline_bench_generates_and_counts_every_requested_token(tmp_path):
    bench = import_script("benchmark/bench_offline.py")
    vocab = write_tiny_checkpoint("qwen3", tmp_path / "ckpt").config.vocab_size
    out = tmp_path / "offline.json"
    bench.main(
        [
            "--model-path",
            str(tmp_path / "ckpt"),
            "--device",
            "cpu",
            "--num-seqs",
            str(NUM_SEQS),
            "--min-len",
            str(MIN_LEN),
            "--max-len",
            str(MAX_LEN),
            "--seed",
            str(SEED),
            "--modes",
            *MODES,
            "--overlap",
            "on",
            "off",
            "--json",
            str(out),
        ]
    )

    doc = json.loads(out.read_text())
    workload = bench.make_workload(NUM_SEQS, MIN_LEN, MAX_LEN, SEED, vocab)
    assert all(MIN_LEN <= len(p) <= MAX_LEN for p in workload.prompts)
    assert all(MIN_LEN <= n <= MAX_LEN for n in workload.output_lens)
    assert doc["config"]["num_seqs"] == NUM_SEQS and doc["config"]["modes"] == MODES
    assert [(row["mode"], row["overlap"]) for row in doc["summary"]] == [
        (m, overlap) for m in MODES for overlap in (True, False)
    ]
    for row in doc["summary"]:
        assert (row["decode"], row["prefill"]) == ("disabled", "disabled")
        assert row["num_seqs"] == NUM_SEQS
        assert row["input_tokens"] == sum(len(p) for p in workload.prompts)
        assert row["output_tokens"] == row["requested_output_tokens"] == sum(workload.output_lens)
        assert row["seconds"] > 0
        assert row["output_throughput"] > 0 and row["total_throughput"] > row["output_throughput"]
        decode, prefill = row["forwards"]["decode"], row["forwards"]["prefill"]
        assert decode["graph"] == prefill["graph"] == 0  # eager on the CPU
        # every sequence needs a prefill, and the longest output that many decode steps less one
        assert prefill["eager"] >= 1 and decode["eager"] >= max(workload.output_lens) - 1


def test_a_fixed_output_length_times_prefills_with_mixed_steps(tmp_path):
    """`--output-len 1`: one token per request, so the run is its prefills; the same prompts as
    without it. With mixed chunks (`--server-args`) every token still comes."""
    bench = import_script("benchmark/bench_offline.py")
    vocab = write_tiny_checkpoint("qwen3", tmp_path / "ckpt").config.vocab_size
    rows = bench.main(
        [
            *("--model-path", str(tmp_path / "ckpt"), "--device", "cpu", "--modes", "disabled"),
            *("--num-seqs", "4", "--min-len", "9", "--max-len", "9", "--output-len", "1"),
            *("--server-args", "{}", '{"enable_mixed_chunk": true, "chunked_prefill_size": 8}'),
        ]
    )
    fixed = bench.make_workload(4, 9, 9, 0, vocab, output_len=1)
    assert fixed.prompts == bench.make_workload(4, 9, 9, 0, vocab).prompts
    assert fixed.output_lens == [1] * 4
    for row in rows:
        assert row["output_tokens"] == row["requested_output_tokens"] == 4
        assert row["forwards"]["decode"]["eager"] == 0  # a first token comes from its prefill


def test_kernel_categories_of_the_run_profile():
    names = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": "matmul",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "matmul",
        "_skinny_matmul_kernel": "matmul",
        "_decode_kernel": "decode attention",
        "_merge_kernel": "decode attention",
        "_extend_kernel": "prefill attention",
        "BatchPrefillWithPagedKVCacheKernel": "prefill attention",
        "_rms_norm_kernel": "norms",
        "_silu_mul_kernel": "activation",
        "_qk_norm_rope_kernel": "rope and KV store",
        "_block_argmax_kernel": "sampling",
        "void at::native::vectorized_gather_kernel<16, long>": "other",
    }
    common = import_script("benchmark/common.py")
    assert {name: common.kernel_category(name) for name in names} == names


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_profile_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        import_script("benchmark/bench_offline.py").parse_args(["--profile"])
    assert "--profile times CUDA kernels" in capsys.readouterr().err
