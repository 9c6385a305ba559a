"""The model's tokenizer, read from a Hugging Face-format model directory with the
`tokenizers` library only: `tokenizer.json` (required), `tokenizer_config.json` (special
tokens, often `chat_template`), `chat_template.jinja` (wins over the config's, as in
transformers) and `config.json` (`vocab_size`, `max_position_embeddings`, `eos_token_id`)."""

from __future__ import annotations

import copy
import json
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers

from gateway.structured.guided_check import GuidedCheck
from gateway.text.chat_template import ChatTemplate, ChatTemplateError
from gateway.text.special_tokens import SpecialTokenEscape

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers writes "no limit" as a huge model_max_length; anything above this is not a limit.
_UNBOUNDED_MODEL_MAX_LENGTH = 10**8


class ModelFilesError(Exception):
    """The model directory is missing a file or holds one we cannot use."""


@dataclass(frozen=True)
class ModelInfo:
    """What request validation needs to know about the model."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    # The longest token's text in characters (at least 1): text longer than
    # max_model_len x this cannot fit the context, so it is refused untokenized.
    max_token_chars: int = 64


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFilesError(f"cannot read {path}: {exc}") from exc


def _token_content(value: Any) -> str | None:
    # Special tokens are saved either as plain strings or as serialized AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_source(model_dir: pathlib.Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        # Several named templates: serving uses the default one.
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default")
    return source if isinstance(source, str) else None


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def _model_info(
    config: Mapping[str, Any],
    tokenizer_config: Mapping[str, Any],
    backend: tokenizers.Tokenizer,
    eos_token: str | None,
) -> ModelInfo:
    vocab_size = config.get("vocab_size") or backend.get_vocab_size(with_added_tokens=True)
    max_len = config.get("max_position_embeddings")
    if not isinstance(max_len, int):
        fallback = tokenizer_config.get("model_max_length")
        if isinstance(fallback, int) and fallback < _UNBOUNDED_MODEL_MAX_LENGTH:
            max_len = fallback
    if not isinstance(max_len, int) or max_len <= 0:
        raise ModelFilesError(
            "config.json has no max_position_embeddings; pass --max-model-len explicitly"
        )
    eos_ids = _as_id_tuple(config.get("eos_token_id"))
    if not eos_ids and eos_token is not None and backend.token_to_id(eos_token) is not None:
        eos_ids = (backend.token_to_id(eos_token),)
    # Vocabulary strings are the pre-decoding form (byte-level BPE writes a byte
    # as one character), so a token's text is never more characters than this.
    longest = max(map(len, backend.get_vocab(with_added_tokens=True)), default=1)
    return ModelInfo(vocab_size=int(vocab_size), max_model_len=max_len, eos_token_ids=eos_ids,
                     max_token_chars=max(longest, 1))


class Tokenizer:
    """Text ⇄ token ids for one model, plus its chat template and limits. `encode` is
    transformers' `tokenizer(text)`; `encode_chat` renders the template and encodes it
    without adding special tokens, client special-token text as text (special_tokens.py)
    unless this is a `trusting_content()` copy."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        info: ModelInfo,
        chat_template: ChatTemplate | None,
    ):
        self._backend = backend
        self.info = info
        self.chat_template = chat_template
        self._escape = SpecialTokenEscape(backend)
        # Whether special-token strings in client text become the tokens themselves.
        self.trusts_content = False
        # Structured-output specs compiled against this tokenizer, as the executor will.
        self.guided = GuidedCheck(backend.to_str, info.vocab_size, info.eos_token_ids)

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path, max_model_len: int | None = None) -> Tokenizer:
        model_dir = pathlib.Path(model_dir)
        if not model_dir.is_dir():
            raise ModelFilesError(f"model dir {model_dir} does not exist; pass --model-dir")
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelFilesError(
                f"{model_dir} has no tokenizer.json (need a Hugging Face-format model dir)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise ModelFilesError(f"cannot load {tokenizer_file}: {exc}") from exc
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        config = _read_json(model_dir / "config.json")
        special = {
            key: text
            for key in _SPECIAL_TOKEN_KEYS
            if (text := _token_content(tokenizer_config.get(key))) is not None
        }
        if max_model_len is not None:
            config = {**config, "max_position_embeddings": max_model_len}
        info = _model_info(config, tokenizer_config, backend, special.get("eos_token"))
        source = _template_source(model_dir, tokenizer_config)
        template = ChatTemplate(source, special) if source is not None else None
        return cls(backend, info, template)

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[Mapping], tools: list[dict] | None = None) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send prompt or token_ids")
        return self.chat_template.render(messages, add_generation_prompt=True, tools=tools)

    def encode_chat(self, messages: Sequence[Mapping], tools: list[dict] | None = None
                    ) -> list[int]:
        if self.trusts_content or not self._escape.found_in(messages, tools):
            text = self.render_chat(messages, tools)
            return self._backend.encode(text, add_special_tokens=False).ids
        masking = self._escape.masking()
        text = self.render_chat(masking.apply(messages), masking.apply(tools))
        return self._escape.encode(text, masking)

    def trusting_content(self) -> Tokenizer:
        """A copy (sharing the backend) whose `encode_chat` lets special-token strings in
        client text be the tokens themselves (docs/security.md)."""
        trusting = copy.copy(self)
        trusting.trusts_content = True
        return trusting

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special_tokens=True)` drops."""
        return self._escape.special_ids

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
