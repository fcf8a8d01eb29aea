"""The command lines built from ServerArgs: which flags each tool offers, their help, the API key's
environment variable and its redaction."""

from __future__ import annotations

import dataclasses
import re

import pytest

from replaylm import generate, launch_server
from replaylm.server_args import ServerArgs

SERVER_ONLY = ["--host", "--port", "--served-model-name", "--api-key", "--max-request-body-bytes"]
# what a help text must not read like: a measurement report or a history of the code
REPORT_WORDS = re.compile(r"measur|faster|slower|H100|session|\d+(\.\d+)?\s*(ms|us|µs|s|x)\b|\d+%")


def _flags(help_text: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z-]+", help_text))


def test_generate_help_lists_no_server_only_flags():
    gen_flags = _flags(generate.build_parser().format_help())
    for flag in SERVER_ONLY:
        assert flag not in gen_flags
    assert {"--model-path", "--device", "--seed", "--log-level", "--raw"} <= gen_flags
    ns = generate.build_parser().parse_args(["--device", "cpu", "hi"])
    args = ServerArgs.from_cli_args(ns)
    assert args.device == "cpu" and args.port == ServerArgs.port  # left-out fields: defaults
    with pytest.raises(SystemExit):
        generate.build_parser().parse_args(["--port", "8000", "hi"])


def test_launch_server_offers_every_field(capsys):
    with pytest.raises(SystemExit):
        launch_server.parse_args(["--help"])
    flags = _flags(capsys.readouterr().out)
    assert {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServerArgs)} <= flags
    args, _ = launch_server.parse_args(["--port", "8001", "--max-request-body-bytes", "1000"])
    assert args.port == 8001 and args.max_request_body_bytes == 1000


def test_help_says_what_a_flag_does_not_what_was_measured():
    for f in dataclasses.fields(ServerArgs):
        text = f.metadata["help"]
        assert text[0].isupper() and text.endswith((".", ")")), (f.name, text)
        assert not REPORT_WORDS.search(text), (f.name, REPORT_WORDS.search(text).group())


def test_api_key_from_the_environment_and_redacted(monkeypatch):
    monkeypatch.setenv("REPLAYLM_API_KEY", "from-env")
    args, _ = launch_server.parse_args([])
    assert args.api_key == "from-env"
    assert "from-env" not in repr(args) and "api_key='<set>'" in repr(args)
    assert args.redacted()["api_key"] == "<set>" and args.redacted()["port"] == args.port
    args, _ = launch_server.parse_args(["--api-key", "from-flag"])
    assert args.api_key == "from-flag"  # the flag wins
    monkeypatch.delenv("REPLAYLM_API_KEY")
    args, _ = launch_server.parse_args([])
    assert args.api_key is None and "api_key=None" in repr(args)


def test_body_limit_must_be_positive(capsys):
    with pytest.raises(SystemExit) as err:
        launch_server.parse_args(["--max-request-body-bytes", "0"])
    assert err.value.code == 2
    assert "--max-request-body-bytes must be >= 1" in capsys.readouterr().err
