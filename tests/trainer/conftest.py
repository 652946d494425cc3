"""Fixtures of the trainer tests: a tiny random Qwen2 causal LM and small hand-built rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 300


def build_random_qwen2(out_dir: Path, *, seed: int = 0) -> Path:
    """A tiny random Qwen2ForCausalLM (hidden 64, 2 heads, 1 KV head, 2 layers), float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    assert next(model.parameters()).dtype == torch.float32
    model.save_pretrained(str(out_dir))
    # A stand-in tokenizer file, so save() is checked to carry tokenizer files along.
    (out_dir / "tokenizer_config.json").write_text('{"model_max_length": 512}\n')
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_qwen2(tmp_path_factory.mktemp("tiny-model"))
