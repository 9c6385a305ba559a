"""Structured output in the executor: one llguidance matcher per guided sequence.

A matcher has consumed exactly its sequence's output tokens: the sampler masks what the
grammar does not allow next (so any choice is legal) and the chosen token is consumed. A
resent sequence (recompute, restart, another replica) catches up by consuming its earlier
output first, so the state never depends on this executor's history. A complete grammar
allows only EOS. The llguidance tokenizer (~0.4 s to build) is built by a background
thread at start (``warm``); compiled grammars are cached by text (LRU, GRAMMAR_CACHE). A
matcher for a cached grammar takes under 1 ms, a mask ~0.2 ms per guided row and step.
"""

from __future__ import annotations

import collections
import logging
import pathlib
import threading

import llguidance
import numpy as np
import torch

from protos import guided as guided_spec
from protos.continuum.v1 import sampling_pb2

log = logging.getLogger("executor.guided")
GRAMMAR_CACHE = 256


class Guide:
    """One sequence's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.consumed = 0  # output tokens fed to the matcher
        self.vocab_size = vocab_size

    def mask(self, logits: torch.Tensor, output: list[int]) -> None:
        """Sets the logits [V] of every token the grammar forbids next to -inf."""
        if self.consumed < len(output):  # resent with earlier output: catch up
            self.matcher.consume_tokens(output[self.consumed:])
            self.consumed = len(output)
        if self.matcher.is_error():
            raise guided_spec.GuidedError(
                f"structured output failed: {self.matcher.get_error()}")
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]]
        if allowed.shape[0] < logits.shape[-1]:  # ids past the tokenizer's: never legal
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.shape[0]))
        logits[torch.from_numpy(allowed == 0)] = float("-inf")

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)
        self.consumed += 1


class Guides:
    """Makes Guides for one model: its tokenizer, built once on first use."""

    def __init__(self, model_dir: pathlib.Path, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def new(self, key: bytes) -> Guide | None:
        """A Guide for the serialized Guided ``key``, or None when it constrains nothing.
        GuidedError for a spec that does not compile (the gateway refuses those first)."""
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is None:
                grammar = guided_spec.grammar_of(sampling_pb2.Guided.FromString(key))
                if grammar is None:
                    return None
                self._grammars[key] = grammar
                while len(self._grammars) > GRAMMAR_CACHE:
                    self._grammars.popitem(last=False)
            else:
                self._grammars.move_to_end(key)
            tokenizer = self._tokenizer or self._load_tokenizer()
        # protos/guided.py's matcher: the limits the gateway compiled the spec under
        return Guide(guided_spec.new_matcher(tokenizer, grammar), self.vocab_size)

    def warm(self) -> None:
        """Builds the tokenizer in the background (new() waits for it if it must)."""
        def build() -> None:
            with self._lock:
                if self._tokenizer is None:
                    self._load_tokenizer()
        threading.Thread(target=build, name="guided-tokenizer", daemon=True).start()

    def _load_tokenizer(self) -> llguidance.LLTokenizer:
        text = (self.model_dir / "tokenizer.json").read_text()
        self._tokenizer = guided_spec.load_tokenizer(text, self.vocab_size, self.eos_token_ids)
        log.info("structured output: llguidance tokenizer built (%d tokens)", self.vocab_size)
        return self._tokenizer
