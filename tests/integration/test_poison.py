"""Poison requests under ``continuum serve`` (executor_svc/faults.py injects them): one
whose step makes the executor raise, one whose step kills the executor process, and one
whose own sampling row raises, are each ended alone with an error, while the requests that
share their batches finish with exactly the greedy text of a run without them; the server
never stops. The row failure costs the others nothing: no failed step, no recompute."""

from __future__ import annotations

import concurrent.futures
import os

import openai
import pytest
from tokenizers import Tokenizer

from executor_svc.faults import ENV_FAULT_INJECT
from tests.integration.conftest import start_server

pytestmark = pytest.mark.integration

NORMAL = [f"Here is a short story about the number {i}:" for i in range(4)]
RAISE_PROMPT = "Describe the Zanzibar archipelago in one sentence:"
EXIT_PROMPT = "Describe a quokka in one sentence:"
ROW_PROMPT = "Describe the Okavango delta in one sentence:"
MAX_TOKENS = 8


def unique_token(tok: Tokenizer, prompt: str) -> int:
    """A token id of ``prompt`` that no other prompt of this file contains."""
    others = set()
    for text in [*NORMAL, RAISE_PROMPT, EXIT_PROMPT, ROW_PROMPT]:
        if text != prompt:
            others |= set(tok.encode(text).ids)
    return max(set(tok.encode(prompt).ids) - others)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    spec = (f"raise_on_token={unique_token(tok, RAISE_PROMPT)},"
            f"exit_on_token={unique_token(tok, EXIT_PROMPT)},"
            f"row_mask={unique_token(tok, ROW_PROMPT)}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_FAULT_INJECT, spec)  # inherited by the executor `serve` starts
        srv = start_server(tmp_path_factory.mktemp("poison"), model_dir)
    assert os.environ.get(ENV_FAULT_INJECT) is None
    yield srv
    assert srv.proc.poll() is None, "the server stopped:\n" + "".join(srv.log[-30:])
    srv.stop()


def complete(server, prompt: str) -> str:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                           timeout=180)
    answer = client.completions.create(model="", prompt=prompt, max_tokens=MAX_TOKENS,
                                       temperature=0)
    return answer.choices[0].text


def run_together(server, poison: str):
    """The normal prompts and ``poison`` at once; (texts, the poison's error)."""
    with concurrent.futures.ThreadPoolExecutor(len(NORMAL) + 1) as pool:
        normal = [pool.submit(complete, server, p) for p in NORMAL]
        bad = pool.submit(complete, server, poison)
        texts = [f.result() for f in normal]
        with pytest.raises(openai.APIStatusError) as err:
            bad.result()
    return texts, err.value


@pytest.fixture(scope="module")
def baseline(server) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(len(NORMAL)) as pool:  # greedy: batch-blind
        return list(pool.map(lambda p: complete(server, p), NORMAL))


def test_a_step_that_raises_fails_only_its_request(server, baseline):
    texts, err = run_together(server, RAISE_PROMPT)
    assert texts == baseline
    assert err.status_code >= 500 and "failed" in str(err.message)
    assert server.stats().num_executor_losses == 0
    assert complete(server, NORMAL[0]) == baseline[0]  # still serving


def test_a_request_that_kills_the_executor_fails_alone(server, baseline):
    losses = server.stats().num_executor_losses
    texts, err = run_together(server, EXIT_PROMPT)
    assert texts == baseline
    assert err.status_code >= 500 and "failed 2 times" in str(err.message)
    # Two deaths: the shared step, then its step alone (serve allows 5 in 120 s by default).
    assert server.stats().num_executor_losses - losses == 2
    assert server.proc.poll() is None
    assert complete(server, NORMAL[1]) == baseline[1]


def test_a_request_whose_own_row_fails_ends_alone_and_costs_the_others_nothing(server,
                                                                             baseline):
    before = server.stats()
    texts, err = run_together(server, ROW_PROMPT)
    after = server.stats()
    assert texts == baseline
    assert err.status_code == 500 and "(mask)" in str(err.message)
    assert after.num_row_failures - before.num_row_failures == 1
    assert (after.num_failed_steps, after.num_resyncs, after.num_recomputed_tokens,
            after.num_executor_dropped_sequences, after.num_executor_losses) == (
        before.num_failed_steps, before.num_resyncs, before.num_recomputed_tokens,
        before.num_executor_dropped_sequences, before.num_executor_losses)
