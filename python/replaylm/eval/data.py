"""Reading eval data from a local path, a `file://` URL or an http(s) URL.

The default is the copy shipped inside the package, `replaylm/eval/datasets/` (`gsm8k/`,
`mgsm/`, each with its licence), so an installed package evaluates offline.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import httpx


class DataError(Exception):
    """Eval data that cannot be found, read or understood; the message says which and why."""


def default_data_dir() -> Path:
    """The eval data shipped with the package (`gsm8k/`, `mgsm/`)."""
    return Path(str(resources.files("replaylm.eval") / "datasets"))


def sibling(location: str, name: str) -> str:
    """The file called `name` in the same folder (or URL folder) as `location`."""
    if _is_url(location):
        return urljoin(location, name)
    return str(Path(location).with_name(name))


def read_text(location: str) -> str:
    """The UTF-8 text at a path, `file://` URL or http(s) URL; DataError when unreadable."""
    try:
        if urlparse(location).scheme in ("http", "https"):
            resp = httpx.get(location, follow_redirects=True, timeout=60)
            resp.raise_for_status()
            return resp.text
        path = unquote(urlparse(location).path) if location.startswith("file://") else location
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, httpx.HTTPError) as err:
        raise DataError(f"cannot read eval data {location!r}: {_reason(err)}") from None


def read_jsonl(location: str) -> list[dict]:
    """One JSON object per non-blank line."""
    rows = []
    for n, line in enumerate(read_text(location).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{location} line {n}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{location} line {n}: expected a JSON object")
        rows.append(row)
    return rows


def read_tsv(location: str, columns: int) -> list[list[str]]:
    """Rows of exactly `columns` tab-separated fields, one per non-blank line, no header."""
    rows = []
    for n, line in enumerate(read_text(location).splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != columns:
            raise DataError(
                f"{location} line {n}: expected {columns} tab-separated fields, found {len(fields)}"
            )
        rows.append(fields)
    return rows


def _is_url(location: str) -> bool:
    return urlparse(location).scheme in ("http", "https", "file")


def _reason(err: Exception) -> str:
    if isinstance(err, FileNotFoundError):
        return "no such file"
    if isinstance(err, IsADirectoryError):
        return "it is a folder, not a file"
    if isinstance(err, httpx.HTTPStatusError):
        return f"HTTP {err.response.status_code}"
    return str(err) or type(err).__name__
