"""The OpenAI-compatible HTTP API: the aiohttp routes (`http_api.py`: completions, chat
completions with SSE, models, tokenize and detokenize), the two OpenAI dialects that turn
bodies into `GenerateRequest`s and responses back (`openai_api.py`, `openai_fields.py`),
the body decoder, the error replies in OpenAI's shapes, `openai_schema.py`, the
fields' schema the fuzzer generates bodies from, and `openapi_doc.py`, the OpenAPI
document served at /openapi.json. Connection-level defences are
gateway/edge/'s; what the body then goes through is gateway/admit/'s.
"""
