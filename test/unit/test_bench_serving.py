"""benchmark/bench_serving.py's workloads without a server: the requests each prefix-cache run
builds, the next turn of a conversation from the previous answers, the cached tokens read from
both usage shapes into the summary, and the json_schema workload's prompts. (Runs against a real
server: test_http_api.py, test_structured_output_http.py.)"""

from __future__ import annotations

import json
import random

import pytest

from script_import import import_script

bench = import_script("benchmark/bench_serving.py")
SIZES = ["--prefix-len", "6", "--suffix-len", "2", "--turns", "3", "--user-len", "4"]


def args_for(*argv: str):
    return bench.parse_args(["--random-output-len", "5", *SIZES, *argv])


def test_shared_prefix_requests_share_one_prefix_and_the_warmup_another():
    args = args_for("--num-prompts", "4", "--warmup", "2")
    plan = bench.prefix_plan(args, "shared_prefix", random.Random(0))
    assert len(plan.warmup) == 2 and len(plan.first) == 4 and plan.follow_ups == []
    for specs in (plan.warmup, plan.first):
        assert all(s.input_len == len(s.prompt) == 8 and s.output_len == 5 for s in specs)
        assert len({tuple(s.prompt[:6]) for s in specs}) == 1  # one prefix
        assert len({tuple(s.prompt[6:]) for s in specs}) == len(specs)  # own suffixes
    assert plan.warmup[0].prompt[:6] != plan.first[0].prompt[:6]
    low, high = args.random_token_range
    assert all(low <= t < high for s in plan.first for t in s.prompt)
    # every run draws its prompts afresh: a later run finds nothing of its own cached
    rng = random.Random(0)
    first, again = (bench.prefix_plan(args, "shared_prefix", rng).first for _ in range(2))
    assert first[0].prompt[:6] != again[0].prompt[:6]


def test_multi_turn_prompts_grow_by_each_answer_and_a_new_message():
    plan = bench.prefix_plan(
        args_for("--num-prompts", "3", "--endpoint", "generate"), "multi_turn", random.Random(0)
    )
    assert [len(s.prompt) for s in plan.first] == [4, 4, 4]
    assert [s.conversation for s in plan.first] == [0, 1, 2]
    assert len(plan.follow_ups) == 2 and all(len(m) == 3 for m in plan.follow_ups)
    answers = [
        bench.RequestResult(ok=True, output_ids=[7, 8, 9]),
        bench.RequestResult(ok=False, error="HTTP 500"),  # ends its conversation
        bench.RequestResult(ok=True, output_ids=[5]),
    ]
    messages = plan.follow_ups[0]
    second = bench.next_turn(plan.first, answers, messages)
    assert [s.conversation for s in second] == [0, 2]
    assert second[0].prompt == plan.first[0].prompt + [7, 8, 9] + messages[0]
    assert second[1].prompt == plan.first[2].prompt + [5] + messages[2]
    assert [s.input_len for s in second] == [4 + 3 + 4, 4 + 1 + 4]
    assert all(s.output_len == 5 for s in second)
    third = bench.next_turn(
        second, [bench.RequestResult(ok=True, output_ids=[1])] * 2, plan.follow_ups[1]
    )
    assert third[1].prompt == second[1].prompt + [1] + plan.follow_ups[1][2]


@pytest.mark.parametrize(
    ("usage", "cached"),
    [
        ({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}, 4),  # OpenAI
        ({"prompt_tokens": 9, "cached_tokens": 3}, 3),  # native meta_info (SGLang's)
        ({"prompt_tokens": 9, "prompt_tokens_details": None}, None),
        ({"prompt_tokens": 9}, None),
    ],
)
def test_cached_tokens_from_either_usage(usage, cached):
    assert bench.cached_tokens(usage) == cached


def test_the_summary_counts_cached_tokens_of_the_requests_reporting_them():
    def result(input_len: int, cached: int | None) -> bench.RequestResult:
        return bench.RequestResult(
            ok=True, input_len=input_len, output_len=2, ttft=0.1, latency=0.2, cached_len=cached
        )

    args = args_for()
    reported = bench.RunResult([result(100, 90), result(50, 0), result(30, None)], 1.0)
    row = bench.summarize(args, "m", "shared_prefix", float("inf"), None, reported)
    assert row["total_input_tokens"] == 180 and row["total_cached_tokens"] == 90
    assert row["cache_hit_rate"] == round(90 / 150, 3)
    assert row["dataset"] == "random"
    silent = bench.summarize(args, "m", "plain", 1.0, None, bench.RunResult([result(8, None)], 1.0))
    assert silent["total_cached_tokens"] is None and silent["cache_hit_rate"] is None


@pytest.mark.parametrize(
    ("workload", "endpoint"),
    [("multi_turn", "completions"), ("multi_turn", "chat"), ("shared_prefix", "chat")],
)
def test_prefix_workloads_need_token_id_endpoints(workload, endpoint, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", workload, "--endpoint", endpoint, "--dataset", "x.jsonl"])
    assert workload in capsys.readouterr().err


def test_json_schema_prompts_ask_each_person_for_the_fields_as_text():
    args = args_for("--num-prompts", "6")
    plain = bench.random_specs(args, random.Random(0))
    specs = bench.json_schema_specs(plain, bench.RECORD_SCHEMA, random.Random(0))
    assert [s.output_len for s in specs] == [s.output_len for s in plain]
    assert all(isinstance(s.prompt, str) and s.input_len is None for s in specs)
    assert len({s.prompt for s in specs}) == 6  # a person each
    for i, spec in enumerate(specs):
        assert isinstance(spec.prompt, str)
        assert spec.prompt.startswith(f"Generate an example profile of person {i}, a ")
        assert "with the fields name, age, email, tags, active," in spec.prompt
        assert json.dumps(bench.RECORD_SCHEMA) in spec.prompt
    colours = {"type": "array", "items": {"enum": ["red", "blue"]}}
    assert "fields" not in bench.json_schema_prompt(colours, 0, "baker")


def test_json_schema_alone_may_go_to_the_chat_endpoint():
    args = bench.parse_args(["--workload", "json_schema", "--endpoint", "chat"])
    assert args.dataset == "random"  # only the output lengths come from it
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "plain", "json_schema", "--endpoint", "chat"])
