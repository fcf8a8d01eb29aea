"""Eval client pieces without a server: answer extraction, prompts, the Wilson interval, data."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from decimal import Decimal
from functools import partial
from pathlib import Path

import pytest

from replaylm.eval.answers import find_numbers, last_number, parse_reference
from replaylm.eval.base import Example
from replaylm.eval.data import DataError, default_data_dir
from replaylm.eval.gsm8k import Gsm8k
from replaylm.eval.metrics import wilson_interval
from replaylm.eval.mgsm import LANGUAGES, Mgsm
from replaylm.eval.registry import EVAL_NAMES, load_eval

D = Decimal


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" 48 / 2 = <<48/2=24>>24 clips.\n48 + 24 = 72 clips.\n#### 72\n\n", D(72)),
        ("She pays $1,234.50 in total.", D("1234.50")),
        ("The temperature drops to -7 degrees.", D(-7)),
        ("He lost -$15 overall", D(-15)),
        ("10 - 3 = 7", D(7)),  # a minus between numbers is an operator
        ("so 0.125 of the pie", D("0.125")),
        ("#### 1,450,000", D(1450000)),
        ("the items were 1,2,3", D(3)),  # not a thousands grouping
        ("full-width １８ works", D(18)),
        ("no digits here", None),
    ],
)
def test_gsm8k_answer_is_the_last_number(text, expected):
    assert Gsm8k([], []).parse(text) == expected
    assert last_number(text) == expected


def test_decimal_comma_numbers():
    assert find_numbers("70.000 und 70 000 und 70,000", decimal_comma=True) == [D(70000)] * 3
    assert find_numbers("2,5 oder 2.5 oder 1.234,5", decimal_comma=True) == [
        D("2.5"),
        D("2.5"),
        D("1234.5"),
    ]
    assert find_numbers("0,125", decimal_comma=True) == [D("0.125")]


def test_reference_numbers():
    assert parse_reference(" 2,125 ") == D(2125)
    assert parse_reference("-3") == D(-3)
    with pytest.raises(ValueError):
        parse_reference("twelve")


def _mgsm(lang: str) -> Mgsm:
    return Mgsm([], lang)


@pytest.mark.parametrize(
    ("lang", "completion", "expected"),
    [
        ("en", "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\nAnswer: 18", D(18)),
        ("en", "9 * 2 = 18\n**Answer:** $18\n\nHope this helps, 2 of us", D(18)),
        ("en", "Working: 3 + 4 = 7\nanswer:\n\n 7", D(7)),  # any case, number on the next line
        ("en", "Answer: 5 first\n...more thinking\nAnswer: 6", D(6)),  # the last answer line wins
        ("en", "It makes 9 * 2 = 18 dollars", D(18)),  # no answer line: the last number
        ("es", "Total: 1.000 + 250\nRespuesta: 1.250", D(1250)),
        ("fr", "Réponse : 70 000", D(70000)),
        ("de", "Also 70.000 - 3 = 69.997\nAntwort: 69.997", D(69997)),
        ("de", "ANTWORT: 2,5", D("2.5")),
        ("ru", "Ответ: 12", D(12)),
        ("zh", "16-3-4=9，9×2=18\n答案：１８", D(18)),
        ("ja", "卵は9個なので18ドル。\n答え：18ドル", D(18)),
        ("th", "ดังนั้น\nคำตอบ: 18", D(18)),
        ("sw", "Jibu: 1,250", D(1250)),
        ("bn", "উত্তর: ১৮", D(18)),
        ("te", "సమాధానం: 18", D(18)),
        ("en", "Answer: none", None),
    ],
)
def test_mgsm_answer_follows_the_language_prefix(lang, completion, expected):
    assert _mgsm(lang).parse(completion) == expected


def test_every_language_asks_for_its_own_answer_prefix():
    assert set(LANGUAGES) == {"en", "es", "fr", "de", "ru", "zh", "ja", "th", "sw", "bn", "te"}
    assert [*EVAL_NAMES] == ["gsm8k", *(f"mgsm_{lang}" for lang in LANGUAGES)]
    for lang, spec in LANGUAGES.items():
        assert f"{spec.answer_prefix}:" in spec.instruction, lang
        assert _mgsm(lang).parse(f"a\n{spec.answer_prefix}: 42") == D(42)
    messages = _mgsm("de").prompt(Example("Wie viel ist 2+2?", D(4)))
    assert messages == [
        {"role": "user", "content": LANGUAGES["de"].instruction + "\n\nWie viel ist 2+2?"}
    ]


def _write_gsm8k(folder: Path, n_test: int = 3, n_train: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("test", n_test), ("train", n_train)):
        rows = [
            {"question": f"{name} q{i}?", "answer": f"{name} step {i}.\n#### {i + 1},000"}
            for i in range(n)
        ]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "test.jsonl"


def test_gsm8k_prompt_has_the_shots_then_the_question(tmp_path):
    ev = Gsm8k.load(str(_write_gsm8k(tmp_path)), num_shots=2, seed=0)
    assert ev.examples[1] == Example("test q1?", D(2000))
    assert ev.num_shots == 2 and ev.stop == ["Question:"] and ev.endpoint == "completions"
    a, b = ev.shots
    assert ev.prompt(ev.examples[1]) == (
        f"Question: {a.question}\nAnswer: {a.solution}\n\n"
        f"Question: {b.question}\nAnswer: {b.solution}\n\n"
        "Question: test q1?\nAnswer:"
    )
    assert a.solution.endswith(",000") and a.question.startswith("train q")


def test_gsm8k_shots_follow_the_seed(tmp_path):
    path = str(_write_gsm8k(tmp_path))
    seed0 = Gsm8k.load(path, 3, 0).shots
    assert seed0 == Gsm8k.load(path, 3, 0).shots != Gsm8k.load(path, 3, 1).shots
    assert Gsm8k.load(path, None, 0).num_shots == 5
    zero = Gsm8k.load(path, 0, 0)
    assert zero.prompt(zero.examples[0]) == "Question: test q0?\nAnswer:"


def test_wilson_interval():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    for n in range(1, 60):  # the interval holds the proportion exactly, 0/n and n/n included
        for s in range(n + 1):
            lo, hi = wilson_interval(s, n)
            assert 0.0 <= lo <= s / n <= hi <= 1.0
    assert wilson_interval(0, 6)[0] == 0.0 and wilson_interval(6, 6)[1] == 1.0
    lo, hi = wilson_interval(150, 200)
    assert lo < 0.75 < hi and hi - lo < wilson_interval(15, 20)[1] - wilson_interval(15, 20)[0]
    for bad in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)


@pytest.fixture
def file_server(tmp_path) -> Iterator[tuple[str, Path]]:
    """(base URL, folder): a local http.server serving `folder` on a loopback port."""
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *_: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path
    server.shutdown()
    server.server_close()


def test_data_from_a_file_url_and_an_http_url(tmp_path, file_server):
    local = Gsm8k.load(str(_write_gsm8k(tmp_path / "g")), 2, seed=3)
    from_file_url = Gsm8k.load((tmp_path / "g" / "test.jsonl").as_uri(), 2, seed=3)
    base, _ = file_server
    from_http = Gsm8k.load(f"{base}/g/test.jsonl", 2, seed=3)
    assert local == from_file_url == from_http and len(local.examples) == 3
    (tmp_path / "mgsm_fr.tsv").write_text("Combien ?\t1,250\n\nEt ça ?\t7\n", encoding="utf-8")
    mgsm = Mgsm.load("fr", f"{base}/mgsm_fr.tsv")
    assert mgsm.examples == [Example("Combien ?", D(1250)), Example("Et ça ?", D(7))]
    with pytest.raises(DataError, match="HTTP 404"):
        Mgsm.load("fr", f"{base}/missing.tsv")


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        Gsm8k.load(str(tmp_path / "nope.jsonl"), 0, 0)
    test = _write_gsm8k(tmp_path)
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(DataError, match="train.jsonl.*no such file"):
        Gsm8k.load(str(test), 1, 0)
    assert Gsm8k.load(str(test), 0, 0).examples  # zero-shot needs no train file
    test.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(DataError, match="####"):
        Gsm8k.load(str(test), 0, 0)
    test.write_text("not json\n")
    with pytest.raises(DataError, match="line 1: not JSON"):
        Gsm8k.load(str(test), 0, 0)
    tsv = tmp_path / "m.tsv"
    tsv.write_text("q\t1\nq without answer\n")
    with pytest.raises(DataError, match="line 2: expected 2 tab-separated fields"):
        Mgsm.load("en", str(tsv))
    tsv.write_text("q\tmany\n")
    with pytest.raises(DataError, match="row 1"):
        Mgsm.load("en", str(tsv))


def test_registry():
    with pytest.raises(ValueError, match="unknown eval 'mgsm_xx'; valid: gsm8k, mgsm_en"):
        load_eval("mgsm_xx", None, None, 0)
    with pytest.raises(ValueError, match="zero-shot"):
        load_eval("mgsm_en", None, 3, 0)


def test_a_data_path_replaces_the_shipped_data(tmp_path):
    test_file = str(_write_gsm8k(tmp_path))
    assert len(load_eval("gsm8k", test_file, 2, 0).examples) == 3
    with pytest.raises(DataError, match="no such file"):
        load_eval("gsm8k", str(tmp_path / "nowhere.jsonl"), None, 0)


def test_shipped_data_is_the_default():
    """The copies shipped in the package load as-is: every reference parses, every language is
    there, and each dataset carries its licence."""
    gsm8k = load_eval("gsm8k", None, None, 0)
    assert len(gsm8k.examples) == 1319 and gsm8k.examples[0].reference == 18
    assert len(gsm8k.shots) == 5
    for lang in LANGUAGES:
        mgsm = load_eval(f"mgsm_{lang}", None, None, 0)
        assert len(mgsm.examples) == 250 and mgsm.examples[0].reference == 18, lang
    root = default_data_dir()
    assert "MIT License" in (root / "gsm8k" / "LICENSE").read_text()
    assert "Attribution 4.0" in (root / "mgsm" / "LICENSE").read_text()


def test_the_wheel_carries_the_data(tmp_path):
    """A `pip install` user gets the data and licences too: they are package data."""
    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(root)],
        check=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("replaylm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        str(p.relative_to(default_data_dir().parents[2]))
        for p in default_data_dir().rglob("*")
        if p.is_file()
    }
    assert {
        "replaylm/eval/datasets/gsm8k/LICENSE",
        "replaylm/eval/datasets/mgsm/LICENSE",
    } <= shipped
    assert shipped <= names
