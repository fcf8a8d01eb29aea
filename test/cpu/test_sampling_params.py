"""SamplingParams: defaults, normalisation, validation messages and from_dict."""

from __future__ import annotations

import pytest

from replaylm.sampling_params import SamplingParams


def test_defaults_are_valid() -> None:
    p = SamplingParams()
    p.validate()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.ignore_eos is False
    assert not p.is_greedy


def test_default_lists_are_not_shared() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


@pytest.mark.parametrize(
    ("stop", "expected"), [("</s>", ["</s>"]), (None, []), (("a", "b"), ["a", "b"]), (["c"], ["c"])]
)
def test_stop_is_normalised_to_a_list(stop: object, expected: list[str]) -> None:
    p = SamplingParams(stop=stop)  # type: ignore[arg-type]
    p.validate()
    assert p.stop == expected


def test_stop_token_ids_tuple_becomes_list() -> None:
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.0, "top_k": 5}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({}, False),
    ],
)
def test_is_greedy(kwargs: dict[str, object], greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 1},
        {"temperature": 0.0},
        {"temperature": 2},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 1},
        {"top_k": 10**6},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop_token_ids": [0, 2]},
        {"ignore_eos": True},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "range_text"),
    [
        ("max_new_tokens", 0, ">= 1"),
        ("max_new_tokens", -3, ">= 1"),
        ("max_new_tokens", 2.5, ">= 1"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", float("inf"), ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", float("nan"), "(0, 1]"),
        ("top_k", 0, ">= 1"),
        ("top_k", -2, ">= 1"),
        ("top_k", 3.0, ">= 1"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("seed", -1, "[0, 2**63 - 1]"),
        ("seed", 2**63, "[0, 2**63 - 1]"),
        ("seed", 1.5, "[0, 2**63 - 1]"),
        ("stop", [1], "list of strings"),
        ("stop", 5, "list of strings"),
        ("stop_token_ids", [1, "2"], "ints >= 0"),
        ("stop_token_ids", [1.0], "ints >= 0"),
        ("stop_token_ids", [True], "ints >= 0"),
        ("stop_token_ids", [-1], "ints >= 0"),
        ("stop_token_ids", 7, "ints >= 0"),
        ("ignore_eos", 1, "bool"),
    ],
)
def test_validation_errors_name_field_and_range(field: str, value: object, range_text: str) -> None:
    p = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError) as err:
        p.validate()
    msg = str(err.value)
    assert msg.startswith(field + " ")
    assert range_text in msg
    assert "\n" not in msg


def test_from_dict_builds_and_validates() -> None:
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": 40, "stop": "END", "seed": 9})
    assert p == SamplingParams(temperature=0.5, top_k=40, stop=["END"], seed=9)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})


def test_from_dict_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter") as err:
        SamplingParams.from_dict({"temperature": 0.5, "max_tokens": 5, "beam_width": 2})
    assert "max_tokens" in str(err.value) and "beam_width" in str(err.value)
    assert "temperature" not in str(err.value)
