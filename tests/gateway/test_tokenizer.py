"""The gateway tokenizer against transformers, the reference implementation."""

from __future__ import annotations

import json
import shutil

import pytest
import tokenizers
from tokenizers import processors

from gateway.text.chat_template import ChatTemplate, ChatTemplateError
from gateway.text.tokenizer import ModelFilesError, Tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "héllo wörld — naïve café",
    "日本語のテキストと中文",
    "emoji 😀👍🏽 and a family 👨‍👩‍👧",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # don't",
    "<|im_start|>user\nspecial tokens in raw text<|im_end|>",
    "1234567890 3.14159",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Ünïcödé 😀 日本"},
    ],
    [{"role": "user", "content": ""}],
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages):
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.render_chat(messages) == expected
    expected_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert tokenizer.encode_chat(messages) == expected_ids


def test_default_system_prompt_is_added(tokenizer):
    text = tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


def test_model_info_from_config(tokenizer):
    assert tokenizer.info.vocab_size == 49152
    assert tokenizer.info.max_model_len == 8192
    assert tokenizer.info.eos_token_ids == (2,)


def _copy_tokenizer_files(model_dir, dest):
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, dest / name)
    return dest


def test_chat_template_jinja_file_wins(model_dir, tmp_path):
    _copy_tokenizer_files(model_dir, tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "


def test_rendered_bos_is_not_added_twice(model_dir, tmp_path):
    """A model whose post-processor adds BOS and whose template writes it too."""
    _copy_tokenizer_files(model_dir, tmp_path)
    backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hi")[0] == 1  # raw prompts get the post-processor's BOS
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids[1] != 1


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFilesError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_max_model_len_override(model_dir):
    assert Tokenizer.from_dir(model_dir, max_model_len=512).info.max_model_len == 512


def test_model_max_length_fallback_without_config(model_dir, tmp_path):
    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["model_max_length"] = 1024
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.info.max_model_len == 1024
    assert tok.info.vocab_size == 49152


def test_raise_exception_in_template_becomes_chat_template_error():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}"
        "{% endif %}ok",
        {},
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first turn must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_template_is_sandboxed():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_transformers_template_extras():
    template = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}",
        {},
    )
    rendered = template.render([{"role": "user", "content": "<é>"}, {"role": "x", "content": ""}])
    assert rendered == '{"role": "user", "content": "<é>"}'
