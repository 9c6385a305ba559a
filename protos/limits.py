"""Request limits that both the gateway and the scheduler enforce.

The gateway checks a client's request against them; the scheduler checks every
SubmitRequest again, because its internal plane must not trust whoever reaches
it (a gateway with a bug, or a caller holding the internal secret). Services
never import each other, so the numbers live here, next to the wire contracts.
Limits that depend on the model (vocabulary, context) come from the executor's
Hello instead.
"""

from __future__ import annotations

# Identifiers: printable ASCII (" " to "~"), at most this many characters.
MAX_REQUEST_ID_CHARS = 128
MAX_TENANT_CHARS = 128
# What the scheduler accepts in SubmitRequest.request_id: room for the suffix the
# gateway gives each choice of an n > 1 request ("-15").
MAX_SUBMIT_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS + 8
# Top alternatives per generated token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# Extra stop token ids per request: a stop list as large as the vocabulary
# with min_tokens > 0 leaves the sampler nothing it may pick.
MAX_STOP_TOKEN_IDS = 128
# logit_bias: at most this many token ids (OpenAI's limit), each bias in
# [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS].
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
# Structured output: a JSON schema, regex or grammar of at most this many bytes.
MAX_GUIDED_BYTES = 64 * 1024
# Tools (function calling): at most this many per request (OpenAI's limit), names of
# at most this many characters, and this many bytes of names, descriptions and
# parameter schemas together, so that "required"'s grammar over all of them stays
# within MAX_GUIDED_BYTES.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 64
MAX_TOOLS_BYTES = 48 * 1024
# presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range).
MAX_PENALTY = 2.0
# temperature lies in [0, MAX_TEMPERATURE] (OpenAI's range), on every API.
MAX_TEMPERATURE = 2.0
# repetition_penalty lies in (0, MAX_REPETITION_PENALTY]: far past any useful value, and
# within a float32.
MAX_REPETITION_PENALTY = 1e6
# Completions per request (n): each is a running sequence (OpenAI allows 128).
MAX_N = 16
# Stop strings: at most this many per request, each at most this many bytes of UTF-8
# (OpenAI allows 4 stop sequences; TGI's max_stop_sequences defaults to 4).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
# Client values quoted in an error message or a log line: at most this many characters
# of one (protos/echo.py), so a 900 KB model name comes back as a short 400.
MAX_ECHO_CHARS = 100
# A library's diagnostic that may quote client input (llguidance's grammar errors, a
# chat template's, an exception's): at most this many characters of it.
MAX_DIAGNOSTIC_CHARS = 400
