"""The tiny model builder: byte-identical output, a sound tokenizer, a chat template with tools."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from capture_devkit import tiny_model
from capture_devkit.tiny_corpus import corpus

SAMPLES = [
    "The answer is forty two.",
    "  leading spaces, trailing tabs\t\t\r\nand CRLF\r\n",
    'def f(x):\n    return {"a": [1, 2.5, null, true]}\n',
    "Unicode: é, 中文, emoji 🙂, combining e\u0301.",
    '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call><|im_end|>',
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "The command"}},
                "required": ["command"],
            },
        },
    }
]


def _render(model_dir: Path, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The chat template rendered the way vLLM renders it (transformers' apply_chat_template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert isinstance(text, str)
    return text


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_build_is_byte_identical_across_runs_and_processes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    again = tiny_model.build_tiny_model(tmp_path / "same-process")
    subprocess.run(
        [sys.executable, "-m", "capture_proxy.cli", "make-tiny-model", str(tmp_path / "other")],
        check=True,
        capture_output=True,
    )
    reference = _files(tiny_model_dir)
    assert set(reference) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert _files(again) == reference
    assert _files(tmp_path / "other") == reference


def test_cli_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert tiny_model.main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_config_fits_vllm_cpu_and_tokenizer(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert head_dim in {32, 64, 80, 96, 128}  # vLLM CPU attention head sizes
    assert config["vocab_size"] == tokenizer.get_vocab_size() == 4096
    assert config["max_position_embeddings"] >= 16384
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert config["eos_token_id"] == im_end
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == im_end
    assert json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["eos_token"] == (
        "<|im_end|>"
    )


@pytest.mark.parametrize("text", SAMPLES)
def test_tokenizer_round_trip(tiny_model_dir: Path, text: str) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text.replace("e\u0301", "é")


def test_added_tokens_are_single_ids(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for content, _special in tiny_model.ADDED_TOKENS:
        assert tokenizer.encode(content).ids == [tokenizer.token_to_id(content)]


def test_tokenizer_is_compact_on_prompt_like_text(tiny_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "\n".join(corpus(seed=12345, n_samples=200))  # unseen samples of the same kinds
    assert len(text) / len(tokenizer.encode(text).ids) > 3.0


def test_transformers_tokenizer_splits_like_tokenizer_json(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in [*SAMPLES, *corpus(seed=7, n_samples=50)]:
        assert auto(text)["input_ids"] == raw.encode(text).ids
    assert auto.eos_token == "<|im_end|>"


def test_chat_template_renders_tools_calls_and_responses(tiny_model_dir: Path) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": {"command": "ls"}},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "pwd"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "README.md"},
        {"role": "tool", "tool_call_id": "c2", "content": "/work"},
    ]
    text = _render(tiny_model_dir, messages, tools=TOOLS, add_generation_prompt=True)
    tools_line = json.dumps(TOOLS[0], ensure_ascii=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert f"<tools>\n{tools_line}\n</tools>" in text
    assert text.count("<|im_start|>system") == 1
    assert (
        "<|im_start|>user\nList the files.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nREADME.md\n</tool_response>\n"
        "<tool_response>\n/work\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_without_tools(tiny_model_dir: Path) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
    ]
    text = _render(tiny_model_dir, messages)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
    )
