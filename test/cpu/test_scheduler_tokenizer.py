"""The tokenizer's share that the scheduler process gets from the tokenizer manager, and the
start-up order it allows (the HTTP process starts the child before importing torch)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_loader.tokenizer import (
    decodes_as_backend,
    load_tokenizer,
    scheduler_decoder,
    token_decoder,
    tokenizer_info,
)
from replaylm.runtime.detokenizer import IncrementalDetokenizer
from replaylm.runtime.tokenizer_manager import TokenizerManager
from replaylm.server_args import ServerArgs

from tiny_checkpoints import write_tiny_checkpoint

TEXT = "Hello world , héllo wörld ! 日本語 🎉 done ."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


def test_a_fast_tokenizer_travels_as_json_and_decodes_the_same(tokenizer, tmp_path):
    info = pickle.loads(pickle.dumps(tokenizer_info(tokenizer)))  # as it crosses the pipe
    assert info.has_tokenizer and info.fast_json is not None
    assert info.eos_token_id == tokenizer.eos_token_id
    decode = scheduler_decoder(info, str(tmp_path / "never-read"))  # the path is not loaded
    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    cases = [tokenizer.encode(TEXT), [special[0], *tokenizer.encode(TEXT), special[-1]]]
    cases += [
        [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 24))]
        for _ in range(300)
    ]
    for ids in cases:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def _wordpiece_tokenizer_that_cleans_up_spaces(folder: Path) -> Any:
    """A real WordPiece tokenizer whose decoder leaves " ." alone for transformers' clean-up of
    tokenization spaces to fix (transformers skips that clean-up for BPE tokenizers)."""
    words = ["[UNK]", "[SEP]", "it", "is", "done", ".", "?", "!", ","]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)
    PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        eos_token="[SEP]",
        clean_up_tokenization_spaces=True,
    ).save_pretrained(folder)
    return load_tokenizer(str(folder))


def test_a_tokenizer_that_cleans_up_spaces_is_loaded_by_the_scheduler(tmp_path):
    cleaning = _wordpiece_tokenizer_that_cleans_up_spaces(tmp_path)
    ids = cleaning.encode("it is done. is it? done!", add_special_tokens=False)
    cleaned = cleaning.decode(ids, skip_special_tokens=True)
    assert cleaning.backend_tokenizer.decode(ids) != cleaned  # the JSON would decode otherwise
    info = tokenizer_info(cleaning)
    assert info.has_tokenizer and info.fast_json is None
    assert info.eos_token_id == cleaning.eos_token_id
    assert scheduler_decoder(info, str(tmp_path))(ids) == cleaned == "it is done. is it? done!"


def test_a_tokenizer_that_cleans_up_spaces_streams_through_transformers(tmp_path):
    """The streaming detokenizer takes the backend's decode only where it equals
    transformers'; here it does not, and the streamed text is the cleaned one."""
    cleaning = _wordpiece_tokenizer_that_cleans_up_spaces(tmp_path)
    ids = cleaning.encode("it is done. is it? done!", add_special_tokens=False)

    def streamed(backend: bool) -> str:
        detok = IncrementalDetokenizer(token_decoder(cleaning, backend=backend), [])
        for token in ids:
            detok.add([token])
        return detok.final_text(None)

    assert streamed(decodes_as_backend(cleaning)) == "it is done. is it? done!"
    assert streamed(True) != "it is done. is it? done!"  # the backend alone would not clean up


def test_no_tokenizer_means_no_decoder(tmp_path):
    info = tokenizer_info(None)
    assert not info.has_tokenizer and info.eos_token_id is None
    assert scheduler_decoder(info, str(tmp_path)) is None


def test_the_http_process_starts_the_child_before_importing_torch_or_transformers():
    code = (
        "import sys, replaylm.launch_server, replaylm.runtime.scheduler_process; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_a_tokenizer_that_fails_to_load_stops_the_child(tmp_path):
    write_tiny_checkpoint("qwen2", tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    args = ServerArgs(
        model_path=str(tmp_path),
        tokenizer_path=str(bad),
        device="cpu",
        max_total_tokens=256,
        max_running_requests=4,
    )
    with pytest.raises(ValueError, match="is not a GGUF file"):
        TokenizerManager(resolve_engine_config(args))
    assert mp.active_children() == []
