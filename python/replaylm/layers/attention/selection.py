"""Which attention backend a server uses in each phase, decided without importing torch (the
CUDA-graph resolver runs before any model or device is touched)."""

from __future__ import annotations

from dataclasses import dataclass

from replaylm.layers.attention.registry import GPU_ONLY_BACKENDS


@dataclass(frozen=True)
class PhaseAttentionBackends:
    """The resolved backend of decode steps and of prefill (and mixed) steps."""

    decode: str
    prefill: str
    prefill_flag: str = "--attention-backend"  # the flag that chose prefill's

    def of_phase(self, phase: str) -> tuple[str, str]:
        """(the flag that chose the phase's backend, the backend): a draft model's decode steps
        and verify steps (decode rows) run the decode backend."""
        if phase in ("decode", "verify", "draft"):
            return "--attention-backend", self.decode
        return self.prefill_flag, self.prefill

    def describe(self) -> str:
        if self.decode == self.prefill:
            return self.decode
        return f"{self.decode} (decode), {self.prefill} (prefill)"


def resolve_attention_backend(
    name: str, device_type: str, flag: str = "--attention-backend"
) -> str:
    """`auto` -> `triton` on CUDA, `torch_native` elsewhere; a GPU-only backend asked for off
    CUDA is a ValueError naming `flag`."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch_native"
    if name in GPU_ONLY_BACKENDS and device_type != "cuda":
        raise ValueError(
            f"{flag} {name} needs a CUDA device; this server runs on {device_type} "
            "(use torch_native or auto)"
        )
    return name


def resolve_phase_backends(
    attention_backend: str, prefill_attention_backend: str | None, device_type: str
) -> PhaseAttentionBackends:
    """`--attention-backend` serves decode, and prefill too unless `--prefill-attention-backend`
    names another."""
    decode = resolve_attention_backend(attention_backend, device_type)
    if prefill_attention_backend is None:
        return PhaseAttentionBackends(decode, decode)
    flag = "--prefill-attention-backend"
    prefill = resolve_attention_backend(prefill_attention_backend, device_type, flag)
    return PhaseAttentionBackends(decode, prefill, flag)
