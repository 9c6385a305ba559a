"""Lower precision against fp32 on the bundled model (or ``--model``): bf16 and fp16
weights and activations read fp32's greedy continuations of harness/prompts.py's prompts
(teacher forcing), and at each position the next-token distributions are compared
(harness/precision.py: top-1 agreement, KL, how near a tie each disagreement was),
against the tolerance the tests hold bf16 to.

    .venv/bin/python -m benchmarks.bench_precision [--device cuda] [--max-new 32]
"""

from __future__ import annotations

import argparse

import torch

from executor_svc.model_files import resolve_model
from executor_svc.models.decoder import DecoderModel
from executor_svc.settings import Switches
from harness import precision
from harness.prompts import MORE_PROMPTS, PROMPTS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_precision",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf or HF directory (default: "
                        "the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--max-new", type=int, default=32, help="tokens per continuation")
    args = parser.parse_args(argv)
    if args.max_new < 1:
        parser.error("--max-new must be positive")
    from tokenizers import Tokenizer

    directory = resolve_model(args.model, Switches.from_env().cache_dir)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    device = torch.device(args.device)
    fp32 = DecoderModel.load(directory, device=device)
    prompts = [tok.encode(text).ids for text in PROMPTS + MORE_PROMPTS]
    sequences = precision.greedy_sequences(fp32, prompts, args.max_new)
    print(f"against fp32 on {args.device}, {len(prompts)} prompts x {args.max_new} tokens; "
          f"tolerance: top-1 >= {precision.MIN_TOP1_AGREEMENT:.0%}, mean KL <= "
          f"{precision.MAX_MEAN_KL} nats, disagreements within "
          f"{precision.MAX_TIE_MARGIN} logit of a tie")
    for dtype in (torch.bfloat16, torch.float16):
        result = precision.compare(fp32, DecoderModel.load(directory, dtype=dtype,
                                                           device=device), sequences)
        verdict = "within" if result.within_tolerance() else "OUTSIDE"
        print(f"{str(dtype).removeprefix('torch.'):>9}: {result.row()} ({verdict})")


if __name__ == "__main__":
    main()
