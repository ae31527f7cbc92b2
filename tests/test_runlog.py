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
