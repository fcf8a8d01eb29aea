"""A saved fast tokenizer read with the tokenizers library alone, without transformers.

transformers takes seconds to import (and its version 4 imports torch for a fast tokenizer), while
a folder that `save_pretrained` wrote for a fast tokenizer holds everything replaylm uses:
`tokenizer.json` (the tokenizers-library pipeline, special-token post-processor included),
`tokenizer_config.json` (+ `special_tokens_map.json`, transformers 4) and `chat_template.jinja`.
`FastTokenizer` implements the share of the HF tokenizer interface replaylm calls, with the
results transformers gives: encoding (special tokens from the post-processor, as transformers
encodes), decoding (transformers' clean-up of spaces where its config and version apply it),
special tokens and ids, and `apply_chat_template`, rendered with jinja2 in the environment and
with the variables transformers' `chat_template_utils` uses.

`read_fast_tokenizer` refuses (`UnsupportedTokenizer`, saying why) a folder whose loading by
transformers does more than read these files as they are: a class other than the plain fast
tokenizer (or transformers 4's `LlamaTokenizerFast`, whose one addition, a post-processor built
from `add_bos_token`/`add_eos_token`, is checked against the saved one), special tokens missing
from tokenizer.json's added tokens, extra special tokens (handled differently by transformers 4
and 5), split special tokens, named chat templates. The caller then loads it with transformers.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# the classes whose from_pretrained uses tokenizer.json as saved: the plain fast tokenizer under
# its transformers 5 and 4 names, and transformers 4's Llama one (see `_check_post_processor`)
SUPPORTED_CLASSES = frozenset(
    {"TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast"}
)
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), which chat templates also see
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_PROBE = "a"  # text encoded to see which special tokens the post-processor adds
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the message to continue


class UnsupportedTokenizer(ValueError):
    """The folder's tokenizer needs transformers; the message says why."""


class FastTokenizer:
    """The HF tokenizer interface replaylm uses, over a tokenizers-library `Tokenizer`.
    `class_name`: the transformers class this stands for (what /tokenizer_info reports)."""

    def __init__(
        self,
        backend: Tokenizer,
        class_name: str,
        special_tokens: dict[str, str],
        chat_template: str | None,
        clean_up_tokenization_spaces: bool,
    ) -> None:
        self.backend_tokenizer = backend
        self.class_name = class_name
        self.special_tokens_map = special_tokens
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces

    # ---- special tokens ----------------------------------------------------------------------

    def _token(self, name: str) -> str | None:
        return self.special_tokens_map.get(name)

    def _token_id(self, name: str) -> int | None:
        token = self._token(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._token("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._token("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._token("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self.backend_tokenizer.token_to_id(t) for t in self.special_tokens_map.values())
        return list(dict.fromkeys(i for i in ids if i is not None))

    # ---- vocabulary, encoding, decoding ------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, added tokens aside (as transformers counts it)."""
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self.backend_tokenizer.get_vocab_size(with_added_tokens=True))

    def get_vocab(self) -> dict[str, int]:
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it runs (encode holds it): a large prompt tokenized
        # in a worker thread leaves the event loop free, as transformers' fast tokenizers do
        (encoding,) = self.backend_tokenizer.encode_batch(
            [text], add_special_tokens=add_special_tokens
        )
        return list(encoding.ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(
        self,
        ids: int | list[int],
        skip_special_tokens: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> str:
        """`ids` as text; `spaces_between_special_tokens` is taken and ignored, as by
        transformers' fast tokenizers (it concerns slow ones)."""
        ids = [ids] if isinstance(ids, int) else ids
        text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    # ---- chat template -----------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> str | list[int] | dict[str, list[int]]:
        """`conversation` rendered through the chat template as transformers' `apply_chat_template`
        renders one conversation (the same checks, variables and errors); token ids (without
        the tokenizer's own special tokens) with `tokenize`, in a dict with `return_dict`."""
        text = self._render_chat(
            conversation, tools, add_generation_prompt, continue_final_message, kwargs
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids

    def _render_chat(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any],
    ) -> str:
        if self.chat_template is None:
            raise ValueError(
                "Cannot use chat template functions because tokenizer.chat_template is not set"
            )
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise ValueError("Tools should be JSON schemas.")
        chat = [_without_none(message) for message in conversation]
        # the template sees copies: the tag below never reaches the caller's messages
        chat, tools, kwargs = copy.deepcopy((chat, tools, kwargs))
        chat = [_alias_reasoning(message) for message in chat]
        final = self._tag_final_message(chat) if continue_final_message else None
        rendered = _compiled_template(self.chat_template).render(
            messages=chat,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{"documents": None, **self.special_tokens_map, **kwargs},
        )
        return rendered if final is None else _cut_at_tag(rendered, final)

    def _tag_final_message(self, chat: list[dict[str, Any]]) -> str:
        """Append transformers' tag to the final message's content (its last text part); the
        content as it was."""
        assert self.chat_template is not None  # _render_chat checked it
        content = chat[-1].get("content")
        if content is None:
            raise ValueError('continue_final_message is set but the final message has no "content"')
        if "content" not in self.chat_template:
            raise ValueError('continue_final_message is set to "content", which the template lacks')
        if isinstance(content, str):
            chat[-1]["content"] = content + _CONTINUE_TAG
            return content
        for part in reversed(content):
            if "text" in part:
                text = str(part["text"])
                part["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but the final message has no text")


def _without_none(message: Any) -> dict[str, Any]:
    """transformers drops a message's None values: templates handle a missing key better."""
    if not isinstance(message, dict):
        raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    return {key: value for key, value in message.items() if value is not None}


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by, as transformers passes it."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _cut_at_tag(rendered: str, final: str) -> str:
    """The rendered chat up to the final message's end, left open (transformers' rule)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing spaces


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of tokenization spaces."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    """`source` compiled in transformers' chat-template environment: sandboxed, trimmed blocks,
    loop controls, its `generation` tag, `tojson`, `raise_exception`, `strftime_now`, and its
    hardened `dict` and `namespace`."""
    # imported here: only a chat request needs jinja2
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks the
        assistant's tokens with it, which replaylm does not ask for)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # not jinja's own tojson, which escapes HTML characters
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class TemplateDict:
        """`dict(...)` without the attributes a template could break out through."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that stores no underscore-prefixed attribute (CPython's internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


# ---- reading a folder ------------------------------------------------------------------------


def read_fast_tokenizer(folder: Path, class_name: str) -> FastTokenizer:
    """The tokenizer `save_pretrained` of transformers' `class_name` wrote into `folder`;
    UnsupportedTokenizer when loading it takes more than reading its files (see the module)."""
    if class_name not in SUPPORTED_CLASSES:
        raise UnsupportedTokenizer(f"{class_name} may build its tokenizer its own way")
    if not (folder / "tokenizer.json").is_file():
        raise UnsupportedTokenizer("there is no tokenizer.json")
    if (folder / "additional_chat_templates").is_dir():
        raise UnsupportedTokenizer("it has named chat templates")
    config = _config(folder)
    _check_config(config, class_name)
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # transformers encodes without them unless asked to pad or truncate
    backend.no_truncation()
    backend.no_padding()
    special = _special_tokens(config)
    _check_added_tokens(backend, config, special)
    tokenizer = FastTokenizer(
        backend,
        class_name,
        special,
        _chat_template(folder, config),
        _cleans_up(config, backend),
    )
    _check_post_processor(tokenizer, config, class_name)
    return tokenizer


def _config(folder: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json's tokens over it (as transformers 4
    reads them; transformers 5 writes no such file)."""
    path = folder / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    tokens = folder / "special_tokens_map.json"
    if tokens.is_file():
        config.update(json.loads(tokens.read_text()))
    return config


def _check_config(config: dict[str, Any], class_name: str) -> None:
    if config.get("split_special_tokens"):
        raise UnsupportedTokenizer("it splits special tokens")
    if config.get("additional_special_tokens") or config.get("extra_special_tokens"):
        raise UnsupportedTokenizer("it has extra special tokens")
    if class_name == "LlamaTokenizerFast" and config.get("add_prefix_space") is not None:
        raise UnsupportedTokenizer("LlamaTokenizerFast rebuilds it from the slow tokenizer")


def _token_text(value: Any) -> str | None:
    """A special token as the config writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return {name: token for name, token in tokens.items() if token is not None}


def _check_added_tokens(
    backend: Tokenizer, config: dict[str, Any], special: dict[str, str]
) -> None:
    """transformers adds the config's special and added tokens that tokenizer.json lacks; a
    saved folder has them all, else this tokenizer would not encode as transformers does."""
    added = {t.content: t.special for t in backend.get_added_tokens_decoder().values()}
    for token in special.values():
        if token not in added:
            raise UnsupportedTokenizer(f"its special token {token!r} is not an added token")
    for entry in (config.get("added_tokens_decoder") or {}).values():
        content = entry.get("content")
        if added.get(content) != bool(entry.get("special")):
            raise UnsupportedTokenizer(f"its added token {content!r} differs from tokenizer.json's")


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else the config's template (older saves keep it there)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise UnsupportedTokenizer("it has named chat templates")
    return template


@functools.lru_cache(maxsize=1)
def _transformers_major() -> int:
    """The installed transformers' major version, read from its metadata (not imported)."""
    return int(importlib.metadata.version("transformers").split(".")[0])


def _cleans_up(config: dict[str, Any], backend: Tokenizer) -> bool:
    """Whether decoding cleans up tokenization spaces: as the config says, except that
    transformers 5 skips it for BPE models (it corrupts their text) unless forced."""
    if not config.get("clean_up_tokenization_spaces", False):
        return False
    forced = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    is_bpe = type(backend.model).__name__ == "BPE"
    return not (_transformers_major() >= 5 and is_bpe and not forced)


def _check_post_processor(
    tokenizer: FastTokenizer, config: dict[str, Any], class_name: str
) -> None:
    """transformers builds the post-processor anew from `add_bos_token`/`add_eos_token` where
    the config sets them (transformers 4's LlamaTokenizerFast: always, BOS by default); the
    saved one must add exactly those tokens, which it does when the same class saved it."""
    llama = class_name == "LlamaTokenizerFast"
    if not llama and "add_bos_token" not in config and "add_eos_token" not in config:
        return
    add_bos = bool(config.get("add_bos_token", llama)) and tokenizer.bos_token is not None
    add_eos = bool(config.get("add_eos_token", False)) and tokenizer.eos_token is not None
    plain = tokenizer.encode(_PROBE, add_special_tokens=False)
    expected = [tokenizer.bos_token_id] * add_bos + plain + [tokenizer.eos_token_id] * add_eos
    if tokenizer.encode(_PROBE) != expected:
        raise UnsupportedTokenizer("its post-processor differs from add_bos_token/add_eos_token")
