"""One frozen scheduler config, validated once where it is built."""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    """A config value a user must change; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one iteration and of the queues.

    max_num_batched_tokens: tokens computed per step across all sequences.
    max_num_seqs: sequences running at once (each decodes one token a step).
    chunk_size: most prompt tokens one sequence computes in one step.
    max_num_waiting: requests that may queue before Submit is refused.
    watermark_blocks: free blocks admission keeps in reserve for running
        sequences' decodes, so admitting never forces an immediate preemption.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    chunk_size: int = 512
    max_num_waiting: int = 1024
    watermark_blocks: int = 4

    def __post_init__(self) -> None:
        _positive(self, "max_num_batched_tokens", "max_num_seqs", "chunk_size", "max_num_waiting")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}); otherwise running decodes cannot all get their token "
                "each step"
            )
        if self.chunk_size > self.max_num_batched_tokens:
            raise ConfigError(
                f"chunk_size ({self.chunk_size}) must be <= max_num_batched_tokens "
                f"({self.max_num_batched_tokens})"
            )
        if self.watermark_blocks < 0:
            raise ConfigError(f"watermark_blocks must be >= 0, got {self.watermark_blocks}")


def _positive(cfg: SchedulerConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
