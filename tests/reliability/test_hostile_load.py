"""The hostile row's kinds are what the row says they are, with no server started: each
costly kind is valid input the gateway accepts, and its benign twin carries the same
paid work (prompt tokens, max_tokens, n) without what the caps bound."""

from __future__ import annotations

import pytest

from benchmarks.reliability.hostile_load import (
    _UNPAID,
    CANCELLED,
    benign_twin,
    costly_kinds,
)
from gateway.api.openai_api import CHAT, COMPLETION
from gateway.text.tokenizer import Tokenizer
from gateway.validation import prompt_token_ids, validate


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _validated(tokenizer: Tokenizer, path: str, body: dict):
    dialect = CHAT if path == "chat/completions" else COMPLETION
    api = dialect.parse({"model": "", **body}, "served", tokenizer)
    return validate(api.proto, tokenizer, "served")


def test_every_kind_is_valid_and_its_twin_pays_for_the_same_tokens(tokenizer):
    def count(path: str, body: dict) -> int:
        dialect = CHAT if path == "chat/completions" else COMPLETION
        return len(prompt_token_ids(dialect.parse({"model": "", **body}, "served",
                                                  tokenizer).proto, tokenizer))

    kinds = costly_kinds()
    assert kinds[-1] == CANCELLED and len(kinds) == 7
    for kind in kinds[:-1]:
        name, path, body = kind
        twin_name, twin_path, twin = benign_twin(kind, count)
        costly, benign = _validated(tokenizer, path, body), _validated(tokenizer, path, twin)
        assert (twin_name, twin_path) == (f"benign twin of {name}", path)
        assert len(benign.prompt_token_ids) == len(costly.prompt_token_ids), name
        assert (benign.max_tokens, benign.n) == (costly.max_tokens, costly.n), name
        assert not set(twin) & set(_UNPAID), name
        assert len(twin.get("messages", [None])) == 1, name
    name, path, twin = benign_twin(CANCELLED)
    assert (path, twin["max_tokens"]) == ("grpc", 1)  # run to its end, not cancelled
