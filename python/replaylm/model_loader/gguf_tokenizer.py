"""A GGUF file's tokenizer: transformers builds it, a cache folder keeps it for later starts.

transformers builds a GGUF's tokenizer by parsing the whole file's metadata and converting its
vocabulary, which takes seconds (and imports torch), every start. The first start saves the result
(`save_pretrained`: tokenizer.json and its config) under `$REPLAYLM_CACHE_DIR` (default
`$XDG_CACHE_HOME/replaylm`, else `~/.cache/replaylm`), in a folder named for the file (path, size,
mtime) and the transformers and tokenizers versions; later starts load that folder, with the
tokenizers library alone where it allows (`fast_tokenizer`), without importing transformers. A
cache that cannot be written or read is passed over (the tokenizer is built as before), with a
warning.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replaylm.model_loader.fast_tokenizer import UnsupportedTokenizer, read_fast_tokenizer
from replaylm.model_loader.gguf_header import check_magic

logger = logging.getLogger(__name__)

CACHE_ENV = "REPLAYLM_CACHE_DIR"
_MARKER = "replaylm_tokenizer.json"  # written last: a folder without it is not a cache entry


def load_gguf_tokenizer(path: str) -> Any:
    """The HF tokenizer transformers builds from the GGUF's vocabulary and chat template (from
    the cache after the first time)."""
    path = os.path.abspath(path)
    check_magic(path)

    def build() -> Any:
        from transformers import AutoTokenizer

        folder, name = os.path.split(path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)

    return cached_tokenizer(path, build)


def cache_root() -> Path:
    """Where replaylm keeps what later starts reuse."""
    if root := os.environ.get(CACHE_ENV):
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "replaylm"


def cached_tokenizer(gguf_path: str, build: Callable[[], Any]) -> Any:
    """The tokenizer of `gguf_path` from the cache, else `build()`'s, saved for next time."""
    folder = cache_root() / "tokenizers" / _key(gguf_path)
    if (folder / _MARKER).is_file():
        try:
            return _load(folder)
        except Exception as err:  # a damaged entry: build it again
            logger.warning("cannot read the cached tokenizer in %s (%s); rebuilding", folder, err)
            shutil.rmtree(folder, ignore_errors=True)
    tokenizer = build()
    try:
        _store(tokenizer, folder, gguf_path)
    except OSError as err:
        logger.warning("cannot cache the tokenizer in %s: %s", folder, err)
    return tokenizer


def _key(gguf_path: str) -> str:
    path = os.path.abspath(gguf_path)
    stat = os.stat(path)
    versions = [importlib.metadata.version(p) for p in ("transformers", "tokenizers")]
    text = "\0".join([path, str(stat.st_size), str(stat.st_mtime_ns), *versions])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _load(folder: Path) -> Any:
    """The cached tokenizer: read with the tokenizers library alone where the folder allows it
    (`fast_tokenizer`: no transformers import, which takes seconds), else as the class
    transformers built (a fast tokenizer class, which transformers 5 imports without torch)."""
    class_name = json.loads((folder / _MARKER).read_text())["class"]
    try:
        tokenizer = read_fast_tokenizer(folder, class_name)
        logger.info("tokenizer loaded from the cache %s with the tokenizers library", folder)
        return tokenizer
    except UnsupportedTokenizer as why:
        logger.info("tokenizer loaded from the cache %s with transformers: %s", folder, why)
    import transformers

    return getattr(transformers, class_name).from_pretrained(folder)


def _store(tokenizer: Any, folder: Path, gguf_path: str) -> None:
    """Save `tokenizer` into a fresh folder beside `folder`, then rename it into place (a start
    beside this one may be saving the same entry: the first rename wins). A tokenizer whose
    class transformers does not export is not kept: `_load` could not make one again."""
    import transformers

    if getattr(transformers, type(tokenizer).__name__, None) is not type(tokenizer):
        logger.info("not caching a tokenizer of class %s", type(tokenizer).__name__)
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    try:
        tokenizer.save_pretrained(staging)
        marker = {"class": type(tokenizer).__name__, "source": os.path.abspath(gguf_path)}
        (staging / _MARKER).write_text(json.dumps(marker))
        os.rename(staging, folder)
        logger.info("tokenizer cached in %s", folder)
    except OSError:
        if not (folder / _MARKER).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
