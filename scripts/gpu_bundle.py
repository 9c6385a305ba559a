"""Packs what scripts/gpu_check.sh needs on a lent GPU machine, which reaches no network
and receives at most 64 MiB of files beside the repository (the device tool's limits).

    .venv/bin/python scripts/gpu_bundle.py        # writes .gpu/ (ignored by git)

``.gpu/whl/``: wheels for the packages that machine's Python 3.12 image lacks or has in a
version our generated protobuf code refuses (its image already has torch, transformers,
numba, tokenizers, safetensors, numpy). ``.gpu/model.gguf``: the bundled SmolLM2-135M with
its first ``--layers`` transformer blocks only (the whole GGUF is 98 MB): the same
tokenizer, embeddings and head, few enough bytes to carry. Token-exactness against
transformers does not need all 30 layers; both load the same truncated file.
``.gpu/azure_sample.csv``: every k-th row of the Azure conversation trace (``--trace``;
default $CONTINUUM_DATA_DIR/traces/, else ../shared/data/traces/ beside the repository),
``--trace-rows`` of them: the length mix of scripts/gpu_bench.py's serving run.

Then, with the device tool, carry ``.gpu`` and ``protos/continuum/v1`` (the generated
code is ignored by git) and run ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

import gguf

from executor_svc.model_files import bundled_gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Pinned as in pyproject.toml; gguf brings no dependency the image lacks.
# llguidance: executor_svc/guided.py (imported by the executor at start), not in the image.
WHEELS = ("protobuf==7.36.2", "pyzmq==27.3.0", "structlog==26.1.0", "gguf==0.19.0",
          "llguidance==1.9.1")
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")


def truncate_gguf(src: pathlib.Path, dst: pathlib.Path, num_layers: int) -> None:
    """Copies ``src`` without its transformer blocks from ``num_layers`` on (metadata, the
    tokenizer and the other tensors as they are; block_count says ``num_layers``)."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == f"{arch}.block_count":
            if value < num_layers:
                raise SystemExit(f"--layers {num_layers}: the model has only {value}")
            value = num_layers
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [t for t in reader.tensors
            if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < num_layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()


def default_trace() -> pathlib.Path:
    data = os.environ.get("CONTINUUM_DATA_DIR")
    base = pathlib.Path(data) if data else ROOT.parent / "shared" / "data"
    return base / "traces" / "azure_conv_2023.csv"


def sample_trace(src: pathlib.Path, dst: pathlib.Path, rows: int) -> int:
    """Every k-th data row of ``src`` (the header kept), at most ``rows``: the same length
    mix in a few tens of KiB. Returns the rows written."""
    lines = src.read_text().splitlines()
    header, data = lines[0], lines[1:]
    step = max(1, len(data) // rows)
    kept = data[::step][:rows]
    dst.write_text("\n".join([header, *kept]) + "\n")
    return len(kept)


def download_wheels(dest: pathlib.Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                    "cp", *platforms, "-d", str(dest), *WHEELS], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6,
                        help="transformer blocks to keep (the carried model's size)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / ".gpu")
    parser.add_argument("--trace", type=pathlib.Path, default=default_trace())
    parser.add_argument("--trace-rows", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers must be positive")
    args.out.mkdir(exist_ok=True)
    truncate_gguf(bundled_gguf(), args.out / "model.gguf", args.layers)
    if not args.trace.exists():
        parser.error(f"--trace {args.trace}: no such file (the Azure conversation trace)")
    sample_trace(args.trace, args.out / "azure_sample.csv", args.trace_rows)
    download_wheels(args.out / "whl")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.out}: {total / 2**20:.1f} MiB (the device tool carries at most 64 MiB, "
          "the repository included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
