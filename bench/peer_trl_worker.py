"""TRL's `GRPOTrainer` on the work `bench_peer_trl.py` gives it; runs in `.venv-trl`, never in the project's venv.

    .venv-trl/bin/python bench/peer_trl_worker.py WORK.json SEED OUT.json --checkpointing on|off
    .venv-trl/bin/python bench/peer_trl_worker.py --gradient ROWS.json GRADS.safetensors OUT.json [--full]

WORK.json (written by the bench) holds the model folder, the prompts of each step (the user turn,
the token ids m2po trains on, the gold answer) and the shared settings. The worker trains one step
per rollout batch, in the order given, and writes per step: seconds of the step, of generation and
of the reward, generated and trained tokens, the mean reward, and the prompt token ids TRL trained
on (one row per group), which the bench checks against m2po's. `--checkpointing` sets TRL's
`gradient_checkpointing` (its default is on).

With `--gradient` (`peer_trl_gradient.py`): one step on ROWS.json's rows, whose completions TRL's
generation returns instead of sampling; writes the gradient TRL would apply, before its optimizer
steps, to GRADS.safetensors, and to OUT.json whether TRL tokenised the same prompts, scored the same
rewards and advantages, and took the engine's logprobs of the tokens. `--full` clears the input
embedding's `padding_idx` first (HF's embedding gives the pad token's row no gradient from its input
lookups; SmolLM2's pad token is `<|im_end|>`, which every chat prompt holds).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and sys.argv[1:2] in ([], ["-h"], ["--help"]):  # before TRL: any venv answers
    print(__doc__.strip())
    sys.exit(0 if sys.argv[1:] else 2)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

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


class GivenCompletions(GRPOTrainer):
    """GRPOTrainer whose generation returns the given completions, row for row, and keeps the
    prompt ids it tokenised; every step after generation is TRL's own."""

    def __init__(self, *args, completions: list[list[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.completions = completions
        self.prompt_ids: list[list[int]] = []

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        self.prompt_ids = [list(p) for p in prompt_ids]
        assert len(prompt_ids) == len(self.completions), (len(prompt_ids), len(self.completions))
        return [list(c) for c in self.completions], None  # HF generate's path: no sampling logprobs

    def _generate_and_score_completions(self, inputs):
        """Keeps the advantages and the per-token logprobs TRL trains on (its own forward, no grad),
        row for row, before TRL shuffles the rows for its mini-batches."""
        out = super()._generate_and_score_completions(inputs)
        with torch.no_grad():
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, out["completion_ids"].size(1)
            )
        keep = out["completion_mask"].bool()
        self.seen = {
            "advantages": out["advantages"].tolist(),
            "logps": [lp[k].tolist() for lp, k in zip(logps, keep, strict=True)],
        }
        return out


class GradientBeforeStep(TrainerCallback):
    """The gradient the optimizer is about to apply, by parameter name."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def config_for(s: dict, tmp: str, steps: int, seed: int, **extra) -> GRPOConfig:
    """The GRPOConfig of the shared settings (`s`, written by the bench)."""
    return GRPOConfig(
        output_dir=tmp,
        max_steps=steps,
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
        **extra,
    )


def gradient(rows_path: Path, grads_path: Path, out_path: Path, full: bool) -> None:
    """One step's gradient (module docstring); `full`: with the input embedding's `padding_idx`
    cleared, so the pad token's row gets the gradient of its input lookups too."""
    from safetensors.torch import save_file

    work = json.loads(rows_path.read_text())
    rows, s = work["rows"], work["settings"]
    scored: list[float] = []

    def recorded_reward(completions, answer, **kw):
        scored.extend(reward(completions, answer, **kw))
        return scored[-len(completions) :]

    dataset = [
        {"prompt": [{"role": "user", "content": r["content"]}], "answer": r["answer"]}
        for r in rows[:: s["n"]]
    ]
    clock = GradientBeforeStep()
    with tempfile.TemporaryDirectory(prefix="trl-gradient-") as tmp:
        trainer = GivenCompletions(
            model=work["model_dir"],
            reward_funcs=recorded_reward,
            args=config_for(s, tmp, 1, 0, max_grad_norm=0.0),  # no clip: the norms compare too
            train_dataset=Dataset.from_list(dataset),
            callbacks=[clock],
            completions=[r["completion_ids"] for r in rows],
        )
        embedding = trainer.model.get_input_embeddings()
        padding_idx = embedding.padding_idx
        if full:
            embedding.padding_idx = None  # forward unchanged; backward no longer zeroes that row
        trainer.train()
    save_file({k: v.contiguous() for k, v in clock.grads.items()}, str(grads_path))
    result = {
        "rewards_equal": scored == [r["reward"] for r in rows],
        "prompt_ids_equal": trainer.prompt_ids == [r["prompt_ids"] for r in rows],
        "gradient_checkpointing": trainer.args.gradient_checkpointing,
        "dtype": str(next(trainer.model.parameters()).dtype),
        "padding_idx": padding_idx,
        "full": full,
        "advantage_max_diff": max(
            abs(a - r["advantage"]) for a, r in zip(trainer.seen["advantages"], rows, strict=True)
        ),
        "logprob_vs_engine_max": max(
            abs(x - y)
            for lp, r in zip(trainer.seen["logps"], rows, strict=True)
            for x, y in zip(lp, r["behaviour_logprobs"], strict=True)
        ),
    }
    out_path.write_text(json.dumps(result))


def main() -> None:
    if sys.argv[1] == "--gradient":
        gradient(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), full=sys.argv[5:] == ["--full"])
        return
    work = json.loads(Path(sys.argv[1]).read_text())
    seed, out_path = int(sys.argv[2]), Path(sys.argv[3])
    if sys.argv[4:5] != ["--checkpointing"] or sys.argv[5:] not in (["on"], ["off"]):
        sys.exit("usage: peer_trl_worker.py WORK.json SEED OUT.json --checkpointing on|off")
    s = work["settings"]
    rows = [
        {"prompt": [{"role": "user", "content": p["content"]}], "answer": p["answer"]}
        for step in work["steps"]
        for p in step
    ]
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        checkpointing = sys.argv[5] == "on"
        config = config_for(
            s,
            tmp,
            len(work["steps"]),
            seed,
            max_grad_norm=s["grad_clip"],
            gradient_checkpointing=checkpointing,
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
    out_path.write_text(
        json.dumps(
            {
                "torch_threads": torch.get_num_threads(),
                "gradient_checkpointing": trainer.args.gradient_checkpointing,
                "steps": steps,
            }
        )
    )


if __name__ == "__main__":
    main()
