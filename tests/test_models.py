"""Builtin models: the tiny Qwen3s and the SmolLM2 conversion load in transformers, with the tokenizer,
chat template and answer format the synthetic task needs; the build cache is reused and atomic.

The builtins are built into the real cache (`$M2PO_CACHE`, default ~/.cache/m2po): the first run
takes about a minute, later runs reuse them. vLLM loading is covered by the weight-sync tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from m2po_cli import builtin_models, models
from m2po_cli.builtin_models import BOXED_TOKEN, EOS_TOKEN, PAD_TOKEN, char_tokenizer
from m2po_cli.models import resolve_model

TINY = ["builtin:tiny-qwen3", "builtin:tiny-qwen3-untied"]
BOXED = re.compile(r"\\boxed\{(\d+)\}$")


@pytest.fixture(scope="session")
def tiny_dirs() -> dict[str, Path]:
    return {name: resolve_model(name) for name in TINY}


def _prompt(tokenizer, problem: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": problem}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("name", TINY)
def test_tiny_loads_with_consistent_config(tiny_dirs, name):
    path = tiny_dirs[name]
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    tied = name == "builtin:tiny-qwen3"
    assert model.config.tie_word_embeddings is tied
    shares = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shares is tied
    # vLLM needs the model's vocab to cover the tokenizer and eos in config and generation config.
    assert model.config.vocab_size >= len(tokenizer)
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    # vLLM's CPU attention supports head sizes from 32 up.
    assert model.config.head_dim >= 32


def test_tokenizer_round_trips_and_special_tokens(tiny_dirs):
    saved = AutoTokenizer.from_pretrained(tiny_dirs["builtin:tiny-qwen3"])
    for tokenizer in (char_tokenizer(), saved):
        text = "".join(chr(c) for c in range(32, 127)) + "\nx = 3+4\n"
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)  # one token per character
        assert tokenizer.decode(ids) == text
        assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
        assert tokenizer.eos_token_id != tokenizer.pad_token_id
        ids = tokenizer.encode(f"{BOXED_TOKEN}12}}{EOS_TOKEN}", add_special_tokens=False)
        assert tokenizer.convert_ids_to_tokens(ids) == [BOXED_TOKEN, "1", "2", "}", EOS_TOKEN]
        assert tokenizer.decode(ids, skip_special_tokens=True) == "\\boxed{12}"


def test_chat_template_is_qwen_style(tiny_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["builtin:tiny-qwen3"])
    assert _prompt(tokenizer, "3+4") == "<|im_start|>user\n3+4<|im_end|>\n<|im_start|>assistant\n"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "\\boxed{2}"}], tokenize=False
    )
    assert text == "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n\\boxed{2}<|im_end|>\n"


@pytest.mark.parametrize("name", TINY)
def test_warm_start_answers_in_format(tiny_dirs, name):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[name]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[name])
    ws = models.BUILTINS[name].warm_start
    gen = torch.Generator().manual_seed(0)
    operands = torch.randint(0, ws.max_operand + 1, (64, 2), generator=gen).tolist()
    prompts = [_prompt(tokenizer, f"{a}+{b}") for a, b in operands]
    batch = tokenizer(
        prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
    )
    num_prompt_tokens = batch["input_ids"].shape[1]
    torch.manual_seed(0)
    with torch.no_grad():
        greedy = model.generate(**batch, do_sample=False, max_new_tokens=8)
        sampled = model.generate(
            **batch, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=8, num_return_sequences=4
        )
    # Greedy, the format is learnt outright; at temperature 1 the untied model still spends a few
    # percent of its first-token mass off `\boxed{` (86% of samples in format, measured), which
    # costs the quickstart some reward at its start, not its signal.
    for out, floor in ((greedy, 0.95), (sampled, 0.8)):
        texts = tokenizer.batch_decode(out[:, num_prompt_tokens:], skip_special_tokens=True)
        answers = [BOXED.match(t) for t in texts]
        assert sum(a is not None for a in answers) / len(texts) >= floor, texts[:8]
    # At the rollout temperature the warm-started model mostly guesses (a weak prior, not the
    # arithmetic): the reward RL starts from leaves it room to learn.
    gold = [a + b for a, b in operands for _ in range(4)]
    correct = sum(m is not None and int(m.group(1)) == g for m, g in zip(answers, gold, strict=True))
    assert correct / len(answers) < 0.4


def test_cache_is_reused(tiny_dirs):
    start = time.process_time()  # CPU time: a build would take minutes of it, a loaded machine adds none
    again = resolve_model("builtin:tiny-qwen3")
    assert again == tiny_dirs["builtin:tiny-qwen3"] == models.builtin_dir("builtin:tiny-qwen3")
    assert time.process_time() - start < 1.0
    assert "tiny-qwen3-untied" in tiny_dirs["builtin:tiny-qwen3-untied"].name
    assert tiny_dirs["builtin:tiny-qwen3"] != tiny_dirs["builtin:tiny-qwen3-untied"]


@pytest.fixture
def cheap_builtin(tmp_path, monkeypatch) -> str:
    """A fast-to-build tiny builtin in an empty cache."""
    name = "builtin:tiny-qwen3"
    spec = models.BUILTINS[name]
    cheap = dataclasses.replace(spec, warm_start=dataclasses.replace(spec.warm_start, steps=2, batch_size=4))
    monkeypatch.setitem(models.BUILTINS, name, cheap)
    monkeypatch.setenv("M2PO_CACHE", str(tmp_path / "cache"))
    return name


def test_a_build_says_so_and_how_far_its_warm_start_has_got(cheap_builtin, monkeypatch):
    """The first use of a builtin on a machine builds it (the long-tail model: 16 minutes on this
    kind): the console hears that it does, and the warm start's progress (here every tenth: no wait
    between lines), its steps counted by the child that takes them; a cached builtin says nothing."""
    spec = models.BUILTINS[cheap_builtin]
    monkeypatch.setitem(
        models.BUILTINS,
        cheap_builtin,
        dataclasses.replace(spec, warm_start=dataclasses.replace(spec.warm_start, steps=20)),
    )
    monkeypatch.setattr(models, "PROGRESS_EVERY_S", 0.0)
    said: list[str] = []
    path = resolve_model(cheap_builtin, said.append)
    assert said[0] == f"building {cheap_builtin} into {path}: once on this machine, later runs reuse it"
    steps = [int(re.search(r"warm start (\d+)/20 steps in \d+ s", line)[1]) for line in said[1:]]
    assert steps == list(range(2, 21, 2))
    assert "left" in said[1] and "left" not in said[-1]
    said.clear()
    assert resolve_model(cheap_builtin, said.append) == path and said == []


def test_build_spec_names_the_cache_dir(cheap_builtin):
    path = resolve_model(cheap_builtin)
    assert path.parent == Path(models.cache_root()) / "models"
    assert '"steps": 2' in (path / "m2po_build.json").read_text()
    spec = models.BUILTINS[cheap_builtin]
    changed = dataclasses.replace(spec, warm_start=dataclasses.replace(spec.warm_start, lr=1e-3))
    assert models._spec_hash(changed) != models._spec_hash(spec)


def test_a_build_by_other_library_versions_is_not_reused(cheap_builtin, monkeypatch):
    """The weights a build writes depend on torch's and transformers' float kernels: the cache key
    holds their versions, so an upgrade (or a build made mid-install) is rebuilt, not reused."""
    built = resolve_model(cheap_builtin)
    assert '"libraries"' in (built / "m2po_build.json").read_text()
    real = importlib.metadata.version
    monkeypatch.setattr(
        models.importlib.metadata, "version", lambda name: "0.0.1" if name == "torch" else real(name)
    )
    assert models.builtin_dir(cheap_builtin) != built
    assert resolve_model(cheap_builtin) != built and built.is_dir()


def test_failed_build_leaves_nothing_and_stale_temps_are_cleared(cheap_builtin, monkeypatch):
    root = models.cache_root() / "models"
    final = models.builtin_dir(cheap_builtin)
    # What a killed build leaves behind: a half-written temp dir.
    stale = root / f".{final.name}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{")

    spec = models.BUILTINS[cheap_builtin]
    broken = dataclasses.replace(spec, warm_start=dataclasses.replace(spec.warm_start, batch_size=-1))
    with monkeypatch.context() as m:
        m.setitem(models.BUILTINS, cheap_builtin, broken)
        broken_final = models.builtin_dir(cheap_builtin)
        with pytest.raises(RuntimeError, match=r"building the builtin TinyQwen3 into .* failed: \w+Error"):
            resolve_model(cheap_builtin)
    assert not broken_final.exists()
    assert not list(root.glob(f".{broken_final.name}.tmp*"))

    assert resolve_model(cheap_builtin) == final
    assert not list(root.glob(f".{final.name}.tmp*"))
    AutoModelForCausalLM.from_pretrained(final)


# ATen's kernel levels, highest first, with the MKL instruction set that matches each.
KERNEL_LEVELS = [("AVX512", "AVX512"), ("AVX2", "AVX2"), ("DEFAULT", "AVX")]


def lower_kernels(own: str) -> dict[str, str] | None:
    """Float kernels one level below `own` (ATen's level, as `torch.backends.cpu.get_cpu_capability`
    names it): AVX2 below AVX-512, ATen's scalar `default` with MKL at AVX below AVX2. They stand in
    for another machine's; None where `own` is already the lowest."""
    levels = [aten for aten, _ in KERNEL_LEVELS]
    if own not in levels[:-1]:
        return None
    aten, mkl = KERNEL_LEVELS[levels.index(own) + 1]
    return {"ATEN_CPU_CAPABILITY": aten.lower(), "MKL_ENABLE_INSTRUCTIONS": mkl}


def test_the_stand_in_is_below_the_kernels_the_process_runs():
    """The level read is the one the process runs, which a cap on the whole process lowers (as the
    suite runs on an AVX2 machine), and the stand-in is one below it."""
    assert lower_kernels("AVX512") == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert lower_kernels("AVX2") == {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX"}
    assert lower_kernels("DEFAULT") is None and lower_kernels("SVE256") is None
    script = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    capped = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2"):  # a cap lowers, never raises
        assert capped.stdout.split() == ["AVX2"]


def test_a_machine_with_other_instructions_builds_the_same_weights(tmp_path, monkeypatch):
    """The warm start's float kernels are ones every x86-64 CPU runs alike. Kernels one level below
    the machine's own (`lower_kernels`) stand in for another machine: built on each machine's own
    kernels the weights differ, built portably they are the same bytes, and `m2po_build.json`
    records them. The same property on an AVX-512 and an AVX2 machine."""
    own = torch.backends.cpu.get_cpu_capability()
    lower = lower_kernels(own)
    if lower is None:
        pytest.skip(f"this CPU runs ATen's lowest kernels ({own})")
    spec = models.BUILTINS["builtin:tiny-qwen3-untied"]
    spec = dataclasses.replace(spec, warm_start=dataclasses.replace(spec.warm_start, steps=30, batch_size=32))

    def weights(name: str, env: dict[str, str], portable: bool = True) -> bytes:
        out = tmp_path / name
        if portable:
            with monkeypatch.context() as m:
                for key, value in env.items():
                    m.setenv(key, value)
                builtin_models.build_portable(spec, out)
        else:  # the same child on the machine's own kernels
            cmd = [
                sys.executable,
                "-m",
                "m2po_cli.builtin_models",
                json.dumps(builtin_models.spec_dict(spec)),
            ]
            subprocess.run([*cmd, str(out)], env={**os.environ, **env}, check=True, capture_output=True)
        return (out / "model.safetensors").read_bytes()

    assert weights("own-lower", lower, portable=False) != weights("own", {}, portable=False)
    native = weights("native", {})
    assert weights("lower", lower) == native

    monkeypatch.setitem(models.BUILTINS, "builtin:tiny-qwen3-untied", spec)
    monkeypatch.setenv("M2PO_CACHE", str(tmp_path / "cache"))
    record = json.loads((resolve_model("builtin:tiny-qwen3-untied") / "m2po_build.json").read_text())
    assert record["model_sha256"] == hashlib.sha256(native).hexdigest()


@pytest.mark.parametrize("damage", ["config.json", "model.safetensors"])
def test_a_damaged_cache_entry_is_built_again(cheap_builtin, damage):
    """A built model whose files were removed after the build is not handed to the engine."""
    final = resolve_model(cheap_builtin)
    (final / damage).unlink()
    assert resolve_model(cheap_builtin) == final
    models.check_model_dir(final)
    AutoModelForCausalLM.from_pretrained(final)


def test_resolve_local_dir_and_errors(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="unknown builtin"):
        resolve_model("builtin:nope")
    with pytest.raises(ValueError, match="model directory not found: .*missing/model"):
        resolve_model(str(tmp_path / "missing" / "model"))


@pytest.mark.slow
def test_smollm2_conversion_loads_tied():
    path = resolve_model("builtin:smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert getattr(config, "quantization_config", None) is None
    assert model.dtype == torch.float32
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    assert config.vocab_size >= len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = _prompt(tokenizer, "What is 2+3?")
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, do_sample=False, max_new_tokens=12)
    reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in reply, reply


@pytest.mark.slow
def test_smollm2_recipe_prompts_are_short_and_fit():
    """The CPU recipe's cost is mostly prompt tokens (the learner recomputes them for every sample):
    every prompt fits `max_prompt_tokens` (none is dropped) and stays that short."""
    from m2po_cli.config import load_recipe
    from m2po_cli.data import PromptBatches, load_problems

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-cpu.toml")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(recipe.model.path))
    batches = PromptBatches(
        load_problems(recipe.data), tokenizer, recipe.data, recipe.rollout.prompts_per_step
    )
    prompts = [p for _ in range(recipe.run.steps + recipe.queue_batches) for p in next(batches)]
    assert batches.num_dropped == 0
    assert max(len(p.token_ids) for p in prompts) <= recipe.data.max_prompt_tokens <= 80
    text = tokenizer.decode(prompts[0].token_ids)
    assert f"Find the sum {prompts[0].problem.problem}." in text and "\\boxed{<sum>}" in text


def test_the_recipe_schema_knows_every_builtin_and_no_other():
    """`model.path` is checked against `models.BUILTINS`, which names the builtins without importing
    the builders' torch or transformers."""
    script = (
        "import sys; from m2po_cli.config import ModelConfig\n"
        "for name in ('builtin:tiny-qwen3', 'builtin:smollm2-135m-instruct'): ModelConfig(path=name)\n"
        "try: ModelConfig(path='builtin:nope')\n"
        "except ValueError as e: print(str(e).splitlines()[1].strip())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    first, loaded = done.stdout.splitlines()[-2:]
    assert loaded == "[]"
    assert all(name in first for name in models.BUILTINS) and "unknown builtin 'builtin:nope'" in first


def test_the_long_tail_warm_start_teaches_a_geometric_number_of_worked_lines():
    """`builtin:tiny-qwen3-long-tail` is taught `a+b=X;` K times before `\\boxed{X}`, K geometric with
    the spec's mean: P(K >= k) = (1 - p)^k. A warm start without worked lines draws no random numbers
    for them, so the other builtins' weights are what they were before the option existed."""
    ws = models.BUILTINS["builtin:tiny-qwen3-long-tail"].warm_start
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([builtin_models._num_checks(ws, gen) for _ in range(2000)]).double()
    assert len(draws) == 2000 * ws.batch_size
    assert abs(draws.mean().item() - ws.checks_mean) < 0.05
    keep = ws.checks_mean / (1 + ws.checks_mean)
    for k in (1, 4, 16):
        assert abs((draws >= k).double().mean().item() - keep**k) < 0.01

    plain = models.BUILTINS["builtin:tiny-qwen3-untied"].warm_start
    gen, state = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0).get_state()
    assert builtin_models._num_checks(plain, gen).eq(0).all()
    assert torch.equal(gen.get_state(), state)

    tokenizer = char_tokenizer()
    examples = [builtin_models.answer_turns([3, 4], 7, 2), builtin_models.answer_turns([1, 0], 5, 0)]
    ids_BT, labels_BT = builtin_models._format_batch(tokenizer, examples)
    responses = [tokenizer.decode(row[row >= 0]) for row in labels_BT]
    assert responses == [f"3+4=7;3+4=7;{BOXED_TOKEN}7}}{EOS_TOKEN}", f"{BOXED_TOKEN}5}}{EOS_TOKEN}"]
    assert tokenizer.decode(ids_BT[1]).startswith(_prompt(tokenizer, "1+0"))


def test_the_calculator_warm_start_calls_the_builtin_tool_and_trains_no_tool_token():
    from m2po_cli.environment import EnvSession, load_environment

    tokenizer = char_tokenizer()
    examples = [
        builtin_models.calculator_turns([123, 456], 0, True),
        builtin_models.calculator_turns([1, 2], 7, False),
    ]
    ids_BT, labels_BT = builtin_models._format_batch(tokenizer, examples)
    call, tool, answer = (text for text, _ in examples[0][1])
    trained = tokenizer.decode(labels_BT[0][labels_BT[0] >= 0])
    assert trained == call + answer and answer == f"{BOXED_TOKEN}579}}{EOS_TOKEN}"
    assert tool in tokenizer.decode(ids_BT[0]) and "579" in tool
    session = EnvSession(load_environment("builtin:calculator"), timeout_s=5)
    session.reset({})
    assert session.respond(call.removesuffix(EOS_TOKEN)) == [{"role": "tool", "content": "579"}]
    assert tokenizer.decode(labels_BT[1][labels_BT[1] >= 0]) == f"{BOXED_TOKEN}7}}{EOS_TOKEN}"  # a guess
    # The tool turn is what the builtin template writes after a model turn for a tool message.
    from m2po_cli.chat import ChatTurns

    suffix = ChatTurns(tokenizer, [tokenizer.eos_token_id], "tiny").suffix(
        [{"role": "tool", "content": "579"}]
    )
    assert tokenizer.decode(suffix) == tool
