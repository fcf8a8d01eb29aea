"""An EAGLE head beside its target: the checks at start, the target's feature store and what
the head shares of the target."""

from __future__ import annotations

import logging

import torch

from replaylm.layers.feature_capture import FeatureStore
from replaylm.models.eagle import EAGLE_HEADS, EagleHead
from replaylm.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def check_draft(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, algorithm: str, path: str
) -> None:
    """ValueError (one line, naming the flag) when `draft` cannot draft for `target` under
    `--speculative-algorithm algorithm`: another vocabulary, an EAGLE head given as a draft
    model or the wrong kind of head, a head of another hidden size or reading target layers
    the target lacks."""
    flag = f"--speculative-draft-model-path {path}"
    ours, theirs = target.config.vocab_size, draft.config.vocab_size
    if ours != theirs:
        raise ValueError(
            f"{flag} has a vocabulary of {theirs} tokens, the target {ours}: a draft model "
            "must share the target's vocabulary"
        )
    head = EAGLE_HEADS.get(algorithm)
    arch = draft.config.architecture
    if head is None:
        if isinstance(draft, EagleHead):
            raise ValueError(
                f"{flag} is an EAGLE head ({arch}): use --speculative-algorithm {draft.algorithm}"
            )
        return
    if not isinstance(draft, head):
        raise ValueError(
            f"{flag} is a {arch}; --speculative-algorithm {algorithm} takes a "
            f"{head.architecture} head"
        )
    layers = draft.target_feature_layers(target.config.num_hidden_layers)
    needed = draft.feature_width // (len(layers) if layers else 1)
    if needed != target.config.hidden_size:
        raise ValueError(
            f"{flag} reads hidden states of {needed} values, the target's have "
            f"{target.config.hidden_size}"
        )
    count = target.config.num_hidden_layers
    if layers and (len(set(layers)) != len(layers) or not all(0 <= i < count for i in layers)):
        raise ValueError(
            f"{flag} reads the inputs of target layers {layers}; the target has {count} "
            "(each read once)"
        )


def feature_bytes_per_token(head: EagleHead, dtype: torch.dtype) -> int:
    """What the target's feature store holds per KV slot for `head`."""
    return head.feature_width * dtype.itemsize


def attach_head(
    head: EagleHead, target: LlamaForCausalLM, slots: int, rows: int, device: torch.device
) -> FeatureStore:
    """The target's feature store of `slots` rows (its KV cache's, the padding slot included),
    tapped by the target's forward, and the head's share of the target (its feature buffer of
    `rows` tokens). Before either captures a CUDA graph: graphs keep these addresses."""
    layers = head.target_feature_layers(target.config.num_hidden_layers)
    hidden = target.config.hidden_size
    dtype = target.lm_head_weight.dtype
    store = FeatureStore(len(layers) if layers else 1, slots, hidden, dtype, device)
    target.model.tap_features(store, layers)
    head.attach_target(target, rows)
    logger.info(
        "%s head: reads the target's %s (%.2f GiB kept by KV slot)",
        head.algorithm,
        "final-norm hidden states"
        if layers is None
        else f"residual stream entering layers {layers}",
        store.data.numel() * store.data.element_size() / 2**30,
    )
    return store
