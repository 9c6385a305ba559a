"""A GGUF file's tokenizer as the ``tokenizer.json`` and ``tokenizer_config.json`` that
transformers builds from the same file (tests/executor/test_model_files.py compares the
two, token for token). A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, its
token types, merges (byte-level BPE) or scores (SentencePiece) and the special token ids as
metadata. Two kinds are read:

* byte-level BPE (``tokenizer.ggml.model`` gpt2: SmolLM2, Llama 3, Qwen). The
  pre-tokenizer's split regex is chosen by ``tokenizer.ggml.pre`` (an architecture adds
  its family's own).
* SentencePiece BPE with byte fallback (llama.cpp names it after its first family), for an
  architecture that declares how its family's files spell it
  (``Architecture.gguf_sentencepiece``). Gemma's files list no merges; they are rebuilt
  from the vocabulary, ranked by the order the tokens appear in (Gemma's scores do not
  follow its merge order), and a token of spaces only is stored as spaces where the
  vocabulary writes "▁". Other SentencePiece families (Llama 2's Metaspace form) are
  refused by name rather than tokenized differently from transformers.

Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
tokens, so neither is cut into pieces; BOS / EOS are added by a post-processor where the
file asks for them, as transformers' tokenizers do.
"""

from __future__ import annotations

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from executor_svc.models.base import GGUF_BYTE_LEVEL, GGUF_SENTENCEPIECE, Architecture, PreTokenizer

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's visible space

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as transformers' GGUF loader sets them; any other
# value keeps GPT-2's ByteLevel regex (transformers does the same).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# An architecture adds its family's own (Architecture.gguf_pre_tokenizers).
_PRE_TOKENIZERS = {
    name: PreTokenizer(_LLAMA3_SPLIT)
    for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")
}


def sentencepiece_families() -> list[str]:
    from executor_svc.models import registry

    return [a.name for a in registry.ARCHITECTURES if a.gguf_sentencepiece]


class ConversionError(ValueError):
    """The GGUF file describes something this converter cannot turn into an HF dir."""


def build_tokenizer(meta: dict, arch: Architecture) -> Tokenizer:
    """The file's tokenizer (ConversionError for a kind this architecture's files do not
    use)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == GGUF_BYTE_LEVEL:
        tok = _byte_level(meta, arch)
    elif kind == GGUF_SENTENCEPIECE and arch.gguf_sentencepiece:
        tok = _sentencepiece(meta)
    else:
        raise ConversionError(
            f"tokenizer {kind!r} of a GGUF {arch.name} file is not supported (byte-level "
            f"BPE, {GGUF_BYTE_LEVEL!r}, for every architecture; SentencePiece, "
            f"{GGUF_SENTENCEPIECE!r}, for those whose files' form is known: "
            f"{', '.join(sentencepiece_families())}); convert the model to a Hugging Face "
            "directory instead")
    tok.post_processor = _post_processor(meta)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table (same as transformers').
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def _byte_level(meta: dict, arch: Architecture) -> Tokenizer:
    """Byte-level BPE matching transformers' GGUF tokenizer (GPT2Tokenizer + control tokens)."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False)
    )
    pre = {**_PRE_TOKENIZERS, **arch.gguf_pre_tokenizers}.get(meta.get("tokenizer.ggml.pre"))
    if pre is not None and pre.nfc:
        tok.normalizer = normalizers.NFC()
    if pre is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel and is
    # skipped, as transformers does.
    _add_typed_tokens(tok, tokens, types, vocab, lambda t: set(t) <= alphabet)
    return tok


def _sentencepiece(meta: dict) -> Tokenizer:
    """SentencePiece BPE in Gemma's form: spaces as "▁" (a normalizer), split after each
    space, bytes past the vocabulary as <0xNN> tokens, merges rebuilt (module docstring)."""
    tokens = [_SPACE * len(t) if " " in t and not t.strip() else t
              for t in meta["tokenizer.ggml.tokens"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(
        vocab=vocab, merges=_merges_by_position(tokens, vocab), fuse_unk=True,
        unk_token=tokens[unk_id] if unk_id is not None else "<unk>", dropout=None,
        byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_typed_tokens(tok, meta["tokenizer.ggml.tokens"],
                      meta.get("tokenizer.ggml.token_type") or [], vocab, lambda t: True)
    return tok


def _merges_by_position(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens is a merge; a token earlier in the
    file merges first, and among one token's splits the one whose parts come first."""
    rank = {token: -index for index, token in enumerate(tokens)}  # a repeat keeps its last
    merges = []
    for token, score in rank.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(left, right) for left, right in splits if left in vocab and right in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in splits)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_typed_tokens(tok: Tokenizer, tokens, types, vocab: dict[str, int], control_ok) -> None:
    """Control tokens as special added tokens (those ``control_ok`` accepts), user-defined
    ones already in ``vocab`` as plain added tokens: both then stay whole."""
    control = [t for t, kind in zip(tokens, types, strict=False)
               if kind == _TOKEN_TYPE_CONTROL and control_ok(t)]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    known = set(vocab) | set(control)
    tok.add_tokens([
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == _TOKEN_TYPE_USER_DEFINED and t in known
    ])


def _post_processor(meta: dict) -> processors.TemplateProcessing:
    """BOS before (and EOS after) each sequence where the file asks (``_adds``)."""
    tokens = meta["tokenizer.ggml.tokens"]
    parts, special = [], []
    for key in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        wanted = _adds(meta, key)
        if wanted and token_id is not None:
            parts.append((key, tokens[token_id]))
            special.append((tokens[token_id], token_id))
    bos = [t for key, t in parts if key == "bos"]
    eos = [t for key, t in parts if key == "eos"]
    single = " ".join([*(f"{t}:0" for t in bos), "$A:0", *(f"{t}:0" for t in eos)])
    pair = " ".join([single, *(f"{t}:1" for t in bos), "$B:1", *(f"{t}:1" for t in eos)])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _adds(meta: dict, key: str) -> bool:
    """Whether the tokenizer adds a ``key`` ("bos" / "eos") token: the file's flag; with
    none, BOS for SentencePiece, as llama.cpp and transformers read an old file."""
    default = key == "bos" and meta.get("tokenizer.ggml.model") == GGUF_SENTENCEPIECE
    return bool(meta.get(f"tokenizer.ggml.add_{key}_token", default))


def build_tokenizer_config(meta: dict, max_len: int, arch: Architecture) -> dict:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template
    (the file's, else the architecture's own for files that carry none)."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []

    def token(key: str):
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": _adds(meta, "bos"),
        "add_eos_token": _adds(meta, "eos"),
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [
            t for t, kind in zip(tokens, types, strict=False) if kind == _TOKEN_TYPE_CONTROL
        ],
    }
    template = meta.get("tokenizer.chat_template") or arch.gguf_chat_template
    if template:
        config["chat_template"] = template
    return config
