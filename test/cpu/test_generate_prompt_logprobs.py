"""SGLang's logprobs on `/generate`: the output's in `meta_info.output_token_logprobs` /
`output_top_logprobs`, and with `logprob_start_len` the prompt's from token k on in
`input_token_logprobs` / `input_top_logprobs`, each `[logprob, token id, text]`, checked against
the same server's completions route (its `logprobs`, vLLM's `prompt_logprobs`)."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog because"
TOP = 3


@pytest.fixture(scope="module")
def prompt_ids(http: httpx.Client) -> list[int]:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert len(ids) > 4
    return ids


def _generate(http: httpx.Client, ids: list[int], **fields: object) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    return http.post("/generate", json={**body, "return_logprob": True, **fields})


@pytest.fixture(scope="module")
def reference(http: httpx.Client, prompt_ids: list[int]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of the prompt, from the completions route."""
    body = {"prompt": prompt_ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": TOP}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["prompt_logprobs"]


@pytest.mark.parametrize("start", [0, 3])
def test_prompt_logprobs_from_start_equal_the_completions_route(http, prompt_ids, reference, start):
    response = _generate(http, prompt_ids, logprob_start_len=start, top_logprobs_num=TOP)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t, _ in tokens] == prompt_ids[start:]
    assert len(tops) == len(tokens) and all(text is None for _, _, text in tokens)
    assert len(meta["output_token_logprobs"]) == 2
    rows = zip(tokens, tops, strict=True)
    for pos, ((logprob, token_id, _), top) in enumerate(rows, start=start):
        if pos == 0:  # nothing predicts the first prompt token
            assert logprob is None and top is None and reference[0] is None
            continue
        expected = reference[pos]
        assert logprob == pytest.approx(expected[str(token_id)]["logprob"], abs=1e-5)
        ranked = sorted(
            (e["rank"], int(t), e["logprob"]) for t, e in expected.items() if e["rank"] is not None
        )
        assert len(top) == TOP and all(text is None for _, _, text in top)
        assert [t for _, t, _ in top] == [t for _, t, _ in ranked]
        assert [v for v, _, _ in top] == pytest.approx([v for _, _, v in ranked], abs=1e-5)


def test_without_top_logprobs_num_there_are_no_top_lists(http, prompt_ids):
    meta = _generate(http, prompt_ids, logprob_start_len=1).json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(prompt_ids) - 1
    assert "input_top_logprobs" not in meta


@pytest.mark.parametrize(
    "fields",
    [{"logprob_start_len": -1}, {}, {"return_logprob": False, "logprob_start_len": 0}],
    ids=["minus-one", "default", "no-return-logprob"],
)
def test_no_prompt_logprobs_unless_asked(http, prompt_ids, fields):
    response = _generate(http, prompt_ids, **fields)
    assert response.status_code == 200, response.text
    assert "input_token_logprobs" not in response.json()["meta_info"]


def test_a_start_out_of_range_is_a_400_naming_it(http, prompt_ids):
    for start in (len(prompt_ids), -2):
        response = _generate(http, prompt_ids, logprob_start_len=start)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "logprob_start_len" and error["type"] == "invalid_request_error"


def test_a_stream_carries_them_once_on_its_first_chunk(http, prompt_ids):
    fields = {"logprob_start_len": 2, "top_logprobs_num": TOP}
    whole = _generate(http, prompt_ids, **fields).json()["meta_info"]
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
        **fields,
    }
    with http.stream("POST", "/generate", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    metas = [json.loads(line[len("data: ") :])["meta_info"] for line in lines]
    assert len(metas) > 1
    assert [("input_token_logprobs" in m) for m in metas] == [True] + [False] * (len(metas) - 1)
    assert "input_top_logprobs" in metas[0]
    assert metas[0]["input_token_logprobs"] == whole["input_token_logprobs"]


def test_output_logprobs_take_sglangs_shape_and_equal_the_completions_route(http, prompt_ids):
    response = _generate(http, prompt_ids, top_logprobs_num=TOP)
    assert response.status_code == 200, response.text
    result = response.json()
    meta = result["meta_info"]
    tokens, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert [t for _, t, _ in tokens] == result["output_ids"]
    assert all(text is None for _, _, text in tokens)
    body = {"prompt": prompt_ids, "max_tokens": 2, "temperature": 0, "logprobs": TOP}
    reference = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert [v for v, _, _ in tokens] == pytest.approx(reference["token_logprobs"], abs=1e-5)
    for top, expected in zip(tops, reference["top_logprobs"], strict=True):
        assert len(top) == TOP and top[0][0] >= top[-1][0]  # most likely first
        assert sorted(v for v, _, _ in top) == pytest.approx(sorted(expected.values()), abs=1e-5)


def test_no_output_top_lists_without_top_logprobs_num(http, prompt_ids):
    meta = _generate(http, prompt_ids).json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == 2 and "output_top_logprobs" not in meta
