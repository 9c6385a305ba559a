"""Structured-output specs compiled against the served tokenizer before admission, in
low-priority worker processes, verdicts cached and compile time bounded."""
