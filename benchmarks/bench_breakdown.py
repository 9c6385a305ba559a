"""Where a decode step's time goes (benchmarks/bench_executor.py's breakdown): wall time per
component, from wrapped functions and the native decoder's own phase clock."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

import executor_svc.models.decoder as model_mod  # the names its forward looks up
import executor_svc.runner as runner_mod
from kernels import native, quant
from kernels.native_decoder import NativeDecoder

if TYPE_CHECKING:
    from benchmarks.bench_decode import DecodeRun
    from executor_svc.models.decoder import DecoderModel


class Breakdown:
    """Wall time per component, by wrapping the functions a step calls (instrumentation
    only: the bench restores every wrapped attribute)."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, attr: str, name_of) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name_of(*args)] += self.clock() - start

        self._undo.append((owner, attr, original))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def breakdown(run: DecodeRun, model: DecoderModel, steps: int) -> dict[str, float]:
    """ms per step: plan check + apply, batch building, layer matmuls, LM head, attention,
    KV write, norms/rope/other forward ops, sampling, the rest of Runner.execute. A
    step's layers run in one native call (kernels/cpu_decoder.cpp): its phases
    come from the decoder's own clock, the rest from wrapped Python functions."""
    b, r = Breakdown(run.clock), run.runner
    decoder = model._decoder
    phases = np.zeros(len(NativeDecoder.PHASES)) if decoder is not None else None
    if decoder is not None:
        decoder.phase_seconds = phases
    head = model.lm_head
    b.wrap(runner_mod, "check_plan", lambda *a: "plan check + apply")
    b.wrap(r, "_apply", lambda *a: "plan check + apply")
    b.wrap(runner_mod, "build_inputs", lambda *a: "batch building")
    b.wrap(model_mod, "linear", lambda x, w: "LM head" if w is head else "layer matmuls")
    b.wrap(model_mod, "project", lambda w, x: "layer matmuls")  # tensor or packed weight
    b.wrap(native.PackedWeight, "mm_t", lambda w, x: "LM head")
    b.wrap(quant.QuantWeight, "mm_t", lambda w, x: "LM head")
    b.wrap(r.backend, "forward", lambda *a: "attention")
    b.wrap(r.backend, "prepare", lambda *a: "attention")
    b.wrap(r.kv, "write", lambda *a: "KV write")
    b.wrap(r, "forward", lambda *a: "forward")
    b.wrap(r.sampler, "sample", lambda *a: "sampling")
    total = 0.0
    try:
        for _ in range(steps):
            total += run.step()
    finally:
        b.restore()
        if decoder is not None:
            decoder.phase_seconds = None
    ms = {k: v * 1e3 / steps for k, v in b.seconds.items()}
    for name, seconds in zip(NativeDecoder.PHASES, phases if phases is not None else (),
                             strict=False):
        ms[name] = ms.get(name, 0.0) + seconds * 1e3 / steps
    inner = sum(ms.setdefault(k, 0.0) for k in ("layer matmuls", "LM head", "attention",
                                                 "KV write"))
    inner += sum(ms.get(k, 0.0) for k in ("norms + residual", "rope + q/k/v layout", "SwiGLU"))
    ms["other forward ops"] = ms.pop("forward") - inner
    ms["total"] = total * 1e3 / steps
    ms["rest of execute"] = ms["total"] - ms["other forward ops"] - inner - sum(
        ms[k] for k in ("plan check + apply", "batch building", "sampling"))
    return ms
