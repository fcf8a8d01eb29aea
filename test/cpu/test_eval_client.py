"""The eval CLI end to end against a scripted OpenAI-compatible fake (no model): requests sent,
failures recorded per question, metrics and dump consistent, clear errors."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replaylm.eval.run_eval import main

# question -> (status, completion text); a question missing here gets HTTP 500
REPLIES = {
    "q-right": (200, " 2 + 2 = <<2+2=4>>4\n#### 4"),
    "q-wrong": (200, " so 7 apples.\n#### 7"),
    "q-no-number": (200, " I cannot say."),
    "q-rejected": (400, "the prompt is too long"),
}
REFERENCES = {"q-right": 4, "q-wrong": 8, "q-no-number": 1, "q-rejected": 2, "q-crash": 3}


class FakeOpenAI(http.server.BaseHTTPRequestHandler):
    """GET /v1/models lists two models; POST /v1/completions and /v1/chat/completions answer
    the question at the end of the prompt from REPLIES."""

    requests: list[tuple[str, dict[str, Any], str | None]] = []  # (path, body, authorization)

    def log_message(self, *_: object) -> None:
        pass

    def _send(self, status: int, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "fake-a"}, {"id": "fake-b"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append((self.path, body, self.headers.get("Authorization")))
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        question = prompt.removesuffix("\nAnswer:").split()[-1]
        status, text = REPLIES.get(question, (500, "internal error"))
        if status != 200:
            self._send(status, {"error": {"message": text, "type": "BadRequestError"}})
            return
        choice = {"index": 0, "finish_reason": "stop"}
        choice.update(
            {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        )
        self._send(200, {"choices": [choice], "usage": {"completion_tokens": len(text.split())}})


@pytest.fixture
def fake_server() -> Iterator[str]:
    FakeOpenAI.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _write_data(folder: Path) -> Path:
    lines = [{"question": q, "answer": f"so\n#### {a}"} for q, a in REFERENCES.items()]
    train = [{"question": "shot?", "answer": "1 + 1 = 2\n#### 2"}]
    (folder / "test.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / "train.jsonl").write_text(json.dumps(train[0]) + "\n")
    return folder / "test.jsonl"


def test_gsm8k_run_records_every_question(fake_server, tmp_path, capsys):
    dump, metrics = tmp_path / "dump.jsonl", tmp_path / "metrics.json"
    rc = main(
        [
            "--base-url",
            fake_server,
            "--data-path",
            str(_write_data(tmp_path)),
            "--num-shots",
            "1",
            "--max-tokens",
            "64",
            "--parallel",
            "2",
            "--api-key",
            "k",
            "--dump",
            str(dump),
            "--json",
            str(metrics),
            "--no-progress",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert "accuracy    0.200 (1/5; 95% CI 0.036-0.624)" in out and "fake-a" in out
    assert "2 of 5 requests failed" in err and "Traceback" not in err

    assert len(FakeOpenAI.requests) == 5
    path, body, auth = FakeOpenAI.requests[0]
    assert path == "/v1/completions" and auth == "Bearer k"
    assert body["model"] == "fake-a" and body["max_tokens"] == 64  # the first listed model
    assert body["temperature"] == 0 and body["stop"] == ["Question:"]
    assert body["prompt"].startswith("Question: shot?\nAnswer: 1 + 1 = 2\n#### 2\n\nQuestion: ")

    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert [r["question"] for r in records] == list(REFERENCES)  # question order, not finish order
    by_q = {r["question"]: r for r in records}
    assert by_q["q-right"]["verdict"] == "correct" and by_q["q-right"]["parsed"] == "4"
    assert by_q["q-wrong"]["verdict"] == "incorrect" and by_q["q-wrong"]["reference"] == "8"
    assert by_q["q-no-number"]["verdict"] == "invalid" and by_q["q-no-number"]["error"] is None
    assert by_q["q-rejected"]["error"] == "HTTP 400: the prompt is too long"
    assert by_q["q-crash"]["error"].startswith("HTTP 500") and by_q["q-crash"]["parsed"] is None
    assert by_q["q-right"]["prompt"].endswith("\n\nQuestion: q-right\nAnswer:")

    doc = json.loads(metrics.read_text())
    m = doc["metrics"]
    assert m["correct"] == sum(r["verdict"] == "correct" for r in records) == 1
    assert m["invalid"] == 3 and m["errors"] == 2 and m["invalid_rate"] == pytest.approx(0.6)
    assert m["output_tokens"] == sum(r["completion_tokens"] for r in records) > 0
    assert doc["config"]["num_shots"] == 1 and doc["config"]["model"] == "fake-a"


def test_mgsm_uses_chat_and_the_given_model(fake_server, tmp_path, capsys):
    tsv = tmp_path / "mgsm_de.tsv"
    tsv.write_text("Wie viele? q-right\t4\nUnd jetzt? q-wrong\t1.000\n", encoding="utf-8")
    # the fake's replies have no "Antwort:" line, so the answer is the last number
    rc = main(
        [
            "--base-url",
            fake_server,
            "--eval-name",
            "mgsm_de",
            "--data-path",
            str(tsv),
            "--model",
            "fake-b",
            "--no-progress",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "mgsm_de" in out and "accuracy    0.500 (1/2;" in out
    path, body, auth = FakeOpenAI.requests[0]
    assert path == "/v1/chat/completions" and auth is None
    assert body["model"] == "fake-b" and "stop" not in body
    assert body["messages"][0]["content"].startswith("Löse diese Matheaufgabe.")


def test_clear_errors_not_tracebacks(tmp_path, capsys):
    with socket.socket() as bound:  # bound, not listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/v1"
        assert main(["--base-url", url, "--num-examples", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach the server at {url}/models: ConnectError")

    assert main(["--data-path", str(tmp_path / "missing.jsonl")]) == 1
    assert "missing.jsonl': no such file" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_:
        main(["--eval-name", "mgsm_xx"])
    assert exit_.value.code == 2
    assert "invalid choice: 'mgsm_xx'" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        main(["--dump", str(tmp_path / "no" / "dir.jsonl")])
    assert "its folder does not exist" in capsys.readouterr().err
