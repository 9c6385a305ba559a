"""Turns one request's upstream TokenEvents into client GenerateResponses: detokenizer,
then stop strings, and usage; no I/O."""

from __future__ import annotations

from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopStringMatcher
from gateway.text.tokenizer import Tokenizer
from gateway.validation import ValidatedRequest
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2

_UNFINISHED = sampling_pb2.FINISH_REASON_UNSPECIFIED


class OutputStream:
    """Per-request output state; `finished` turns true with the last response. After a
    stop string matches, the event's remaining tokens are dropped and the caller must
    cancel upstream."""

    def __init__(self, request: ValidatedRequest, tokenizer: Tokenizer):
        self._request_id = request.request_id
        self._num_prompt_tokens = len(request.prompt_token_ids)
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = StopStringMatcher(request.stop)
        self.num_generated_tokens = 0
        self.token_ids: list[int] = []  # generated so far (a continuation resumes after them)
        self.finish_reason = _UNFINISHED
        # True when a stop string (not the model) ended the stream: upstream is still running.
        self.stopped_by_string = False

    @property
    def finished(self) -> bool:
        return self.finish_reason != _UNFINISHED

    def on_event(self, event: scheduler_pb2.TokenEvent) -> generation_pb2.GenerateResponse:
        """Returns the response for one event (its text may be "" while text is held back)."""
        assert not self.finished, "event after the stream finished"
        response = generation_pb2.GenerateResponse(request_id=self._request_id)
        texts: list[str] = []
        for index, token_id in enumerate(event.token_ids):
            response.token_ids.append(token_id)
            self.token_ids.append(token_id)
            if index < len(event.logprobs):
                response.logprobs.append(event.logprobs[index])
            self.num_generated_tokens += 1
            result = self._stop.feed(self._detokenizer.add((token_id,)))
            texts.append(result.text)
            if result.stopped:
                self.stopped_by_string = True
                return self._finish(response, texts, sampling_pb2.FINISH_REASON_STOP)
        if event.finish_reason != _UNFINISHED:
            result = self._stop.feed(self._detokenizer.flush())
            texts.append(result.text)
            if result.stopped:
                self.stopped_by_string = True
                return self._finish(response, texts, sampling_pb2.FINISH_REASON_STOP)
            texts.append(self._stop.flush())
            return self._finish(response, texts, event.finish_reason)
        response.text = "".join(texts)
        return response

    def _finish(
        self,
        response: generation_pb2.GenerateResponse,
        texts: list[str],
        reason: sampling_pb2.FinishReason,
    ) -> generation_pb2.GenerateResponse:
        self.finish_reason = reason
        response.text = "".join(texts)
        response.finish_reason = reason
        response.usage.prompt_tokens = self._num_prompt_tokens
        response.usage.completion_tokens = self.num_generated_tokens
        response.usage.total_tokens = self._num_prompt_tokens + self.num_generated_tokens
        return response
