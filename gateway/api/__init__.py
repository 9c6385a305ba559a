"""The OpenAI-compatible HTTP API: routes, the two dialects and their field readers, the
body decoder, error replies, the fuzzer's field schema and /openapi.json."""
