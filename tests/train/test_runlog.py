"""The run log's resume rule: records of the steps a resumed run redoes are dropped, and a line a kill
cut short never stops the restart."""

from __future__ import annotations

import json

from m2po_cli.train.runlog import forget_steps_from


def test_later_steps_and_a_torn_last_line_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "rollout/reward_mean": s / 10}) for s in range(5)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 5, "rollout/rew')  # killed mid-write
    kept = forget_steps_from(path, 3)
    assert [r["step"] for r in kept] == [0, 1, 2]
    assert path.read_text() == "\n".join(lines[:3]) + "\n", "kept lines are kept byte for byte"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"], "no temporary file is left"


def test_nothing_to_forget(tmp_path):
    assert forget_steps_from(tmp_path / "absent.jsonl", 0) == []
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    assert forget_steps_from(path, 4) == [] and path.read_text() == ""


def test_samples_are_the_trained_rows_as_text_and_a_resume_drops_the_redone_ones(tmp_path):
    """`[logging] samples`: k rows spread over the batch, decoded; samples.jsonl keeps them, and a
    resumed run forgets those of the steps it trains again."""
    import torch

    from m2po_cli.builtin_models import char_tokenizer as builtin_tokenizer
    from m2po_cli.rollout.episode import one_turn
    from m2po_cli.rollout.types import Completion
    from m2po_cli.train.loop import batch_samples
    from m2po_cli.train.pack import pack_groups
    from m2po_cli.train.runlog import RunLog
    from tests.conftest import recipe_for

    char_tokenizer = builtin_tokenizer()  # the builtin models' own
    encode = lambda text: char_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = [encode("1+2"), encode("3+3")]
    texts = [["so 3", "4"], ["\\boxed{6}", "7"]]
    groups = [[Completion(encode(t), [0.0] * len(t), t, True) for t in g] for g in texts]
    rewards_PG = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    batch = pack_groups(0, 10, prompts, one_turn(groups), rewards_PG, normalize_std=True, std_eps=1e-6)
    samples = batch_samples(batch, char_tokenizer, k=3)
    assert [s["row"] for s in samples] == [10, 12, 13]  # spread: the first, the middle, the last
    assert [(s["prompt"], s["completion"], s["reward"]) for s in samples] == [
        ("1+2", "so 3", 0.0), ("3+3", "\\boxed{6}", 1.0), ("3+3", "7", 0.0)
    ]  # fmt: skip
    assert len(batch_samples(batch, char_tokenizer, k=10)) == 4

    recipe = recipe_for(tmp_path, "logging.samples=2", 'logging.console="plain"')
    with RunLog(tmp_path / "run", recipe, world_size=1) as log:
        log.start(0)
        for step in range(3):
            log.samples(step, samples[:2])
    with RunLog(tmp_path / "run", recipe, world_size=1) as log:
        log.start(1)  # resumed at step 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(x["step"], x["row"]) for x in lines] == [(0, 10), (0, 12)]
