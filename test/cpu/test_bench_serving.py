"""benchmark/bench_serving.py's workloads without a server: the random prompts' length
distributions, how many requests a run at each rate sends, the requests each prefix-cache run
builds, the next turn of a conversation from the previous answers, the cached tokens read from
both usage shapes into the summary, the closing table of every run, and the json_schema
workload's prompts; its client against a stub server's streams and failures; and runs split over
`--client-processes` against the tiny keyed server. (Other runs against a real server:
test_http_api.py, test_structured_output_http.py.)"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from http_helpers import TINY_API_KEY, run_bench_serving
from script_import import import_script
from server_process import free_port

bench = import_script("benchmark/bench_serving.py")
SIZES = ["--prefix-len", "6", "--suffix-len", "2", "--turns", "3", "--user-len", "4"]


def args_for(*argv: str):
    return bench.parse_args(["--random-output-len", "5", *SIZES, *argv])


def test_lognormal_lengths_have_the_length_as_median_and_a_clipped_long_tail():
    args = bench.parse_args(["--random-dist", "lognormal", "--random-sigma", "1"])
    rng = random.Random(0)
    drawn = [bench.random_length(args, rng, 200, 1600) for _ in range(4000)]
    assert 190 <= statistics.median(drawn) <= 210
    # sigma 1: the mean is below exp(1/2) = 1.65 medians (clipped), a tenth of the draws above
    # 3.6 medians
    assert 1.45 * 200 <= statistics.mean(drawn) <= 1.7 * 200
    assert 0.07 <= sum(n > 3.6 * 200 for n in drawn) / len(drawn) <= 0.13
    assert max(drawn) == 1600 and min(drawn) >= 1  # 8x the median: about 2% clipped there
    # a wide spread clips both ends: rounded to 0 below, the longest above
    wide = bench.parse_args(["--random-dist", "lognormal", "--random-sigma", "3"])
    clipped = [bench.random_length(wide, rng, 10, 50) for _ in range(2000)]
    assert min(clipped) == 1 and max(clipped) == 50
    assert 0.2 < clipped.count(50) / len(clipped) < 0.4  # P(ln L > ln 5) = 0.30


def test_uniform_lengths_stay_within_the_range_ratio():
    args = bench.parse_args(["--random-range-ratio", "0.25"])
    assert args.random_dist == "uniform"
    rng = random.Random(0)
    drawn = [bench.random_length(args, rng, 200, 1600) for _ in range(2000)]
    assert min(drawn) == 50 and max(drawn) == 200


def test_random_prompts_follow_the_distribution_up_to_the_longest():
    args = bench.parse_args(
        ["--random-dist", "lognormal", "--random-input-len", "64", "--random-output-len", "16"]
        + ["--random-max-output-len", "40", "--random-token-range", "5", "9"]
    )
    assert args.random_max_input_len == 8 * 64 and args.random_max_output_len == 40
    specs = bench.random_specs(args, random.Random(0), 500)
    assert len(specs) == 500
    assert all(s.input_len == len(s.prompt) and 1 <= s.input_len <= 512 for s in specs)
    assert all(5 <= t < 9 for s in specs for t in s.prompt)
    assert max(s.output_len for s in specs) == 40
    assert 56 <= statistics.median(s.input_len for s in specs) <= 72
    assert 14 <= statistics.median(s.output_len for s in specs) <= 18


@pytest.mark.parametrize(
    "argv",
    [
        ["--random-sigma", "0"],
        ["--rate-seconds", "0"],
        ["--rate-seconds", "-1"],
        ["--client-processes", "0"],
    ],
)
def test_nonpositive_sigma_rate_seconds_or_client_processes_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_rate_seconds_scale_each_finite_rate_s_requests():
    fixed = bench.parse_args(["--num-prompts", "300"])
    assert [bench.run_prompts(fixed, r) for r in (4.0, 64.0, math.inf)] == [300, 300, 300]
    scaled = bench.parse_args(["--num-prompts", "300", "--rate-seconds", "12"])
    # at least MIN_RATE_PROMPTS at a low rate; all at once still sends --num-prompts
    assert [bench.run_prompts(scaled, r) for r in (4.0, 64.0, 100.5, math.inf)] == [
        bench.MIN_RATE_PROMPTS,
        768,
        1206,
        300,
    ]


def test_shared_prefix_requests_share_one_prefix_and_the_warmup_another():
    args = args_for("--num-prompts", "4", "--warmup", "2")
    plan = bench.prefix_plan(args, "shared_prefix", random.Random(0), 4)
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
    first, again = (bench.prefix_plan(args, "shared_prefix", rng, 4).first for _ in range(2))
    assert first[0].prompt[:6] != again[0].prompt[:6]


def test_each_plain_run_draws_random_prompts_of_its_own_and_a_dataset_run_the_same(tmp_path):
    args = bench.parse_args(["--random-input-len", "12", "--warmup", "2"])
    rng = random.Random(0)
    runs = [bench.run_plan(args, "plain", rng, n, []) for n in (5, 3)]
    prompts = [[tuple(s.prompt) for s in plan.warmup + plan.first] for plan in runs]
    assert [len(p) for p in prompts] == [2 + 5, 2 + 3]
    assert len(set(prompts[0] + prompts[1])) == 7 + 5  # none sent twice, warm-up included
    rows = [{"question": f"q{i}"} for i in range(4)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    data = bench.parse_args(["--dataset", str(tmp_path / "d.jsonl"), "--warmup", "1"])
    fixed = bench.dataset_specs(data, random.Random(0), 6)
    assert sorted({s.prompt for s in fixed}) == ["q0", "q1", "q2", "q3"]  # cycled to 6
    for n in (6, 3):
        plan = bench.run_plan(data, "plain", rng, n, fixed)
        assert plan.warmup == fixed[:1] and plan.first == fixed[:n]


def test_multi_turn_prompts_grow_by_each_answer_and_a_new_message():
    plan = bench.prefix_plan(args_for("--endpoint", "generate"), "multi_turn", random.Random(0), 3)
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
    plain = bench.random_specs(args, random.Random(0), 6)
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


def test_every_run_s_row_and_the_closing_table_give_throughput_and_latency_percentiles():
    def result(ttft: float, gaps: list[float]) -> bench.RequestResult:
        latency = ttft + sum(gaps)
        return bench.RequestResult(
            ok=True, input_len=10, output_len=len(gaps) + 1, ttft=ttft, latency=latency, itl=gaps
        )

    args = args_for()
    runs = [
        (4.0, None, [result(0.02, [0.01] * 4), result(0.04, [0.01, 0.03])]),
        (math.inf, 32, [result(0.2, [0.02] * 3), bench.RequestResult(ok=False, error="x")]),
    ]
    rows = [
        bench.summarize(args, "m", "plain", rate, conc, bench.RunResult(results, 2.0))
        for rate, conc, results in runs
    ]
    first, second = rows
    assert (first["request_rate"], first["max_concurrency"]) == (4.0, None)
    assert (second["request_rate"], second["max_concurrency"]) == ("inf", 32)
    assert first["request_throughput"] == 1.0 and first["output_token_throughput"] == 4.0
    assert first["p50_ttft_ms"] == 30.0 and first["p99_ttft_ms"] == 39.8
    # six gaps, five of 10 ms and one of 30: the 99th percentile lies 0.95 of the way up
    assert first["p50_itl_ms"] == 10.0 and first["p99_itl_ms"] == 29.0
    assert first["p50_tpot_ms"] == 15.0  # 40 ms over 4 tokens after the first, and over 2
    assert second["completed"] == 1 and second["failed"] == 1 and second["p50_tpot_ms"] == 20.0

    table = bench.sweep_table(rows).splitlines()
    headings = ["rate", "max conc", "req/s", "out tok/s", "TTFT p50", "TTFT p99"]
    headings += ["ITL p50", "ITL p99", "TPOT p50"]
    assert all(h in table[0] for h in headings) and len(table) == 2 + len(rows)
    throughput, ttft, itl, tpot = (
        ["1.00", "4.00"],
        ["30.00", "39.80"],
        ["10.00", "29.00"],
        ["15.00"],
    )
    # TP "-": the rows have no tensor-parallel size (a server that does not report one)
    counts = ["-", "plain", "4.00", "-", "2", "0"]
    assert table[2].split() == [*counts, *throughput, *ttft, *itl, *tpot]
    assert table[3].split()[2:6] == ["inf", "32", "1", "1"]


# ---- the client ----------------------------------------------------------------------------------


def sse(*events: str) -> bytes:
    return "".join(f"data: {event}\n\n" for event in events).encode()


STUB_STREAMS = {  # path -> (status, body) of the stub server
    "/ok": (
        200,
        sse(
            json.dumps({"choices": [{"text": '{"a"'}]}),
            json.dumps({"choices": [{"text": ""}]}),  # no text: neither TTFT nor a gap
            json.dumps({"choices": [{"text": ": 1}"}]}),
            json.dumps(
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 7,
                        "completion_tokens": 3,
                        "prompt_tokens_details": {"cached_tokens": 4},
                    },
                }
            ),
            "[DONE]",
        ),
    ),
    "/generate": (
        200,
        sse(
            json.dumps({"text": "x", "output_ids": [5, 6]}),
            json.dumps(
                {
                    "text": "y",
                    "output_ids": [7],
                    "meta_info": {"prompt_tokens": 2, "completion_tokens": 3},
                }
            ),
        ),
    ),
    "/error_event": (200, sse(json.dumps({"choices": [{"text": "a"}]}), '{"error": "boom"}')),
    "/bad_json": (200, sse("{not json")),
    "/refused": (422, b"x" * 400),
    "/slow": (200, sse("[DONE]")),  # after longer than the client's --timeout
}


async def with_stub_server(check: Callable[[str], Awaitable[None]]) -> None:
    """Run `check(base_url)` against a server answering STUB_STREAMS' paths."""

    async def answer(request: web.Request) -> web.Response:
        status, body = STUB_STREAMS[request.path]
        if request.path == "/slow":
            await asyncio.sleep(2)
        return web.Response(status=status, body=body, content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/{path}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        await check(f"http://127.0.0.1:{runner.addresses[0][1]}")
    finally:
        await runner.cleanup()


def test_the_client_times_streamed_chunks_and_reports_each_failure_as_its_error():
    spec = bench.RequestSpec([1, 2], 3, 2)
    got: dict[str, bench.RequestResult] = {}

    async def send_each(base: str) -> None:
        async with bench.open_client(args_for("--timeout", "0.5"), 4) as client:
            for path in STUB_STREAMS:
                got[path] = await bench.send(client, base + path, {}, spec, path == "/ok")
            closed = f"http://127.0.0.1:{free_port()}/ok"
            got["closed"] = await bench.send(client, closed, {}, spec, False)

    asyncio.run(with_stub_server(send_each))
    ok = got["/ok"]
    assert ok.ok and ok.error == "" and ok.valid_json is True
    assert (ok.input_len, ok.output_len, ok.cached_len) == (7, 3, 4)
    assert 0 < ok.ttft <= ok.latency and len(ok.itl) == 1  # two chunks with text
    native = got["/generate"]
    assert native.ok and native.output_ids == [5, 6, 7] and native.valid_json is None
    assert (native.input_len, native.output_len, len(native.itl)) == (2, 3, 1)
    assert not got["/error_event"].ok and got["/error_event"].error == "boom"
    assert got["/bad_json"].error.startswith("JSONDecodeError: ")
    assert got["/refused"].error == f"HTTP 422: {b'x' * 300!r}"  # the body's first 300 bytes
    assert got["closed"].error.startswith("ClientConnectorError: ")
    assert got["/slow"].error.startswith("TimeoutError")
    assert not any(r.ok for path, r in got.items() if path not in ("/ok", "/generate"))


def answer(conversation: int, input_len: int | None = None) -> tuple[int, bench.RequestResult]:
    """A client process's result of a request of `conversation` (failed without `input_len`)."""
    return conversation, bench.RequestResult(ok=input_len is not None, input_len=input_len)


def test_a_split_run_sends_request_i_from_process_i_mod_k_and_merges_back_in_order():
    specs = [bench.RequestSpec([i], 2, 1) for i in range(5)]  # conversation 0: a plain run's
    parts = bench.split_plan(bench.RunPlan(specs[:1], specs), 2)
    assert all(part.warmup == [] for part in parts)  # the parent warms up
    assert [[s.prompt[0] for s in part.first] for part in parts] == [[0, 2, 4], [1, 3]]
    assert [[s.conversation for s in part.first] for part in parts] == [[0, 2, 4], [1, 3]]
    assert all(s.conversation == 0 for s in specs)  # the run's own specs stay as they were
    answered = [[[answer(s.conversation, s.prompt[0]) for s in part.first]] for part in parts]
    assert [r.input_len for r in bench.merge_turns(answered)] == [0, 1, 2, 3, 4]

    plan = bench.prefix_plan(args_for("--endpoint", "generate"), "multi_turn", random.Random(0), 3)
    split = bench.split_plan(plan, 2)
    assert [[s.prompt for s in part.first] for part in split] == [
        [plan.first[0].prompt, plan.first[2].prompt],
        [plan.first[1].prompt],
    ]
    assert all(part.follow_ups == plan.follow_ups for part in split)  # indexed by conversation
    # process 0 holds conversations 0 and 2 (2 fails in turn 0, so it has no turn 1), process 1
    # conversation 1: the merge goes turn by turn, each in the order of its conversations
    process_0 = [[answer(0, 0), answer(2)], [answer(0, 10)]]
    process_1 = [[answer(1, 1)], [answer(1, 11)]]
    merged = bench.merge_turns([process_0, process_1])
    assert [r.input_len for r in merged] == [0, 1, None, 10, 11]


# ---- against the tiny keyed server: runs split over two client processes -------------------------


TINY_ARGS = (
    "--api-key",
    TINY_API_KEY,
    "--random-token-range",
    "5",
    "300",
    "--random-range-ratio",
    "1",
)


def test_two_client_processes_send_every_request_and_time_the_run_from_their_common_start(
    tiny_keyed_server, tmp_path
):
    began = time.perf_counter()
    doc = run_bench_serving(
        tiny_keyed_server.base_url,
        tmp_path / "split.json",
        *TINY_ARGS,
        "--client-processes",
        "2",
        "--endpoint",
        "generate",
        "--workload",
        "plain",
        "multi_turn",
        "--num-prompts",
        "8",
        "--random-input-len",
        "6",
        "--random-output-len",
        "4",
        "--turns",
        "2",
        "--user-len",
        "3",
        "--request-rate",
        "40",
        "--max-concurrency",
        "4",
        "--json-requests",
    )
    wall = time.perf_counter() - began
    assert doc["config"]["client_processes"] == 2
    plain, turns = doc["summary"]
    for row in (plain, turns):
        assert row["client_processes"] == 2 and row["model"] == "tiny" and row["failed"] == 0
        # a run starts START_DELAY_S after its shares are sent: a wait that is not its time
        assert 0 < row["duration_s"] <= wall - bench.START_DELAY_S
    assert plain["completed"] == 8 and plain["total_input_tokens"] == 8 * 6
    assert plain["total_output_tokens"] == 8 * 4  # ignore_eos: every request its asked length
    assert turns["completed"] == 2 * 8 and turns["total_output_tokens"] == 2 * 8 * 4
    # merged turn by turn: a conversation's second prompt, its first, the answer and a message
    lens = [r["input_len"] for r in doc["requests"] if r["workload"] == "multi_turn"]
    assert lens == [3] * 8 + [3 + 4 + 3] * 8


def test_a_failing_request_is_a_failed_result_with_its_message_under_two_client_processes(
    tiny_keyed_server, tmp_path
):
    doc = run_bench_serving(
        tiny_keyed_server.base_url,
        tmp_path / "unserved.json",
        *TINY_ARGS,
        "--model",
        "unserved",
        "--client-processes",
        "2",
        "--num-prompts",
        "3",
        "--random-input-len",
        "4",
        "--random-output-len",
        "2",
        "--json-requests",
    )
    (row,) = doc["summary"]
    assert row["completed"] == 0 and row["failed"] == 3 and row["duration_s"] > 0
    errors = [r["error"] for r in doc["requests"]]
    assert len(errors) == 3
    assert all(e.startswith("HTTP 404: ") and "unserved" in e for e in errors)
