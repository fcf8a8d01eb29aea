"""The weight formats `--load-format` names (no torch: the HTTP front end parses its flags
without it)."""

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
