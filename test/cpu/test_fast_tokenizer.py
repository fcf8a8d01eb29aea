"""The tokenizers-only tokenizer (`model_loader/fast_tokenizer.py`) against transformers' own,
loaded from the same saved folder: the built-in SmolLM2 GGUF's cached tokenizer and tiny
tokenizers built here. Encoding, decoding, special tokens, chat templates (tools, generation
prompt, continued messages, errors) and the grammar engine's vocabulary must all be the same;
and a fresh process serves the cached tokenizer without importing torch, transformers or
xgrammar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, TokenizersBackend

from replaylm.model_executor.engine_config import resolve_engine_config
from replaylm.model_loader.builtin_models import resolve_model_path
from replaylm.model_loader.fast_tokenizer import (
    FastTokenizer,
    UnsupportedTokenizer,
    read_fast_tokenizer,
)
from replaylm.model_loader.gguf_tokenizer import CACHE_ENV, load_gguf_tokenizer
from replaylm.model_loader.tokenizer import chat_input_ids, tokenizer_class_name
from replaylm.runtime.errors import RequestError
from replaylm.runtime.tokenizer_manager import TokenizerManager
from replaylm.server_args import ServerArgs
from replaylm.structured.vocabulary import describe_vocabulary

from tiny_checkpoints import write_tiny_checkpoint
from tool_schemas import SCHEMAS

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"
TEXTS = [
    "The capital of France is",
    "  spaces\tand\nlines ",
    "naïve café 東京 🙂",
    "it is done . is it ? yes ! don't I 'm",
    "<|im_end|>x<|im_start|>",
    "<s>a</s> <pad>",
    "",
]
TOOLS = [
    {"type": "function", "function": {"name": name, "description": "d", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [{"role": "user", "content": "Start with yes"}, {"role": "assistant", "content": "Yes, "}],
]
# ChatML-like, using what transformers' environment gives a template: special-token variables,
# namespace, loop controls, the generation tag, tojson, raise_exception
TINY_TEMPLATE = """{%- set ns = namespace(system=none) -%}
{{ bos_token }}
{%- for message in messages -%}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}
{{ raise_exception('unknown role ' + message['role']) }}
{%- endif -%}
{%- if message['role'] == 'system' -%}
{% set ns.system = message['content'] %}{% continue %}
{%- endif %}
<|{{ message['role'] }}|>
{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}
{%- else %}{{ message['content'] }}{% endif %}{{ eos_token }}
{% endfor -%}
{%- if tools %}<|tools|>{{ tools | tojson }}{% endif -%}
{%- if ns.system %}<|system|>{{ ns.system }}{% endif -%}

  {% if add_generation_prompt %}
<|assistant|>
  {% endif %}"""


# ---- the tokenizers compared -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SmolLM2 GGUF's tokenizer as the cache keeps it (built here by transformers)."""
    cache = tmp_path_factory.mktemp("cache")
    os.environ[CACHE_ENV] = str(cache)
    try:
        load_gguf_tokenizer(resolve_model_path("smollm2-135m-instruct"))
    finally:
        del os.environ[CACHE_ENV]
    (entry,) = (cache / "tokenizers").iterdir()
    return entry


def _bpe(special: list[str]) -> Tokenizer:
    """A real byte-level BPE, trained on the texts here."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(TEXTS * 20, trainer)
    return backend


def _wordpiece() -> Tokenizer:
    words = ["[UNK]", "[CLS]", "[SEP]", "it", "is", "done", ".", "?", "!", ",", "yes", "a", "b"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=False)
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)],
    )
    return backend


def _tiny(kind: str, folder: Path) -> Path:
    """A tiny tokenizer saved by transformers: `bos` (a BPE whose post-processor adds BOS),
    `plain` (a BPE adding nothing, cleaning up spaces, which transformers 5 skips for BPE),
    `add_bos` (a BPE with add_bos_token and add_eos_token set), `wordpiece` (adds CLS/SEP,
    cleans up spaces)."""
    options: dict[str, Any] = {"chat_template": TINY_TEMPLATE}
    if kind == "wordpiece":
        backend = _wordpiece()
        options |= {"unk_token": "[UNK]", "bos_token": "[CLS]", "eos_token": "[SEP]"}
        options["clean_up_tokenization_spaces"] = True
    else:
        backend = _bpe(["<s>", "</s>", "<pad>"])
        options |= {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
        if kind == "bos":
            backend.post_processor = processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
            )
        elif kind == "plain":
            options["clean_up_tokenization_spaces"] = True
        else:
            options |= {"add_bos_token": True, "add_eos_token": True}
    PreTrainedTokenizerFast(tokenizer_object=backend, **options).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["smollm2", "bos", "plain", "add_bos", "wordpiece"])
def pair(request, smollm2_folder, tmp_path_factory) -> tuple[FastTokenizer, Any]:
    """(ours, transformers') loaded from one folder, as the tokenizer cache loads it."""
    if request.param == "smollm2":
        folder = smollm2_folder
    else:
        folder = _tiny(request.param, tmp_path_factory.mktemp(request.param))
    class_name = json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]
    theirs = TokenizersBackend.from_pretrained(folder)
    assert type(theirs).__name__ == class_name
    return read_fast_tokenizer(folder, class_name), theirs


# ---- the same results --------------------------------------------------------------------------


def test_encodes_and_decodes_as_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        for special in (True, False):
            ids = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids, (text, special)
            assert ours.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip
                ), (text, skip)
            assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    every_id = list(range(len(theirs)))
    assert ours.decode(every_id) == theirs.decode(every_id)


def test_special_tokens_and_sizes_as_transformers(pair):
    ours, theirs = pair
    for name in ("bos", "eos", "pad"):
        assert getattr(ours, f"{name}_token") == getattr(theirs, f"{name}_token"), name
        assert getattr(ours, f"{name}_token_id") == getattr(theirs, f"{name}_token_id"), name
    assert sorted(ours.all_special_ids) == sorted(theirs.all_special_ids)
    assert (ours.vocab_size, len(ours)) == (theirs.vocab_size, len(theirs))
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.chat_template == theirs.chat_template
    assert tokenizer_class_name(ours) == tokenizer_class_name(theirs)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_templates_render_as_transformers(pair, chat, generation_prompt):
    ours, theirs = pair
    for tools in (None, TOOLS):
        options = {"add_generation_prompt": generation_prompt, "tools": tools}
        assert chat_input_ids(ours, chat, **options) == chat_input_ids(theirs, chat, **options)
        text = ours.apply_chat_template(chat, tokenize=False, **options)
        assert text == theirs.apply_chat_template(chat, tokenize=False, **options)
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert chat_input_ids(ours, chat, **continued) == chat_input_ids(theirs, chat, **continued)
    kwargs = {"template_kwargs": {"enable_thinking": False, "bos_token": "<override>"}}
    assert chat_input_ids(ours, chat, **kwargs) == chat_input_ids(theirs, chat, **kwargs)


@pytest.mark.parametrize("template", ["qwen_tool_call.jinja", "llama3_json.jinja"])
def test_tool_templates_render_as_transformers(pair, template):
    ours, theirs = pair
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    chat = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": "18 C"},
    ]
    ours.chat_template = theirs.chat_template = (TEMPLATES / template).read_text()
    try:
        assert ours.apply_chat_template(
            chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
        ) == theirs.apply_chat_template(
            chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
    finally:
        ours.chat_template = theirs.chat_template = TINY_TEMPLATE


def test_misuse_fails_as_in_transformers(pair):
    ours, theirs = pair
    for chat, options in (
        ([], {}),
        (CHATS[0], {"continue_final_message": True, "add_generation_prompt": True}),
    ):
        with pytest.raises(ValueError):
            theirs.apply_chat_template(chat, tokenize=False, **options)
        with pytest.raises(ValueError):
            ours.apply_chat_template(chat, tokenize=False, **options)


def test_the_grammar_vocabulary_is_xgrammars_description_of_transformers(pair):
    ours, theirs = pair
    expected = xgr.TokenizerInfo.from_huggingface(theirs).serialize_json()
    assert describe_vocabulary(ours) == expected


# ---- what it refuses --------------------------------------------------------------------------


def test_folders_that_need_transformers_are_refused(tmp_path):
    folder = _tiny("bos", tmp_path / "bos")
    with pytest.raises(UnsupportedTokenizer, match="LlamaTokenizer may build"):
        read_fast_tokenizer(folder, "LlamaTokenizer")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for change, why in (
        ({"add_bos_token": False}, "post-processor differs"),
        ({"extra_special_tokens": ["<x>"]}, "extra special tokens"),
        ({"split_special_tokens": True}, "splits special tokens"),
        ({"unk_token": "<unk>"}, "not an added token"),
        ({"chat_template": [{"name": "default", "template": "x"}]}, "named chat templates"),
    ):
        config_path.write_text(json.dumps({**config, **change}))
        if "chat_template" in change:
            (folder / "chat_template.jinja").unlink()
        with pytest.raises(UnsupportedTokenizer, match=why):
            read_fast_tokenizer(folder, "TokenizersBackend")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(UnsupportedTokenizer, match="no tokenizer.json"):
        read_fast_tokenizer(folder, "TokenizersBackend")


# ---- at the manager and in a fresh process ---------------------------------------------------


def test_a_template_that_raises_is_a_request_error_at_the_manager(tmp_path):
    """Both tokenizers' template errors reach the client as a 400 on `messages`."""
    write_tiny_checkpoint("qwen2", tmp_path)
    folder = _tiny("bos", tmp_path / "tokenizer")
    ours = read_fast_tokenizer(folder, "TokenizersBackend")
    theirs = TokenizersBackend.from_pretrained(folder)
    args = ServerArgs(
        model_path=str(tmp_path), device="cpu", max_total_tokens=256, max_running_requests=4
    )
    tm = TokenizerManager(resolve_engine_config(args))
    try:
        errors = []
        for tokenizer in (ours, theirs):
            tm.tokenizer = tokenizer
            with pytest.raises(RequestError) as err:
                tm.encode_chat([{"role": "robot", "content": "hi"}])
            errors.append((err.value.param, str(err.value), type(err.value.__cause__)))
        assert errors[0] == errors[1]
        assert errors[0][0] == "messages" and "unknown role robot" in errors[0][1]
    finally:
        tm.shutdown()


def test_a_warm_start_serves_the_tokenizer_without_torch_transformers_or_xgrammar(
    smollm2_folder,
):
    cache = smollm2_folder.parent.parent
    code = (
        "import sys\n"
        "from replaylm.model_loader.tokenizer import chat_input_ids, load_tokenizer, "
        "tokenizer_info\n"
        "tokenizer = load_tokenizer('smollm2-135m-instruct')\n"
        "info = tokenizer_info(tokenizer)\n"
        "assert info.fast_json is not None and info.eos_token_id == tokenizer.eos_token_id\n"
        "chat_input_ids(tokenizer, [{'role': 'user', 'content': 'hi'}])\n"
        "print(type(tokenizer).__name__, "
        "sorted(m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules))"
    )
    env = {**os.environ, CACHE_ENV: str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    )
    assert out.stdout.strip() == "FastTokenizer []"


def test_the_grammar_compiler_is_made_on_a_thread_before_any_constrained_request(tmp_path):
    """launch_server starts it once it serves; a model without a tokenizer starts none."""
    write_tiny_checkpoint("qwen2", tmp_path)
    args = ServerArgs(
        model_path=str(tmp_path), device="cpu", max_total_tokens=256, max_running_requests=4
    )
    tm = TokenizerManager(resolve_engine_config(args))  # the tiny checkpoint has no tokenizer
    try:
        assert tm.prepare_structured_output() is None
        tm.tokenizer = read_fast_tokenizer(
            _tiny("bos", tmp_path / "tokenizer"), "TokenizersBackend"
        )
        thread = tm.prepare_structured_output()
        assert thread is not None
        thread.join(timeout=120)
        assert tm._grammar is not None and tm._grammar_tried
    finally:
        tm.shutdown()
