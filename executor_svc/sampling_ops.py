"""Tensor operations behind the sampler, batched over R sampling rows of a V-token vocabulary.

Reproducibility rests on ``draw``: each row consumes exactly one uniform number, derived
from (request seed, token position) alone, and inverts the row's CDF in token-id order. The
same seed therefore gives the same token whatever else is in the batch, and again after a
preemption or an executor restart (docs/design.md §5).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
# top-k / top-p look at this many most likely tokens first; a row whose nucleus does not
# fit falls back to the whole vocabulary (a full sort costs ~3 ms a row on 2 cores, topk 0.3).
CANDIDATES = 1024


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (bits >> 11) * 2.0**-53


def apply_penalties(
    logits: torch.Tensor,  # [V], edited in place
    history: list[int],  # prompt + output
    output: list[int],
    repetition: float,
    presence: float,
    frequency: float,
) -> None:
    """Repetition over prompt + output (divide positive logits, multiply negative ones);
    presence and frequency over the output only (OpenAI semantics)."""
    if repetition != 1.0 and history:
        seen = torch.unique(torch.tensor(history, dtype=torch.int64, device=logits.device))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / repetition, values * repetition)
    if output and (presence != 0.0 or frequency != 0.0):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64, device=logits.device),
                                minlength=len(logits))
        counts = counts[: len(logits)].to(logits.dtype)
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def filter_probs(
    probs: torch.Tensor,  # [R, V]
    top_k: torch.Tensor,  # [R] int64, 0 = off
    top_p: torch.Tensor,  # [R] float, 1 = off
    min_p: torch.Tensor,  # [R] float, 0 = off
    typical_p: torch.Tensor | None = None,  # [R] float, 1 = off; None: every row off
) -> torch.Tensor:  # [R, V], filtered-out tokens at 0 (not renormalized; draw() needs not)
    if bool((min_p > 0).any()):
        floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < floor, 0.0, probs)
    rows = ((top_k > 0) | (top_p < 1)).nonzero().flatten()
    if len(rows):
        sub = probs.index_select(0, rows)  # [J, V]
        vocab = sub.shape[-1]
        k = min(vocab, max(CANDIDATES, int(top_k[rows].max())))
        filtered, short = _keep_nucleus(sub, top_k[rows], top_p[rows], k)
        if bool(short.any()):  # the nucleus runs past the candidates: use every token
            again, _ = _keep_nucleus(sub[short], top_k[rows][short], top_p[rows][short], vocab)
            filtered[short] = again
        probs = probs.index_copy(0, rows, filtered)
    if typical_p is not None:
        rows = (typical_p < 1).nonzero().flatten()
        if len(rows):
            kept = _keep_typical(probs.index_select(0, rows), typical_p[rows])
            probs = probs.index_copy(0, rows, kept)
    return probs


def _keep_typical(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022, as transformers' TypicalLogitsWarper):
    rank tokens by how far their surprisal -log p lies from the entropy H, and keep the
    closest until their mass reaches ``mass``, the one that crosses it and any tied with it
    included; the closest token always stays. Applied after top-k / top-p, so H is the
    entropy of what those kept (renormalized).

    probs [J, V] >= 0 (zeros: filtered out already; they rank last and stay 0),
    mass [J] in (0, 1) -> [J, V]."""
    p = probs / probs.sum(dim=-1, keepdim=True)
    logp = torch.log(p)  # -inf where p == 0
    entropy = -(p * logp).nansum(dim=-1, keepdim=True)  # [J, 1]; 0 * -inf counts 0
    distance, order = (-logp - entropy).abs().sort(dim=-1)  # [J, V], closest first
    before_mass = p.gather(-1, order).cumsum(dim=-1) < mass[:, None]
    last = before_mass.sum(dim=-1, keepdim=True).clamp_(max=p.shape[-1] - 1)  # [J, 1]
    drop = distance > distance.gather(-1, last)
    drop[:, 0] = False
    return probs.masked_fill(drop.scatter(1, order, drop), 0.0)


def _keep_nucleus(probs, top_k, top_p, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # probs [J, V] -> (filtered [J, V], short [J] bool: the k candidates may not hold it all)
    values, ids = probs.topk(k, dim=-1)  # [J, K], most likely first
    rank = torch.arange(k, device=probs.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    # Smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    # The top token always stays.
    before = values.cumsum(dim=-1) - values
    total = probs.sum(dim=-1, keepdim=True)
    keep &= (top_p[:, None] >= 1) | (before < top_p[:, None] * total)
    short = keep[:, -1] & (top_k <= 0) & (k < probs.shape[-1])
    filtered = torch.zeros_like(probs).scatter_(1, ids, values * keep)
    return filtered, short


def draw(
    probs: torch.Tensor,  # [R, V], non-negative, any positive total
    uniforms: torch.Tensor,  # [R] float64 in [0, 1)
) -> torch.Tensor:  # [R] int64
    """Inverse-CDF sampling: the first token whose cumulative mass exceeds u × total. It can
    never pick a zero-probability token (its CDF step is empty)."""
    cdf = probs.cumsum(dim=-1)  # [R, V]
    target = (uniforms * cdf[:, -1].double()).to(cdf.dtype)  # [R]
    tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    past_end = tokens >= probs.shape[-1]  # float rounding put the target at the total
    if bool(past_end.any()):
        tokens[past_end] = probs[past_end].argmax(dim=-1)
    return tokens
