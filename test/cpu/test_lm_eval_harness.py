"""lm-eval-harness's `local-completions` model against a real server (the built-in SmolLM2): a
loglikelihood (multiple-choice) task and a generation task, end to end, with lm-eval's own
client, request shapes and parsing. Both tasks are local files written here (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from server_process import start_server

lm_eval = pytest.importorskip("lm_eval")

# easy for a 135M instruct model: its loglikelihoods must rank the right answer first
CHOICES = [
    ("The capital of France is", [" Paris", " banana", " seventeen"], 0),
    ("Two plus two equals", [" purple", " four", " London"], 1),
    ("The opposite of hot is", [" cold", " triangle", " Tuesday"], 0),
    ("A cat says", [" carburettor", " meow", " eleven"], 1),
    ("Monday, Tuesday,", [" Wednesday", " spoon", " Jupiter"], 0),
]
QUESTIONS = [("What is 2 + 2?", "4"), ("What colour is the sky on a clear day?", "blue")]


def _write_tasks(folder: Path) -> None:
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in CHOICES]
    (folder / "choices.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    qa = [{"question": q, "answer": a} for q, a in QUESTIONS]
    (folder / "qa.jsonl").write_text("\n".join(json.dumps(r) for r in qa))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "choices.yaml").write_text(
        "task: replaylm_choices\n"
        + common
        + f"dataset_kwargs:\n  data_files:\n    test: {folder / 'choices.jsonl'}\n"
        + "output_type: multiple_choice\n"
        + 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        + 'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
        + "metric_list:\n  - metric: acc\n"
    )
    (folder / "qa.yaml").write_text(
        "task: replaylm_qa\n"
        + common
        + f"dataset_kwargs:\n  data_files:\n    test: {folder / 'qa.jsonl'}\n"
        + "output_type: generate_until\n"
        + 'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{answer}}"\n'
        + "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 12\n  do_sample: false\n"
        + "metric_list:\n  - metric: exact_match\n"
    )


@pytest.fixture(scope="module")
def server():
    server = start_server("--max-total-tokens", "8192")
    yield server
    server.stop()


def test_loglikelihood_and_generation_tasks_run_end_to_end(server, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    _write_tasks(tmp_path)
    base = server.base_url
    results = simple_evaluate(
        model="local-completions",
        model_args=(
            f"base_url={base}/v1/completions,model=smollm2-135m-instruct,"
            "tokenizer_backend=remote,num_concurrent=2,max_retries=1"
        ),
        tasks=["replaylm_choices", "replaylm_qa"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    assert results is not None
    choices = results["samples"]["replaylm_choices"]
    assert len(choices) == len(CHOICES)
    for sample in choices:
        loglikelihoods = [resp[0][0] for resp in sample["resps"]]
        assert all(ll < 0 for ll in loglikelihoods)
        # lm-eval's score equals the server's own: the echoed prompt logprobs of the choice
        prompt = sample["arguments"][0][0] + sample["arguments"][0][1]
        assert loglikelihoods[0] == pytest.approx(
            _continuation_logprob(base, sample["arguments"][0]), abs=1e-3
        ), prompt
    assert results["results"]["replaylm_choices"]["acc,none"] >= 0.8
    qa = results["samples"]["replaylm_qa"]
    assert len(qa) == len(QUESTIONS) and all(isinstance(s["resps"][0][0], str) for s in qa)
    assert "exact_match,none" in results["results"]["replaylm_qa"]


def _continuation_logprob(base: str, arguments: tuple[str, str]) -> float:
    """Sum of the continuation tokens' logprobs from /v1/completions with echo, tokenized by
    /tokenize as lm-eval does (context and continuation apart)."""
    context, continuation = arguments
    with httpx.Client(base_url=base, timeout=60) as client:

        def ids(text: str) -> list[int]:
            r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
            return r.json()["tokens"]

        ctx, cont = ids(context), ids(continuation)
        body = {"prompt": ctx + cont, "max_tokens": 1, "echo": True, "logprobs": 1}
        r = client.post("/v1/completions", json={**body, "temperature": 0})
        r.raise_for_status()
        token_logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    return sum(token_logprobs[len(ctx) : len(ctx) + len(cont)])
