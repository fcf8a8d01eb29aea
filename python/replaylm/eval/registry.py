"""Eval names and loading an eval by name."""

from __future__ import annotations

from replaylm.eval.base import Eval
from replaylm.eval.gsm8k import Gsm8k
from replaylm.eval.mgsm import LANGUAGES, Mgsm

EVAL_NAMES = ["gsm8k", *(f"mgsm_{lang}" for lang in LANGUAGES)]


def load_eval(name: str, data_path: str | None, num_shots: int | None, seed: int) -> Eval:
    """The eval `name` with its data loaded. ValueError for an unknown name or shots asked of a
    zero-shot eval; DataError (from data.py) for data that cannot be read."""
    if name == "gsm8k":
        return Gsm8k.load(data_path, num_shots, seed)
    language = name.removeprefix("mgsm_")
    if name.startswith("mgsm_") and language in LANGUAGES:
        if num_shots:
            raise ValueError(f"{name} is zero-shot; --num-shots is not supported")
        return Mgsm.load(language, data_path)
    raise ValueError(f"unknown eval {name!r}; valid: {', '.join(EVAL_NAMES)}")
