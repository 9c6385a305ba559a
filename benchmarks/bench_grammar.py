"""Structured output's grammar engines side by side, llguidance (the executor's) against
xgrammar (measured only where installed), on the bundled model's tokenizer: the tokenizer
build, each schema's compile, and per generated token the mask, its application to a
logits row and the token consumed (one torch thread), walking a valid instance of each
schema, engines alternating per schema.

    .venv/bin/python -m benchmarks.bench_grammar [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

SCHEMAS = {
    "flat object": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "admin": {"type": "boolean"}},
        "required": ["name", "age", "admin"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "admin": True}),
    "nested + enum + array": ({"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "object", "properties": {
            "day": {"type": "string"}, "high": {"type": "number"}},
            "required": ["day", "high"], "additionalProperties": False}}},
        "required": ["city", "unit", "days"], "additionalProperties": False},
        {"city": "Paris", "unit": "celsius",
         "days": [{"day": "Mon", "high": 21.5}, {"day": "Tue", "high": 19.0}]}),
    "tool call": ({"type": "object", "properties": {
        "name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
            "location": {"type": "string"}, "when": {"type": "string"}},
            "required": ["location"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
        {"name": "get_weather", "arguments": {"location": "Berlin", "when": "today"}}),
}


class _LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab: int, eos: int) -> None:
        import llguidance

        self.ll, self.vocab = llguidance, vocab
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=[eos])

    def compile(self, schema: str):
        return self.ll.LLMatcher.grammar_from_json_schema(schema)

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled, log_level=0)

    def step(self, m, logits: torch.Tensor, token: int) -> None:
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)  # as executor_svc/guided.py
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]]
        logits[torch.from_numpy(allowed == 0)] = float("-inf")
        assert logits[token] != float("-inf"), "the instance's token was masked"
        m.consume_token(token)


class _XGrammar:
    name = "xgrammar"

    def __init__(self, model_dir: str, vocab: int) -> None:
        import transformers
        import xgrammar

        self.xgr, self.vocab = xgrammar, vocab
        hf = transformers.AutoTokenizer.from_pretrained(model_dir)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def step(self, m, logits: torch.Tensor, token: int) -> None:
        m.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(logits.view(1, -1), self.bitmask)
        assert logits[token] != float("-inf"), "the instance's token was masked"
        assert m.accept_token(token)


def _ms(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def _measure(engine, schema: str, tokens: list[int], rounds: int) -> dict:
    # Until a request's matcher exists: llguidance compiles lazily, in its matcher.
    compile_ms = [_ms(lambda: engine.matcher(engine.compile(schema))) for _ in range(rounds)]
    compiled = engine.compile(schema)
    per_token = []
    for _ in range(rounds):
        m = engine.matcher(compiled)
        for tok in tokens:
            logits = torch.zeros(engine.vocab)
            per_token.append(_ms(lambda m=m, tok=tok, logits=logits:
                                 engine.step(m, logits, tok)))
    per_token.sort()
    return {"compile_ms": statistics.median(compile_ms),
            "mask_ms_p50": per_token[len(per_token) // 2],
            "mask_ms_p99": per_token[min(len(per_token) - 1, int(len(per_token) * 0.99))]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_grammar")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--engines", default="llguidance,xgrammar")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a 49k-row mask is too small to split; threads only add noise
    from tokenizers import Tokenizer

    from harness.servers import model_dir

    mdir = model_dir()
    config = json.loads((mdir / "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    text = (mdir / "tokenizer.json").read_text()
    hf_tok = Tokenizer.from_str(text)
    engines, builds = [], {}
    makers = {"llguidance": lambda: _LLGuidance(text, vocab, eos),
              "xgrammar": lambda: _XGrammar(str(mdir), vocab)}
    for name in args.engines.split(","):
        if name not in makers:
            p.error(f"--engines: {name!r} is not one of {', '.join(makers)}")
        make = makers[name]
        try:
            t = time.perf_counter()
            engine = make()
            builds[engine.name] = (time.perf_counter() - t) * 1e3
            engines.append(engine)
        except ImportError as exc:
            print(f"skipped: {exc.name} is not installed")
    rows = []
    for title, (schema, instance) in SCHEMAS.items():
        tokens = hf_tok.encode(json.dumps(instance), add_special_tokens=False).ids
        for engine in engines:  # same schema, each engine in turn
            rows.append({"schema": title, "engine": engine.name, "tokens": len(tokens),
                         **_measure(engine, json.dumps(schema), tokens, args.rounds)})
    print("| engine | tokenizer build ms | schema | tokens | compile+matcher ms "
          "| mask+apply ms p50 | p99 |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {builds[r['engine']]:.0f} | {r['schema']} | {r['tokens']} "
              f"| {r['compile_ms']:.2f} | {r['mask_ms_p50']:.3f} | {r['mask_ms_p99']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"builds_ms": builds, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
