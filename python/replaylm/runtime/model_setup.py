"""Loading what generation needs, shared by the offline Engine and the scheduler process."""

from __future__ import annotations

from typing import Any

from replaylm.model_executor.engine_config import EngineConfig
from replaylm.model_executor.model_runner import ModelRunner
from replaylm.model_executor.runner_setup import load_model_runners
from replaylm.model_loader.tokenizer import load_tokenizer
from replaylm.startup_stages import StartupStages


def eos_token_ids(runner: ModelRunner, tokenizer_eos: int | None) -> frozenset[int]:
    """The EOS token ids: the model config's plus the tokenizer's."""
    eos = set(runner.config.eos_token_ids)
    if tokenizer_eos is not None:
        eos.add(tokenizer_eos)
    return frozenset(eos)


def load_runner_and_tokenizer(
    config: EngineConfig, stages: StartupStages
) -> tuple[ModelRunner, ModelRunner | None, Any, frozenset[int]]:
    """The ModelRunner, the draft model's (draft-model speculation; else None), the tokenizer
    (None for a weights-only folder) and the EOS token ids; `stages` marked as they load."""
    args = config.args
    runner, draft = load_model_runners(config, stages)
    tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
    stages.mark("tokenizer")
    tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else None
    return runner, draft, tokenizer, eos_token_ids(runner, tokenizer_eos)
