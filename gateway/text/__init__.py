"""Text in (tokenizer, chat template, special tokens kept as text) and text out
(incremental detokenization, stop strings across deltas)."""
