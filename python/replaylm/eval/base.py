"""What every eval provides to the runner: examples, how to prompt for one, how to read a reply."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Literal, Protocol

Endpoint = Literal["completions", "chat/completions"]
Prompt = str | list[dict[str, str]]  # a completion prompt, or chat messages


@dataclass(frozen=True)
class Example:
    """One question and its reference answer."""

    question: str
    reference: Decimal


class Eval(Protocol):
    """An eval loaded with its examples. `prompt` and `parse` are pure functions."""

    endpoint: Endpoint  # "completions" takes `prompt` as text, "chat/completions" as messages
    stop: list[str]  # stop strings sent with every request (may be empty)
    examples: list[Example]

    @property
    def name(self) -> str: ...

    @property
    def num_shots(self) -> int:
        """Solved examples shown before each question."""
        ...

    def prompt(self, example: Example) -> Prompt:
        """The prompt (or chat messages) that asks `example.question`."""
        ...

    def parse(self, completion: str) -> Decimal | None:
        """The answer in a completion, or None when it holds none (an invalid answer)."""
        ...
