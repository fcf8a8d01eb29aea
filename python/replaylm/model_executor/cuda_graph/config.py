"""The CUDA-graph resolver: server flags -> `{"decode": mode, "prefill": mode, "verify": mode}`
plus shapes.

Pure Python (no torch: the launcher resolves before it spawns the model's process), four stages:

1. parse     `--cuda-graph-mode` JSON, the per-phase flags and the legacy flags, each into a
             per-phase choice tagged with the flag it came from;
2. defaults  precedence JSON > per-phase > legacy > defaults picks one choice per phase; every
             lower flag that a higher one overrides is warned about, naming both; legacy flags are
             warned as deprecated, naming their replacement;
3. rules     named compatibility rules (predicate + reason) turn a phase off when the server's
             other settings cannot work with it; for a phase the user set explicitly that is an
             error instead;
4. validate  modes the backends cannot serve and the capture shapes.

What a mode can do is one row of `MODE_TRAITS` (`replaylm/cuda_graph_modes.py`); the rules and the
validation read the rows, so a new graph mode is one backend module, one line in
`backend/factory.py` and one row there. The attention backends come in resolved (`PhaseAttention
Backends`): the front end resolves them and this config once, before the model process starts.
Every problem raises CudaGraphConfigError: one line naming the flag and the valid choices.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from replaylm.cuda_graph_modes import (
    DEFAULTS_CUDA,
    MODE_TRAITS,
    MODES,
    PHASES,
    ModeTraits,
    debug_eager_modes,
    unsupported_reason,
)
from replaylm.layers.attention.registry import BACKENDS_WITH_GRAPH_HOOKS
from replaylm.layers.attention.selection import PhaseAttentionBackends
from replaylm.server_args import DEFAULT_PREFILL_CHUNK, DRAFT_MODEL_ALGORITHMS

GRAPH_DEVICES = ("cuda",)

JSON_FLAG = "--cuda-graph-mode"
LEGACY_REPLACEMENTS = {
    "--disable-cuda-graph": '--cuda-graph-mode \'{"decode": "disabled", "prefill": "disabled"}\'',
    "--disable-piecewise-cuda-graph": "--prefill-disable-cuda-graph",
    "--enable-breakable-cuda-graph": "--prefill-cuda-graph-mode breakable",
}


class CudaGraphConfigError(ValueError):
    """A bad CUDA-graph setting; the message is one line that names the flag."""


class GraphArgs(Protocol):
    """The ServerArgs fields the resolver reads."""

    cuda_graph_mode: str | None
    decode_cuda_graph_mode: str | None
    prefill_cuda_graph_mode: str | None
    verify_cuda_graph_mode: str | None
    draft_cuda_graph_mode: str | None
    decode_disable_cuda_graph: bool
    prefill_disable_cuda_graph: bool
    verify_disable_cuda_graph: bool
    draft_disable_cuda_graph: bool
    disable_cuda_graph: bool
    disable_piecewise_cuda_graph: bool
    enable_breakable_cuda_graph: bool
    decode_cuda_graph_bs: list[int] | None
    decode_cuda_graph_max_bs: int | None
    prefill_cuda_graph_tokens: list[int] | None
    prefill_cuda_graph_max_tokens: int | None
    max_running_requests: int | None  # None: not resolved for the device yet (checks only)
    chunked_prefill_size: int | None  # None: the model's default, at least DEFAULT_PREFILL_CHUNK
    debug_cuda_graph: bool
    tc_piecewise_compiler: str
    tc_piecewise_kernels: str
    compile_cache_dir: str | None
    speculative_algorithm: str | None  # None: no verify steps, the verify phase is off

    @property
    def speculative_steps(self) -> int: ...

    @property
    def speculative_batch_limit(self) -> int: ...


@dataclass(frozen=True)
class GraphBackendOptions:
    """The graph backends' own options: `debug` runs the breakable and tc_piecewise paths
    eagerly (--debug-cuda-graph); the others are tc_piecewise's compiler, kernels and compile
    cache directory."""

    debug: bool = False
    compiler: str = "inductor"
    kernels: str = "fused"
    compile_cache_dir: str | None = None


@dataclass(frozen=True)
class PhaseConfig:
    """One phase's resolved mode, the flag (or `default`, or `rule <name>`) that decided it, and
    the shapes to capture (batch sizes for decode, token counts for prefill and verify; empty
    if off)."""

    mode: str
    source: str
    shapes: tuple[int, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"


@dataclass(frozen=True)
class CudaGraphConfig:
    decode: PhaseConfig
    prefill: PhaseConfig
    verify: PhaseConfig = PhaseConfig("disabled", "default")
    draft: PhaseConfig = PhaseConfig("disabled", "default")  # the draft model's decode phase
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # informational: defaults on CPU, rules that turned a phase off
    options: GraphBackendOptions = GraphBackendOptions()

    def phase(self, name: str) -> PhaseConfig:
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return {
            p: {"mode": c.mode, "source": c.source, "shapes": list(c.shapes)}
            for p, c in ((p, self.phase(p)) for p in PHASES)
        }

    def summary(self) -> str:
        """`{"decode": "full", "prefill": "disabled"}` as one line (verify and draft too when
        on)."""
        return json.dumps(
            {
                p: self.phase(p).mode
                for p in PHASES
                if p in ("decode", "prefill") or self.phase(p).enabled
            }
        )


@dataclass(frozen=True)
class _Choice:
    mode: str
    flag: str
    level: int  # 0 JSON, 1 per-phase, 2 legacy


@dataclass
class _Parsed:
    choices: dict[str, list[_Choice]] = field(default_factory=lambda: {p: [] for p in PHASES})
    warnings: list[str] = field(default_factory=list)


# ---- stage 1: parse -------------------------------------------------------------------------


def _check_mode(mode: object, flag: str) -> str:
    if mode not in MODES:
        raise CudaGraphConfigError(
            f"{flag}: unknown mode {mode!r}; valid modes: {', '.join(MODES)}"
        )
    return mode


def _parse(args: GraphArgs) -> _Parsed:
    parsed = _Parsed()
    if args.cuda_graph_mode is not None:
        try:
            table = json.loads(args.cuda_graph_mode)
        except json.JSONDecodeError as err:
            raise CudaGraphConfigError(
                f"{JSON_FLAG}: malformed JSON ({err.msg} at column {err.colno}); expected e.g. "
                '\'{"decode": "full", "prefill": "breakable"}\''
            ) from None
        if not isinstance(table, dict):
            raise CudaGraphConfigError(
                f"{JSON_FLAG}: expected a JSON object mapping phases ({', '.join(PHASES)}) "
                f"to modes, got {args.cuda_graph_mode!r}"
            )
        for phase, mode in table.items():
            if phase not in PHASES:
                raise CudaGraphConfigError(
                    f"{JSON_FLAG}: unknown phase {phase!r}; valid phases: {', '.join(PHASES)}"
                )
            parsed.choices[phase].append(_Choice(_check_mode(mode, JSON_FLAG), JSON_FLAG, 0))
    for phase in PHASES:
        mode_flag = f"--{phase}-cuda-graph-mode"
        off_flag = f"--{phase}-disable-cuda-graph"
        mode = getattr(args, f"{phase}_cuda_graph_mode")
        off = getattr(args, f"{phase}_disable_cuda_graph")
        if mode is not None and off and mode != "disabled":
            raise CudaGraphConfigError(
                f"{mode_flag} {mode} contradicts {off_flag}; give one of them"
            )
        if mode is not None:
            parsed.choices[phase].append(_Choice(_check_mode(mode, mode_flag), mode_flag, 1))
        elif off:
            parsed.choices[phase].append(_Choice("disabled", off_flag, 1))
    _parse_legacy(args, parsed)
    return parsed


def _parse_legacy(args: GraphArgs, parsed: _Parsed) -> None:
    if args.disable_piecewise_cuda_graph and args.enable_breakable_cuda_graph:
        raise CudaGraphConfigError(
            "--disable-piecewise-cuda-graph contradicts --enable-breakable-cuda-graph; "
            "use --prefill-cuda-graph-mode instead"
        )
    legacy: list[tuple[str, bool, dict[str, str]]] = [
        (
            "--disable-cuda-graph",
            args.disable_cuda_graph,
            {"decode": "disabled", "prefill": "disabled"},
        ),
        (
            "--disable-piecewise-cuda-graph",
            args.disable_piecewise_cuda_graph,
            {"prefill": "disabled"},
        ),
        (
            "--enable-breakable-cuda-graph",
            args.enable_breakable_cuda_graph,
            {"prefill": "breakable"},
        ),
    ]
    for flag, given, modes in legacy:
        if not given:
            continue
        parsed.warnings.append(f"{flag} is deprecated; use {LEGACY_REPLACEMENTS[flag]}")
        for phase, mode in modes.items():
            parsed.choices[phase].append(_Choice(mode, flag, 2))


# ---- stage 2: precedence and defaults -----------------------------------------------------


def _pick(phase: str, choices: list[_Choice], parsed: _Parsed) -> _Choice | None:
    """The highest-precedence choice (None: no flag set this phase); warn about overridden ones.
    Two flags of the same level that disagree are an error."""
    if not choices:
        return None
    ordered = sorted(choices, key=lambda c: c.level)
    winner = ordered[0]
    for lower in ordered[1:]:
        if lower.level == winner.level and lower.mode != winner.mode:
            raise CudaGraphConfigError(
                f"{winner.flag} ({phase} {winner.mode!r}) contradicts {lower.flag} "
                f"({phase} {lower.mode!r}); give one of them"
            )
        if lower.mode != winner.mode:
            parsed.warnings.append(
                f"{winner.flag} sets {phase} to {winner.mode!r}, overriding {lower.flag} "
                f"({lower.mode!r})"
            )
    return winner


def _default(phase: str, device: str, decode_mode: str) -> str:
    """The phase's mode when no flag sets it. Verify and draft follow decode (every mode that
    serves decode serves them)."""
    if device not in GRAPH_DEVICES:
        return "disabled"
    return DEFAULTS_CUDA.get(phase, decode_mode)


# ---- stage 3: compatibility rules ----------------------------------------------------------


@dataclass(frozen=True)
class CompatibilityRule:
    """When `applies(traits, context)` holds, a phase cannot run in a mode of those traits."""

    name: str
    applies: Callable[[ModeTraits, dict[str, str]], bool]
    reason: str


RULES: tuple[CompatibilityRule, ...] = (
    CompatibilityRule(
        "graphs-need-cuda",
        lambda traits, ctx: (
            ctx["device"] not in GRAPH_DEVICES and not (ctx["debug"] == "on" and traits.debug_eager)
        ),
        "CUDA graphs need a CUDA device; this server runs on {device} (only "
        "--debug-cuda-graph runs {debug_eager}, eagerly, on any device)",
    ),
    CompatibilityRule(
        "needs-attention-graph-hooks",
        lambda traits, ctx: (
            traits.needs_attention_graph_hooks
            and ctx["attention_backend"] not in BACKENDS_WITH_GRAPH_HOOKS
        ),
        "a {mode} graph captures attention, which needs an attention backend with CUDA-graph "
        "hooks ({hooked}); {attention_flag} is {attention_backend}",
    ),
)


def _apply_rules(
    phase: str, mode: str, explicit_flag: str | None, ctx: dict[str, str]
) -> tuple[str, CompatibilityRule | None, str]:
    """(mode after the rules, the rule that turned the phase off or None, its reason)."""
    if mode == "disabled":
        return mode, None, ""
    for rule in RULES:
        if rule.applies(MODE_TRAITS[mode], ctx):
            reason = rule.reason.format(
                mode=mode,
                hooked=", ".join(sorted(BACKENDS_WITH_GRAPH_HOOKS)),
                debug_eager=" and ".join(debug_eager_modes()),
                **ctx,
            )
            if explicit_flag is not None:
                raise CudaGraphConfigError(
                    f"{explicit_flag}: {phase} mode {mode!r} is not possible here "
                    f"(rule {rule.name}: {reason}); choose 'disabled' for {phase} or change "
                    "the conflicting setting"
                )
            return "disabled", rule, reason
    return mode, None, ""


# ---- stage 4: validation and shapes ---------------------------------------------------------


# decode graphs cover the running-request cap (every running request can decode in a graph);
# this is the cap where none is known
DEFAULT_DECODE_MAX_BS = 512


def default_decode_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 256, every 64 up to 512, every 128 beyond, clipped to
    `max_bs` (which is always included). Beyond 256 a padding row costs its matmul rows only
    (attention skips empty rows, and KV reads dominate such a step), so coarser steps lose
    little."""
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(320, 513, 64), *range(640, max_bs, 128)]
    return tuple(sorted({s for s in sizes if s < max_bs} | {max_bs}))


# Larger prefill steps run eagerly unless a flag captures them: a step that large loses little to
# Python's launch time, and each bucket costs capture time and graph memory (docs/benchmarks.md,
# "CUDA-graph capture").
DEFAULT_PREFILL_MAX_TOKENS = 2048


def default_prefill_token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Powers of two from 16, then steps of 256 after 512, clipped to (and ending at) max."""
    sizes = [16, 32, 64, 128, 256, *range(512, 8193, 256)]
    return tuple(sorted({s for s in sizes if s < max_tokens} | {max_tokens}))


def _check_shapes(values: Sequence[int] | None, flag: str) -> tuple[int, ...] | None:
    if values is None:
        return None
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
        raise CudaGraphConfigError(
            f"{flag}: expected one or more positive integers, got {list(values)!r}"
        )
    return tuple(sorted(set(values)))


def _check_max(value: int | None, flag: str) -> int | None:
    if value is not None and value < 1:
        raise CudaGraphConfigError(f"{flag}: expected a positive integer, got {value}")
    return value


def _shapes(args: GraphArgs, phase: str, enabled: bool, warnings: list[str]) -> tuple[int, ...]:
    """The phase's capture shapes (validated even when the phase is off; empty then)."""
    if phase == "verify":
        return _verify_shapes(args) if enabled else ()
    if phase == "draft":  # the draft model's decode batch sizes, as the target's
        phase = "decode"
    if phase == "decode":
        list_flag, max_flag = "--decode-cuda-graph-bs", "--decode-cuda-graph-max-bs"
        given = _check_shapes(args.decode_cuda_graph_bs, list_flag)
        max_given = _check_max(args.decode_cuda_graph_max_bs, max_flag)
        limit = args.max_running_requests or DEFAULT_DECODE_MAX_BS
        limit_flag = "--max-running-requests"
        default_max = limit
        make_default: Callable[[int], tuple[int, ...]] = default_decode_batch_sizes
    else:
        list_flag, max_flag = "--prefill-cuda-graph-tokens", "--prefill-cuda-graph-max-tokens"
        given = _check_shapes(args.prefill_cuda_graph_tokens, list_flag)
        max_given = _check_max(args.prefill_cuda_graph_max_tokens, max_flag)
        limit = args.chunked_prefill_size or DEFAULT_PREFILL_CHUNK
        limit_flag = "--chunked-prefill-size"
        default_max = DEFAULT_PREFILL_MAX_TOKENS
        make_default = default_prefill_token_buckets
    if not enabled:
        return ()
    if given is not None:
        if max_given is not None:
            warnings.append(f"{list_flag} overrides {max_flag} ({max_given})")
        kept = tuple(s for s in given if s <= limit)
        if kept != given:
            warnings.append(
                f"{list_flag}: dropped {[s for s in given if s > limit]} (above {limit_flag} "
                f"{limit})"
            )
        if not kept:
            raise CudaGraphConfigError(
                f"{list_flag}: every shape is above {limit_flag} {limit}; nothing to capture"
            )
        return kept
    return make_default(min(max_given or default_max, limit))


def _unused_phase(phase: str, args: GraphArgs) -> str | None:
    """What a speculative phase needs that the server's flags leave out (None: it runs)."""
    if phase == "verify" and args.speculative_algorithm is None:
        return "speculative decoding"
    if phase == "draft" and args.speculative_algorithm not in DRAFT_MODEL_ALGORITHMS:
        return "draft-model or EAGLE speculation"
    return None


def _verify_shapes(args: GraphArgs) -> tuple[int, ...]:
    """Row counts of verify steps (a row per verified token), spaced as decode batch sizes: a
    request verifies its last token and up to k drafts, and many propose fewer. Up to the
    largest batch that speculates (`--speculative-max-bs`) times k + 1."""
    limit = min(
        args.decode_cuda_graph_max_bs or DEFAULT_DECODE_MAX_BS,
        args.max_running_requests or DEFAULT_DECODE_MAX_BS,
        args.speculative_batch_limit,
    )
    return default_decode_batch_sizes(limit * (args.speculative_steps + 1))


def _validate_mode(phase: str, mode: str, flag: str | None) -> None:
    why = unsupported_reason(phase, mode)
    if why is not None:
        raise CudaGraphConfigError(f"{flag or JSON_FLAG}: {why}")


# ---- the resolver ---------------------------------------------------------------------------


def resolve_cuda_graph_config(
    args: GraphArgs, device: str, backends: PhaseAttentionBackends
) -> CudaGraphConfig:
    """Resolve the per-phase CUDA-graph config for `device` (`cuda` or `cpu`) and the phases'
    resolved attention backends."""
    parsed = _parse(args)
    base_ctx = {"device": device, "debug": "on" if args.debug_cuda_graph else "off"}
    phases: dict[str, PhaseConfig] = {}
    notes: list[str] = []
    if device not in GRAPH_DEVICES:
        notes.append(f"CUDA graphs are off by default on {device}: every phase runs eagerly")
    for phase in PHASES:
        choice = _pick(phase, parsed.choices[phase], parsed)
        unused = _unused_phase(phase, args)
        if unused is not None:
            if choice is not None and choice.mode != "disabled":
                parsed.warnings.append(
                    f"{choice.flag} sets {phase} to {choice.mode!r}, which only {unused} runs: "
                    f"no {phase} graphs"
                )
            phases[phase] = PhaseConfig("disabled", f"no {unused}")
            continue
        default = _default(phase, device, phases["decode"].mode if phases else "disabled")
        mode = choice.mode if choice else default
        source = choice.flag if choice else "default"
        explicit = choice.flag if choice and choice.mode != "disabled" else None
        _validate_mode(phase, mode, explicit)
        flag, backend = backends.of_phase(phase)
        ctx = {**base_ctx, "attention_flag": flag, "attention_backend": backend}
        mode, rule, reason = _apply_rules(phase, mode, explicit, ctx)
        if rule is not None:
            notes.append(f"{phase} CUDA graph off by rule {rule.name}: {reason}")
            source = f"rule {rule.name}"
        shapes = _shapes(args, phase, mode != "disabled", parsed.warnings)
        phases[phase] = PhaseConfig(mode, source, shapes)
    options = GraphBackendOptions(
        args.debug_cuda_graph,
        args.tc_piecewise_compiler,
        args.tc_piecewise_kernels,
        args.compile_cache_dir,
    )
    return CudaGraphConfig(
        phases["decode"],
        phases["prefill"],
        phases["verify"],
        phases["draft"],
        warnings=tuple(parsed.warnings),
        notes=tuple(notes),
        options=options,
    )
