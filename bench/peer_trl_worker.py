"""TRL's `GRPOTrainer` on the work `bench_peer_trl.py` gives it; runs in `.venv-trl`, never in the project's venv.

    .venv-trl/bin/python bench/peer_trl_worker.py WORK.json SEED OUT.json

WORK.json (written by the bench) holds the model folder, the prompts of each step (the user turn,
the token ids m2po trains on, the gold answer) and the shared settings. The worker trains one step
per rollout batch, in the order given, and writes per step: seconds of the step, of generation and
of the reward, generated and trained tokens, the mean reward, and the prompt token ids TRL trained
on (one row per group), which the bench checks against m2po's.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from m2po_cli.answers import grade  # noqa: E402  (stdlib and math-verify only)


def reward(completions, answer, **_):
    """The project's grader: 1 for a correct last `\\boxed{}` answer, else 0."""
    return [
        grade(c[0]["content"] if isinstance(c, list) else c, a)
        for c, a in zip(completions, answer, strict=True)
    ]


class TimedGRPO(GRPOTrainer):
    """GRPOTrainer that times generation and the reward, and keeps what each batch trained on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = {"generate": 0.0, "reward": 0.0}
        self.batches: list[dict] = []

    def _generate(self, prompts):
        t0 = time.perf_counter()
        try:
            return super()._generate(prompts)
        finally:
            self.clock["generate"] += time.perf_counter() - t0

    def _calculate_rewards(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super()._calculate_rewards(*args, **kwargs)
        finally:
            self.clock["reward"] += time.perf_counter() - t0

    def _generate_and_score_completions(self, inputs):
        before = dict(self.clock)
        out = super()._generate_and_score_completions(inputs)
        mask_BP, ids_BP = out["prompt_mask"].bool(), out["prompt_ids"]
        n = self.args.num_generations
        self.batches.append(
            {
                "prompt_ids": [ids_BP[b][mask_BP[b]].tolist() for b in range(0, ids_BP.shape[0], n)],
                "generated_tokens": int(out["completion_mask"].sum()),
                "trained_tokens": int(mask_BP.sum() + out["completion_mask"].sum()),
                "generate_s": self.clock["generate"] - before["generate"],
                "reward_s": self.clock["reward"] - before["reward"],
            }
        )
        return out


class StepClock(TrainerCallback):
    def __init__(self):
        self.t0, self.seconds = 0.0, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.t0)


def main() -> None:
    work = json.loads(Path(sys.argv[1]).read_text())
    seed, out_path = int(sys.argv[2]), Path(sys.argv[3])
    s = work["settings"]
    rows = [
        {"prompt": [{"role": "user", "content": p["content"]}], "answer": p["answer"]}
        for step in work["steps"]
        for p in step
    ]
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            max_steps=len(work["steps"]),
            per_device_train_batch_size=s["prompts"] * s["n"],
            gradient_accumulation_steps=1,
            num_generations=s["n"],
            max_completion_length=s["max_new_tokens"],
            temperature=s["temperature"],
            top_p=1.0,
            top_k=0,
            learning_rate=s["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=s["weight_decay"],
            adam_beta1=s["betas"][0],
            adam_beta2=s["betas"][1],
            adam_epsilon=s["adam_eps"],
            max_grad_norm=s["grad_clip"],
            beta=0.0,
            epsilon=s["clip"],
            loss_type="dapo",  # the token mean over the batch, as m2po's
            scale_rewards="group",
            shuffle_dataset=False,  # the prompts in m2po's order
            seed=seed,
            bf16=False,
            use_cpu=True,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        clock = StepClock()
        trainer = TimedGRPO(
            model=work["model_dir"],
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            callbacks=[clock],
        )
        trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    steps = [
        {**batch, "step_s": step_s, "reward": r}
        for batch, step_s, r in zip(trainer.batches, clock.seconds, rewards, strict=True)
    ]
    out_path.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "steps": steps}))


if __name__ == "__main__":
    main()
