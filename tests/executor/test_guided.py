"""Structured output's matcher (executor_svc/guided.py) with the bundled model's real
tokenizer: whatever the logits say, the masked choice is always legal, and a resent
sequence's matcher catches up from its tokens."""

from __future__ import annotations

import json

import pytest
import torch

from executor_svc.guided import Guides
from executor_svc.sampler import Sampler, SampleRow, SamplingConfig
from gateway.text.tokenizer import Tokenizer
from protos import guided as guided_spec
from protos.continuum.v1 import sampling_pb2

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "year": {"type": "integer", "minimum": 0,
                                                    "maximum": 2100}},
          "required": ["city", "year"], "additionalProperties": False}


@pytest.fixture(scope="module")
def setup(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    vocab = tokenizer.info.vocab_size
    eos = tuple(tokenizer.info.eos_token_ids)
    return Guides(model_dir, vocab, eos), tokenizer, vocab, eos


def _key(**kind) -> bytes:
    return sampling_pb2.Guided(**kind).SerializeToString(deterministic=True)


def _generate(guides, vocab, eos, key, seed, temperature=0.0, limit=120):
    """Greedy or seeded draws over random logits, masked: the grammar alone decides."""
    gen = torch.Generator().manual_seed(seed)
    cfg = SamplingConfig(temperature=temperature, guided=key, seed=seed)
    guide, tokens = guides.new(key), []
    sampler = Sampler(eos)
    for position in range(limit):
        logits = torch.randn(1, vocab, generator=gen) * 5
        row = SampleRow(cfg, seed, position, list(tokens), 0, guide)
        token = sampler.sample(logits, [row]).token_ids[0]
        if token in eos:
            return tokens, True
        tokens.append(token)
    return tokens, False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_still_give_json_that_fits_the_schema(setup, seed):
    guides, tokenizer, vocab, eos = setup
    tokens, ended = _generate(guides, vocab, eos, _key(json_schema=json.dumps(SCHEMA)), seed,
                              temperature=1.0 if seed else 0.0)
    assert ended, "the grammar never let the sequence end"
    value = json.loads(tokenizer.decode(tokens))
    assert set(value) == {"city", "year"} and 0 <= value["year"] <= 2100
    assert isinstance(value["city"], str) and len(value["city"]) <= 12


def test_regex_choice_and_an_object_start(setup):
    guides, tokenizer, vocab, eos = setup
    tokens, ended = _generate(guides, vocab, eos, _key(regex="(yes|no)"), 3)
    assert ended and tokenizer.decode(tokens) in ("yes", "no")
    # Any object: random logits never need to close it, but it opens as one.
    tokens, _ = _generate(guides, vocab, eos, _key(json_object=True), 4, limit=5)
    assert tokenizer.decode(tokens).startswith("{")


def test_a_resent_sequence_catches_up_from_its_tokens(setup):
    guides, tokenizer, vocab, eos = setup
    key = _key(json_schema=json.dumps(SCHEMA))
    tokens, _ = _generate(guides, vocab, eos, key, 7)
    half = tokens[: len(tokens) // 2]
    fresh = guides.new(key)  # a new executor: only the tokens so far
    logits = torch.zeros(vocab)
    fresh.mask(logits, half)
    allowed = torch.isfinite(logits)
    assert fresh.consumed == len(half) and bool(allowed[tokens[len(half)]])
    replay = guides.new(key)
    for token in half:
        replay.advance(token)
    again = torch.zeros(vocab)
    replay.mask(again, half)
    assert torch.equal(torch.isfinite(again), allowed)


@pytest.mark.parametrize("kind,value,words", [
    ("json_schema", '{"type": "nope"}', "cannot be compiled"),
    ("json_schema", "[1, 2]", "must be a JSON Schema object"),
    ("json_schema", "{", "is not JSON"),
    ("regex", "[0-9", "cannot be compiled"),
    ("lark", "start: undefined_rule", "cannot be compiled"),
    ("regex", "a" * (70 * 1024), "at most"),
])
def test_bad_specs_are_named(kind, value, words):
    with pytest.raises(guided_spec.GuidedError, match=words):
        guided_spec.grammar_of(sampling_pb2.Guided(**{kind: value}))
