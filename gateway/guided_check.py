"""Structured-output specs compiled against the served tokenizer before admission.

A ``Guided`` spec (``response_format``, ``guided_*``, a tool's parameters, the grammar
a forced ``tool_choice`` becomes) is compiled here as the executor will compile it:
the same grammar, tokenizer and limits (protos/guided.py), and the matcher's first
tokens walked (``probe``). A spec that would fail the executor's step is a 400 naming
llguidance's reason instead; docs/architecture.md says where each side does it.

* llguidance's tokenizer (~0.3 s for 49k tokens) is built on first use, or in the
  background from startup (``warm``).
* Verdicts are kept in an LRU of VERDICT_CACHE specs keyed by a digest of the spec,
  so a repeated schema costs one hash.
* Each compile runs in a worker thread and is waited for at most COMPILE_TIMEOUT_S;
  past that the spec is refused. llguidance's fuel limits bound the compiles this
  probes to well under a second; the timeout bounds what they do not. The admit step
  calls this off the event loop (gateway/admission.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import threading
from collections.abc import Callable

import llguidance

from protos import guided as guided_spec
from protos.continuum.v1 import sampling_pb2
from protos.echo import clip

VERDICT_CACHE = 512
COMPILE_TIMEOUT_S = 2.0
_COMPILE_THREADS = 4


class GuidedCheck:
    """Why a Guided spec cannot be served, for one model's tokenizer; thread-safe."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: tuple[int, ...], timeout_s: float = COMPILE_TIMEOUT_S):
        self._tokenizer_json = tokenizer_json  # called once, on first use
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self.timeout_s = timeout_s
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._verdicts: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the tokenizer, the pool and the verdicts

    def problem(self, guided: sampling_pb2.Guided) -> str | None:
        """A message naming why ``guided`` cannot be served, or None to accept it."""
        key = hashlib.sha256(guided.SerializeToString(deterministic=True)).digest()
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        tokenizer = self.tokenizer()  # before the clock starts: built once, not per spec
        future = self._workers().submit(_verdict, tokenizer, guided)
        try:
            verdict = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            # Kept like any verdict: the same spec again would hold a worker again.
            verdict = (f"the grammar took too long to compile (more than {self.timeout_s:g} "
                       "s); simplify the schema, regex or grammar")
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > VERDICT_CACHE:
                self._verdicts.popitem(last=False)
        return verdict

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = guided_spec.load_tokenizer(
                    self._tokenizer_json(), self._vocab_size, self._eos_token_ids)
            return self._tokenizer

    def warm(self) -> None:
        """Builds the tokenizer in the background (a check waits for it if it must)."""
        threading.Thread(target=self.tokenizer, name="guided-tokenizer", daemon=True).start()

    def _workers(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _COMPILE_THREADS, thread_name_prefix="guided-compile")
            return self._pool


def _verdict(tokenizer: llguidance.LLTokenizer, guided: sampling_pb2.Guided) -> str | None:
    try:
        grammar = guided_spec.grammar_of(guided)
        if grammar is not None:
            guided_spec.probe(tokenizer, grammar, f"guided.{guided.WhichOneof('kind')}")
        for pattern in guided_spec.schema_patterns(guided):  # each built only when reached
            guided_spec.probe(tokenizer, guided_spec.grammar_of(
                sampling_pb2.Guided(regex=pattern)), f"the schema's pattern {clip(pattern)}")
    except guided_spec.GuidedError as exc:
        return str(exc)
    return None
