"""Prompt sets: loading, synthetic problems, chat formatting, length filter, resumable batches."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from m2po_cli.config import DataConfig, SyntheticConfig
from m2po_cli.data import (
    DataError,
    Problem,
    PromptBatches,
    encode_prompt,
    load_problems,
    synthetic_arithmetic,
)

RECORDS = [{"problem": f"{i}+1", "answer": str(i + 1), "id": i} for i in range(5)]


def _write(path, records):
    if path.suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _synthetic(n: int = 40, **kw) -> DataConfig:
    return DataConfig(source="synthetic:arithmetic", synthetic=SyntheticConfig(num_problems=n), **kw)


# --- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_load_local_files(tmp_path, suffix):
    path = _write(tmp_path / f"set{suffix}", RECORDS)
    problems = load_problems(DataConfig(source=str(path)))
    assert problems == [Problem(i, f"{i}+1", str(i + 1)) for i in range(5)]


def test_custom_keys_and_numeric_answers(tmp_path):
    path = _write(
        tmp_path / "set.jsonl", [{"question": "6*7", "final": 42}, {"question": "1/2", "final": 0.5}]
    )
    cfg = DataConfig(source=str(path), prompt_key="question", answer_key="final")
    assert [(p.problem, p.answer) for p in load_problems(cfg)] == [("6*7", "42"), ("1/2", "0.5")]


def test_missing_field_names_file_record_and_key(tmp_path):
    records = [*RECORDS[:2], {"problem": "2+2", "solution": "4"}]
    path = _write(tmp_path / "set.jsonl", records)
    with pytest.raises(DataError) as err:
        load_problems(DataConfig(source=str(path)))
    assert str(err.value) == f"{path}: record 2: missing field 'answer' (fields: problem, solution)"


def test_bad_answer_type_and_bad_json_are_errors(tmp_path):
    path = _write(tmp_path / "set.json", [{"problem": "x", "answer": ["1", "2"]}])
    with pytest.raises(DataError, match="record 0: field 'answer' must be a string or a number, got list"):
        load_problems(DataConfig(source=str(path)))
    path = tmp_path / "broken.jsonl"
    path.write_text('{"problem": "x", "answer": "1"}\n{"problem": \n')
    with pytest.raises(DataError, match="line 2: invalid JSON"):
        load_problems(DataConfig(source=str(path)))


def test_synthetic_is_deterministic_and_correct():
    cfg = SyntheticConfig(max_operand=50, num_operands=3, num_problems=200)
    problems = synthetic_arithmetic(cfg, seed=7)
    assert problems == synthetic_arithmetic(cfg, seed=7)
    assert problems != synthetic_arithmetic(cfg, seed=8)
    assert [p.index for p in problems] == list(range(200))
    for p in problems:
        operands = [int(x) for x in p.problem.split("+")]
        assert len(operands) == 3 and all(0 <= x <= 50 for x in operands)
        assert p.answer == str(sum(operands))
    assert load_problems(_synthetic(200, shuffle_seed=7)) == synthetic_arithmetic(
        SyntheticConfig(num_problems=200), 7
    )


# --- prompts -------------------------------------------------------------------------------------


def test_encode_prompt_is_one_user_turn(char_tokenizer):
    ids = encode_prompt(char_tokenizer, "Q: {problem}!", "3+4")
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    expected = char_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Q: 3+4!"}], add_generation_prompt=True, tokenize=False
    )
    assert expected == "<|im_start|>user\nQ: 3+4!<|im_end|>\n<|im_start|>assistant\n"
    assert char_tokenizer.convert_ids_to_tokens(ids) == ["<|im_start|>", *"user\nQ: 3+4!", "<|im_end|>", "\n",
                                                        "<|im_start|>", *"assistant\n"]  # fmt: skip


def test_paper_template_keeps_braces(char_tokenizer):
    ids = encode_prompt(char_tokenizer, DataConfig(source="synthetic:arithmetic").prompt_template, "1+1")
    text = "".join(char_tokenizer.convert_ids_to_tokens(ids))
    assert "math problem: 1+1. The assistant" in text and r"\boxed{} tags, for example \boxed{1}." in text


def test_long_prompts_are_dropped_and_counted(char_tokenizer):
    problems = [Problem(i, "x" * (5 if i % 3 else 50), "0") for i in range(30)]  # every third is long
    overhead = len(encode_prompt(char_tokenizer, "{problem}", ""))
    cfg = DataConfig(
        source="synthetic:arithmetic", prompt_template="{problem}", max_prompt_tokens=overhead + 10
    )
    batches = PromptBatches(problems, char_tokenizer, cfg, prompts_per_step=4)
    seen = [p.problem.index for _ in range(5) for p in next(batches)]  # one epoch: 20 short problems
    assert len(seen) == len(set(seen)) == 20 and all(i % 3 for i in seen)
    assert batches.state_dict()["epoch"] == 0 and batches.num_dropped <= 10  # counted as they are met
    next(batches)  # scans the rest of epoch 0 (long ones only) and starts epoch 1
    assert batches.state_dict()["epoch"] == 1 and batches.num_dropped == 10


def test_too_few_short_prompts_is_an_error(char_tokenizer):
    problems = [Problem(i, "x" * (5 if i < 3 else 50), "0") for i in range(10)]
    overhead = len(encode_prompt(char_tokenizer, "{problem}", ""))
    cfg = DataConfig(
        source="synthetic:arithmetic", prompt_template="{problem}", max_prompt_tokens=overhead + 10
    )
    with pytest.raises(
        DataError, match="only 3 of 10 prompts fit data.max_prompt_tokens=.*prompts_per_step=4"
    ):
        next(PromptBatches(problems, char_tokenizer, cfg, prompts_per_step=4))


# --- batches -------------------------------------------------------------------------------------


def _indices(batches: PromptBatches, k: int) -> list[list[int]]:
    return [[p.problem.index for p in next(batches)] for _ in range(k)]


def test_batches_are_deterministic_and_resume_exactly(char_tokenizer):
    cfg = _synthetic(10)
    problems = load_problems(cfg)
    uninterrupted = _indices(PromptBatches(problems, char_tokenizer, cfg, prompts_per_step=3), 12)
    assert uninterrupted == _indices(PromptBatches(problems, char_tokenizer, cfg, prompts_per_step=3), 12)
    for k in (1, 3, 4, 7):  # 3 batches per epoch of 10: k = 3 resumes at an epoch's dropped tail
        first = PromptBatches(problems, char_tokenizer, cfg, prompts_per_step=3)
        _indices(first, k)
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
        resumed = PromptBatches(problems, char_tokenizer, cfg, prompts_per_step=3)
        resumed.load_state_dict(state)
        assert _indices(resumed, 12 - k) == uninterrupted[k:]


def test_epochs_wrap_with_a_new_permutation_and_drop_the_tail(char_tokenizer):
    cfg = _synthetic(10)
    batches = PromptBatches(load_problems(cfg), char_tokenizer, cfg, prompts_per_step=3)
    epoch0 = _indices(batches, 3)
    assert batches.state_dict() == {"epoch": 0, "position": 9}
    epoch1 = _indices(batches, 3)
    assert batches.state_dict() == {"epoch": 1, "position": 9}
    flat0, flat1 = sum(epoch0, []), sum(epoch1, [])
    assert len(set(flat0)) == len(set(flat1)) == 9  # distinct within an epoch, 1 of 10 left over
    assert flat0 != flat1
    other_seed = PromptBatches(load_problems(cfg), char_tokenizer, _synthetic(10, shuffle_seed=1), 3)
    assert _indices(other_seed, 3) != epoch0


def test_batch_prompts_carry_problem_and_tokens(char_tokenizer):
    cfg = _synthetic(8)
    (first, *_) = next(PromptBatches(load_problems(cfg), char_tokenizer, cfg, prompts_per_step=2))
    assert first.token_ids == encode_prompt(char_tokenizer, cfg.prompt_template, first.problem.problem)
    assert len(first.token_ids) <= cfg.max_prompt_tokens


def test_state_from_another_set_is_rejected(char_tokenizer):
    cfg = _synthetic(8)
    batches = PromptBatches(load_problems(cfg), char_tokenizer, cfg, prompts_per_step=2)
    with pytest.raises(DataError, match=r"position 50\).*another data.source"):
        batches.load_state_dict({"epoch": 0, "position": 50})


def test_fewer_problems_than_a_batch_is_an_error(char_tokenizer):
    cfg = _synthetic(3)
    with pytest.raises(DataError, match="3 problems, fewer than prompts_per_step=4"):
        PromptBatches(load_problems(cfg), char_tokenizer, cfg, prompts_per_step=4)
