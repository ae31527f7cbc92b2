"""Randomly initialised Qwen3 checkpoints of a chosen shape, built locally (no hub), for benchmarks.

The weights are random, so only speed and exactness can be measured on them, not quality. The tokenizer
is the builtin character-level one; the vocabulary is padded to the shape's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Qwen3Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096

    def num_params(self) -> int:
        d, h = self.hidden_size, self.head_dim
        attention = d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * h
        layer = attention + 3 * d * self.intermediate_size + 2 * d
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * layer + heads * self.vocab_size * d + d


# Qwen3-0.6B's published config (hidden 1024, 28 layers, 16/8 heads of 128, MLP 3072, 151,936 tokens).
QWEN3_0_6B = Qwen3Shape(1024, 28, 16, 8, 128, 3072, 151_936)
# Qwen3-8B's published config (hidden 4096, 36 layers, 32/8 heads of 128, MLP 12,288, untied head).
QWEN3_8B = Qwen3Shape(
    4096, 36, 32, 8, 128, 12_288, 151_936, tie_word_embeddings=False, max_position_embeddings=40_960
)
# Qwen2.5-32B's shapes (its q/k/v biases, 0.01% of the parameters, left out): network arithmetic only.
QWEN25_32B = Qwen3Shape(
    5120, 64, 40, 8, 128, 27_648, 152_064, tie_word_embeddings=False, max_position_embeddings=32_768
)
# Small enough to train a few steps on a CPU; big enough that a weight push moves ~100 MB.
CPU_BENCH = Qwen3Shape(512, 8, 8, 4, 64, 2048, 16_384)
# The size the CPU mode of the GPU check runs at.
TINY = Qwen3Shape(64, 2, 2, 2, 32, 256, 128)


def write_qwen3_config(out: Path, shape: Qwen3Shape) -> Path:
    """Only the `config.json` of `shape` (what `titan.load_arch` reads), for sizes without weights."""
    from m2po_cli.builtin_models import char_tokenizer, qwen3_config

    out.mkdir(parents=True, exist_ok=True)
    qwen3_config(shape, char_tokenizer()).to_json_file(out / "config.json")
    return out


def write_qwen3(out: Path, shape: Qwen3Shape, seed: int = 0, tokenizer=None) -> Path:
    """Write an HF Qwen3 checkpoint (fp32 safetensors, config, tokenizer) of `shape` to `out`, with
    random weights; the character tokenizer unless `tokenizer` is given."""
    from transformers.utils import logging

    logging.disable_progress_bar()

    from m2po_cli.builtin_models import char_tokenizer, random_qwen3, save_model

    tokenizer = tokenizer or char_tokenizer()
    return save_model(random_qwen3(shape, tokenizer, seed), tokenizer, out)
