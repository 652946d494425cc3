"""``capture-proxy make-tiny-model DIR``: a deterministic tiny Qwen2 model for tests and the demo.

Everything is made locally (nothing comes from a model hub) and the directory is byte-identical on
every run:

- ``tokenizer.json`` — byte-level BPE trained with ``tokenizers`` on generated text
  (:mod:`capture_devkit.tiny_corpus`), Qwen-style added tokens after the BPE vocabulary;
- ``config.json`` — Qwen2, hidden 64, 2 heads of size 32 (vLLM's CPU attention needs ≥ 32),
  1 KV head, 2 layers, a context long enough for OpenCode's prompts (:data:`MAX_POSITIONS`)
  (:data:`TINY`; :data:`SMALL` is a ~28M-parameter shape with the same tokenizer, for benchmarks
  whose figures depend on how much of the engine's time the forward pass takes);
- ``model.safetensors`` — float32 weights drawn with numpy from a fixed seed;
- ``tokenizer_config.json`` — Qwen-style chat template with hermes tool calls, eos ``<|im_end|>``;
- ``generation_config.json``.

The weights are random except for one deliberate "bias channel": every input embedding carries a
constant on hidden dim 0, and the (untied) output head reads it to give ``<|im_end|>`` a bonus and
the other added tokens a large penalty. So the model
ends a turn with ``<|im_end|>`` after a few dozen tokens on average, and never emits the other
added tokens (``<|im_start|>``, ``<tool_call>``…) by itself — tool calls come only from
``structured_outputs`` (DESIGN §7).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SEED = 0
VOCAB_SIZE = 4096


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The transformer's sizes (the tokenizer, the vocabulary and the bias channel are shared)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_cache_bytes(self, max_model_len: int) -> int:
        """The engine's KV cache (float32) for two sequences of ``max_model_len`` tokens."""
        per_token = self.layers * 2 * self.kv_heads * self.head_dim * 4  # keys and values
        return 2 * max_model_len * per_token

    @property
    def head_std(self) -> float:
        """The output head's spread, scaled so the logits vary as much at every width."""
        return HEAD_STD * (TINY_HIDDEN / self.hidden) ** 0.5


TINY_HIDDEN = 64
#: The tests' and the demo's model: ~0.6M parameters, most of them the embeddings.
TINY = ModelShape(hidden=TINY_HIDDEN, intermediate=128, layers=2, heads=2, kv_heads=1)
#: ~28M parameters: a forward pass that dominates a step, as a real model's does.
SMALL = ModelShape(hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=2)
SHAPES = {"tiny": TINY, "small": SMALL}
MAX_POSITIONS = 32768
ROPE_THETA = 1_000_000.0
CORPUS_SAMPLES = 6000

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
#: Added tokens (content, special) in id order, right after the BPE vocabulary, as in Qwen2.5:
#: the chat markers are special, the tool markup is not (so it survives detokenisation).
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
#: Qwen2's pre-tokenisation pattern: words with one leading non-letter, single digits, punctuation
#: runs, newline runs, other whitespace.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EMBED_STD = 0.1
HEAD_STD = 0.3  # output head: logits vary by ~1.5 nats across tokens, so context matters
BIAS_CHANNEL = 1.0  # constant on hidden dim 0 of every input embedding
EOS_BONUS = 0.85  # output weight of <|im_end|> on that channel → mean turn length of a few dozen
SUPPRESS = 4.0  # negative output weight of the other added tokens on it → never sampled

CHAT_TEMPLATE = r"""{%- macro text(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content -%}
{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\n') -}}
{%- endif -%}
{%- endmacro -%}
{%- set system_first = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if system_first -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
{{- 'Function signatures are given within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nTo call a function, answer with a JSON object holding its name and ' -}}
{{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and tools and system_first -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- set answer = text(message.content) -%}
{%- if answer -%}{{- '\n' + answer -}}{%- endif -%}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}
{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


def _train_tokenizer() -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from tokenizers.trainers import BpeTrainer

    from capture_devkit.tiny_corpus import corpus

    tokenizer = Tokenizer(models.BPE())
    # The same pipeline transformers' Qwen2Tokenizer rebuilds around the vocabulary, so the raw
    # tokenizer.json and AutoTokenizer (what vLLM uses) split text identically.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(SEED, CORPUS_SAMPLES), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE - len(ADDED_TOKENS):
        raise RuntimeError(f"BPE vocabulary came out at {tokenizer.get_vocab_size()} entries")
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids = {content: tokenizer.token_to_id(content) for content, _ in ADDED_TOKENS}
    expected = range(VOCAB_SIZE - len(ADDED_TOKENS), VOCAB_SIZE)
    if sorted(ids.values()) != list(expected):
        raise RuntimeError(f"added tokens got unexpected ids: {ids}")
    return ids


def _weights(ids: dict[str, int], shape: ModelShape) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)

    def normal(*dims: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(std)).astype(np.float32)

    hidden, intermediate = shape.hidden, shape.intermediate
    embed = normal(VOCAB_SIZE, hidden, std=EMBED_STD)  # [V, H]
    embed[:, 0] = BIAS_CHANNEL
    head = normal(VOCAB_SIZE, hidden, std=shape.head_std)  # [V, H]
    head[:, 0] = 0.0
    for content, token_id in ids.items():
        head[token_id, 0] = EOS_BONUS if content == EOS_TOKEN else -SUPPRESS
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    kv_dim = shape.kv_heads * shape.head_dim
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(hidden, dtype=np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, dtype=np.float32),
            p + "self_attn.q_proj.weight": normal(hidden, hidden),
            p + "self_attn.q_proj.bias": np.zeros(hidden, dtype=np.float32),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.k_proj.bias": np.zeros(kv_dim, dtype=np.float32),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.v_proj.bias": np.zeros(kv_dim, dtype=np.float32),
            p + "self_attn.o_proj.weight": normal(hidden, hidden),
            p + "mlp.gate_proj.weight": normal(intermediate, hidden),
            p + "mlp.up_proj.weight": normal(intermediate, hidden),
            p + "mlp.down_proj.weight": normal(hidden, intermediate),
        }
    tensors["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    return tensors


def _config(ids: dict[str, int], shape: ModelShape) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "initializer_range": 0.02,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MAX_POSITIONS,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny_model(out_dir: Path, shape: ModelShape = TINY) -> Path:
    """Write the model (the tiny one unless ``shape`` says otherwise) into ``out_dir`` (created
    if needed) and return ``out_dir``."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    ids = _token_ids(tokenizer)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(out_dir / "config.json", _config(ids, shape))
    _write_json(
        out_dir / "generation_config.json",
        {"eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN]},
    )
    save_file(_weights(ids, shape), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def builder_fingerprint() -> str:
    """A hash of the code that determines the model's bytes (for caching built models)."""
    digest = hashlib.sha256()
    for module_file in (Path(__file__), Path(__file__).with_name("tiny_corpus.py")):
        digest.update(module_file.read_bytes())
    return digest.hexdigest()[:16]


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: capture-proxy make-tiny-model DIR", file=sys.stderr)
        return 2
    out_dir = build_tiny_model(Path(argv[0]))
    files = ", ".join(sorted(p.name for p in out_dir.iterdir()))
    print(f"tiny model written to {out_dir}: {files}")
    return 0
