"""The one admit step both front ends run before the relay: API keys, routing headers,
validation, and the parse guard that makes any parsing failure a 400."""
