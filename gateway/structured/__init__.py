"""Structured output checked before admission: a spec (JSON schema, regex, grammar, a
forced tool call) is compiled against the served tokenizer as the executor will compile
it, verdicts cached and compile time bounded (`guided_check.py`), in child processes at
the lowest CPU share so a flood of costly specs takes no core from the executor
(`compile_worker.py`).
"""
