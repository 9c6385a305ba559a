"""Everything textual: the tokenizer, model info and chat template read from a model
directory (`tokenizer.py`, `chat_template.py`), special-token text in client content kept
as text (`special_tokens.py`), and on the way back one request's token events turned into
responses (`output_stream.py`) through incremental detokenization and stop strings
matched across deltas (`detokenizer.py`, `stop_strings.py`).
"""
