"""The CUDA-graph modes and the phases they serve: one row of `MODE_TRAITS` per mode.

Plain data, imported by the server's flags (their help text and choices), by the resolver
(`model_executor/cuda_graph/config.py`), by the backend factory and by the tests that run every
mode, so a new graph mode, or a new phase, is one row here (and one backend module).
"""

from __future__ import annotations

from dataclasses import dataclass

# verify: speculative decoding's TARGET_VERIFY steps (captured only when a drafter is set);
# draft: a draft model's decode steps (its own runner's decode graphs)
PHASES = ("decode", "prefill", "verify", "draft")


@dataclass(frozen=True)
class ModeTraits:
    """What a graph mode can do."""

    phases: tuple[str, ...]  # the phases it serves
    # it captures attention, so the attention backend needs CUDA-graph hooks (the registry's
    # `graph_hooks`)
    needs_attention_graph_hooks: bool
    # under --debug-cuda-graph it captures nothing and runs its graph path eagerly, on any device
    debug_eager: bool
    summary: str  # what is captured, for help texts


MODE_TRAITS: dict[str, ModeTraits] = {
    "full": ModeTraits(
        ("decode", "verify", "draft"),
        needs_attention_graph_hooks=True,
        debug_eager=False,
        summary="the whole step in one graph",
    ),
    "breakable": ModeTraits(
        PHASES,
        needs_attention_graph_hooks=False,
        debug_eager=True,
        summary="a chain of graphs with attention run eagerly between them",
    ),
    "tc_piecewise": ModeTraits(
        PHASES,
        needs_attention_graph_hooks=False,
        debug_eager=True,
        summary="torch.compile pieces split at attention, each captured",
    ),
}
DISABLED = "disabled"
MODES = (*MODE_TRAITS, DISABLED)
# verify and draft: the decode phase's mode where it serves them
DEFAULTS_CUDA = {"decode": "full", "prefill": "breakable"}


def debug_eager_modes() -> tuple[str, ...]:
    """The modes that --debug-cuda-graph runs eagerly (so on any device)."""
    return tuple(m for m, t in MODE_TRAITS.items() if t.debug_eager)


def modes_serving(phase: str) -> tuple[str, ...]:
    """The graph modes that can serve `phase`."""
    return tuple(m for m, t in MODE_TRAITS.items() if phase in t.phases)


def unsupported_reason(phase: str, mode: str) -> str | None:
    """Why `mode` cannot serve `phase` (None: it can, or it is `disabled`)."""
    if mode == DISABLED or phase in MODE_TRAITS[mode].phases:
        return None
    others = " or ".join(repr(m) for m in modes_serving(phase))
    return f"{phase} mode {mode!r} is not supported yet; use {others} (or {DISABLED!r})"


def modes_help(phase: str | None = None) -> str:
    """The modes (of `phase`, or all with the phases each serves) and what each captures."""
    parts = []
    for mode, traits in MODE_TRAITS.items():
        if phase is not None and phase not in traits.phases:
            continue
        only = (
            ""
            if phase is not None or traits.phases == PHASES
            else f"{'/'.join(traits.phases)} only: "
        )
        parts.append(f"{mode} ({only}{traits.summary})")
    return ", ".join([*parts, f"{DISABLED} (eager)"])


def mode_cells() -> list[tuple[str, str]]:
    """(decode mode, prefill mode) pairs that run every graph mode in each phase it serves, the
    other phase in its CUDA default: one server per mode covers the table (the GPU tests'
    parametrisation)."""
    cells = []
    for mode, traits in MODE_TRAITS.items():
        decode = mode if "decode" in traits.phases else DEFAULTS_CUDA["decode"]
        prefill = mode if "prefill" in traits.phases else DEFAULTS_CUDA["prefill"]
        cells.append((decode, prefill))
    return cells
