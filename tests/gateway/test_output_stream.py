"""TokenEvents → GenerateResponses: text deltas, stop strings across tokens, usage."""

from __future__ import annotations

from gateway.text.output_stream import OutputStream
from gateway.validation import ValidatedRequest
from protos.continuum.v1 import sampling_pb2, scheduler_pb2

FINISH_STOP = sampling_pb2.FINISH_REASON_STOP
FINISH_LENGTH = sampling_pb2.FINISH_REASON_LENGTH


def _request(stop=(), num_prompt_tokens=5):
    return ValidatedRequest(
        request_id="r1",
        prompt_token_ids=tuple(range(num_prompt_tokens)),
        sampling=sampling_pb2.SamplingParams(),
        max_tokens=64,
        stop=tuple(stop),
        tenant="default",
        tier=1,
    )


def _events(token_ids, finish=FINISH_LENGTH, per_event=1):
    chunks = [token_ids[i : i + per_event] for i in range(0, len(token_ids), per_event)]
    events = [scheduler_pb2.TokenEvent(token_ids=chunk) for chunk in chunks]
    events[-1].finish_reason = finish
    return events


def _collect(output, events):
    responses = []
    for event in events:
        responses.append(output.on_event(event))
        if output.finished:
            break
    return responses


def test_text_and_usage_of_a_plain_stream(tokenizer):
    ids = tokenizer.encode("The capital of France is Paris. 😀")
    output = OutputStream(_request(num_prompt_tokens=7), tokenizer)
    responses = _collect(output, _events(ids))
    assert "".join(r.text for r in responses) == "The capital of France is Paris. 😀"
    assert [t for r in responses for t in r.token_ids] == ids
    assert all(r.request_id == "r1" for r in responses)
    last = responses[-1]
    assert last.finish_reason == FINISH_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (7, len(ids))
    assert last.usage.total_tokens == 7 + len(ids)
    assert all(r.finish_reason == sampling_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])


def test_stop_string_spanning_tokens_ends_the_stream_early(tokenizer):
    ids = tokenizer.encode("Paris is nice. Question: what else?")
    output = OutputStream(_request(stop=["Question:"]), tokenizer)
    responses = _collect(output, _events(ids, per_event=2))
    assert "".join(r.text for r in responses) == "Paris is nice. "
    assert responses[-1].finish_reason == FINISH_STOP
    assert output.stopped_by_string
    # Tokens after the one that completed the stop string are not counted or returned.
    sent = [t for r in responses for t in r.token_ids]
    assert sent == ids[: len(sent)] and len(sent) < len(ids)
    assert responses[-1].usage.completion_tokens == len(sent)
    assert tokenizer.decode(sent).endswith("Question:")


def test_model_eos_is_counted_but_not_shown(tokenizer):
    ids = [*tokenizer.encode("Paris."), 2]
    output = OutputStream(_request(), tokenizer)
    responses = _collect(output, _events(ids, finish=FINISH_STOP))
    assert "".join(r.text for r in responses) == "Paris."
    assert responses[-1].usage.completion_tokens == len(ids)
    assert not output.stopped_by_string


def test_held_back_partial_stop_is_released_at_finish(tokenizer):
    ids = tokenizer.encode("the end is Quest")
    output = OutputStream(_request(stop=["Question:"]), tokenizer)
    responses = _collect(output, _events(ids))
    assert "".join(r.text for r in responses) == "the end is Quest"
    assert responses[-1].finish_reason == FINISH_LENGTH


def test_finish_event_without_tokens(tokenizer):
    ids = tokenizer.encode("abc")
    events = [
        scheduler_pb2.TokenEvent(token_ids=ids),
        scheduler_pb2.TokenEvent(finish_reason=FINISH_STOP),
    ]
    output = OutputStream(_request(), tokenizer)
    responses = _collect(output, events)
    assert [r.text for r in responses] == ["abc", ""]
    assert list(responses[1].token_ids) == []
    assert responses[1].usage.completion_tokens == len(ids)


def test_logprobs_are_relayed_per_token(tokenizer):
    logprob = sampling_pb2.TokenLogprob(
        token_id=42, logprob=-0.5, top_token_ids=[42, 7], top_logprobs=[-0.5, -1.5]
    )
    event = scheduler_pb2.TokenEvent(
        token_ids=[42], logprobs=[logprob], finish_reason=FINISH_LENGTH
    )
    response = OutputStream(_request(), tokenizer).on_event(event)
    assert list(response.logprobs) == [logprob]
