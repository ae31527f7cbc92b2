"""One GRPO gradient, m2po against TRL's `GRPOTrainer`, on one real rollout batch at temperature 0.7.

    bash scripts/trl_venv.sh                    # once
    .venv/bin/python bench/peer_trl_gradient.py [--seed 0] [--keep DIR]

The batch: the first rollout step with unequal rewards in a group (at the initial weights) of
`recipes/smollm2-135m-cpu-grpo.toml` (SmolLM2-135M-Instruct,
4 prompts x 8 samples, 32 new tokens at temperature 0.7), sampled by m2po's vLLM engine and graded by
its grader, as `m2po train` does at step 0 (`colocated.rollout`). m2po's learner takes its GRPO update
on it, on-policy (s = 0), and the gradient it would apply is kept in HF names before the optimizer
steps (no gradient clip on either side, so the norms compare too). TRL's worker
(`peer_trl_worker.py --gradient`, in `.venv-trl`) runs one `GRPOTrainer` step from the same weights on
the same rows: its generation returns m2po's completions, and everything after it is TRL's own (the
chat template, the reward call with the same grader, the group advantages, the loss and its
normalisation). It checks that TRL tokenised the same prompts and scored the same rewards, then
compares the gradients.

TRL runs twice: as it is, and with the input embedding's `padding_idx` cleared ("TRL-full"). HF's Llama embedding
(SmolLM2's) gives the pad token's row no gradient from its input lookups, and SmolLM2's pad token is
`<|im_end|>`, which every chat prompt holds; m2po's learner, like the loss written out, gives that
row the gradient of every lookup. A third gradient is that literal one: the GRPO loss written out on
the HF model in float64, one unpadded row at a time, without `padding_idx`.

Prints the engine-learner logprob mismatch and the clipped share of m2po's on-policy update (its
ratio is the learner's probability over vLLM's at 0.7, TRL's is exactly 1), then each pair of
gradients' cosine, norm ratio and relative difference over all parameters, and the tensor whose own
cosine is lowest. Exits 1 if a cosine is below 0.999.

What it costs: one rollout batch (~500 generated tokens) and one update of a 134.5M-parameter model
on each side, plus the gradient written once to disk (134.5M x 4 bytes = 0.54 GB) for the worker to
read; at the 8B recipe's sizes this comparison is not meant to run (32 GB of gradient).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "recipes" / "smollm2-135m-cpu-grpo.toml"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
TRL, TRL_FULL, LITERAL = "TRL", "TRL-full", "literal"
MAX_TRIES = 16  # rollout steps sampled, from the initial weights, until one has unequal rewards


class LastBatch:
    """A prompt iterator that keeps the batch it yielded last (`rollout` draws its own)."""

    def __init__(self, batches):
        self.batches, self.last = batches, []

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.batches)
        return self.last


def m2po_side(seed: int, tmp: Path, overrides: list[str] = ()) -> dict:
    """Sample, grade and train one step as `m2po train` does; write the rows and the gradient."""
    from safetensors.torch import save_file

    from m2po_cli.config import InspectConfig, load_recipe
    from m2po_cli.data import PromptBatches, load_problems
    from m2po_cli.grader import recipe_grader
    from m2po_cli.learner.policy import Learner
    from m2po_cli.loss import build_loss
    from m2po_cli.models import load_tokenizer, resolve_model
    from m2po_cli.record import Recorder
    from m2po_cli.rollout.episode import Episodes
    from m2po_cli.schedule import Schedule
    from m2po_cli.train.colocated import Sampler, build_engine, rollout
    from m2po_cli.train.reuse import plan_passes
    from m2po_cli.train.updates import train_on

    sets = ["staleness.s=0", "optim.grad_clip=0", f"run.seed={seed}", f'run.output_dir="{tmp}"']
    recipe = load_recipe(GRPO, [*sets, *overrides])
    model_dir = resolve_model(recipe.model.path)
    learner = Learner(model_dir, recipe)
    prompts = LastBatch(
        PromptBatches(
            load_problems(recipe.data),
            load_tokenizer(model_dir),
            recipe.data,
            recipe.rollout.prompts_per_step,
        )
    )
    recorder = Recorder(tmp, InspectConfig(every=0), seed, learner.rank, learner.world)
    engine = build_engine(model_dir, recipe, learner.world, None)
    with recipe_grader(recipe, 1) as grader:
        for index in range(MAX_TRIES):  # the first rollout step whose batch has a gradient at all
            sampler = Sampler(engine, grader, Episodes.one_turn(recipe))
            batch = rollout(sampler, prompts, learner, recipe, recorder, index)
            if bool(batch.advantages_B.ne(0).any()):
                break
        else:
            sys.exit(f"rollout steps 0..{MAX_TRIES - 1}: every group's rewards are equal; try another --seed")

    grads: dict[str, torch.Tensor] = {}

    def keep(*_):
        full = {k: p.grad.full_tensor() for k, p in learner.model.named_parameters() if p.grad is not None}
        grads.update(learner.arch.adapter.to_hf(full))

    learner.optimizer.register_step_pre_hook(keep)
    mismatch = {k: batch.meta[k] for k in ("rollout/logprob_mismatch_mean", "rollout/logprob_mismatch_max")}
    metrics = train_on(
        plan_passes(batch, Schedule.of(recipe)), learner, build_loss(recipe.loss), None, recipe, recorder, 0
    )
    save_file({k: v.contiguous() for k, v in grads.items()}, str(tmp / "m2po_grads.safetensors"))
    engine.close()  # after the update: closing the engine ends the process group the learner uses

    n, offsets, starts = recipe.rollout.n, batch.offsets_B1.tolist(), batch.prompt_len_B.tolist()
    behaviour = batch.behaviour_R.split(batch.response_len_B.tolist())
    template = recipe.data.prompt_template
    rows = []
    for b, p in enumerate(p for p in prompts.last for _ in range(n)):
        tokens = batch.tokens_N[offsets[b] : offsets[b + 1]].tolist()
        assert tokens[: starts[b]] == p.token_ids
        rows.append(
            {
                "content": template.format(problem=p.problem.problem),
                "answer": p.problem.answer,
                "prompt_ids": p.token_ids,
                "completion_ids": tokens[starts[b] :],
                "reward": float(batch.rewards_B[b]),
                "advantage": float(batch.advantages_B[b]),
                "behaviour_logprobs": behaviour[b].tolist(),
            }
        )
    o = recipe.optim
    work = {
        "model_dir": str(model_dir),
        "rows": rows,
        "settings": {
            "prompts": recipe.rollout.prompts_per_step,
            "n": n,
            "max_new_tokens": recipe.rollout.max_new_tokens,
            "temperature": recipe.rollout.temperature,
            "lr": o.lr,
            "weight_decay": o.weight_decay,
            "betas": list(o.betas),
            "adam_eps": o.eps,
            "clip": recipe.loss.eps_low,
        },
    }
    (tmp / "rows.json").write_text(json.dumps(work))
    return {
        **mismatch,
        "clipped share": metrics["loss/clip_frac"],
        "tokens": int(batch.response_len_B.sum()),
        "step": index,
        "rewards": [r["reward"] for r in rows],
    }


def literal_gradient(work: dict) -> dict[str, torch.Tensor]:
    """The GRPO gradient written out, in float64 on the HF model, one unpadded row at a time: on-policy
    the ratio is 1 and its gradient A grad(log p), so the loss is -sum_b A_b sum_t log p_bt / N over
    the N response tokens of the batch, log p at the temperature (m2po's advantages)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work["model_dir"], dtype=torch.float64)
    # Every input lookup has its gradient (HF's embedding gives the pad token's row none).
    model.get_input_embeddings().padding_idx = None
    temperature, rows = work["settings"]["temperature"], work["rows"]
    total = sum(len(r["completion_ids"]) for r in rows)
    for r in rows:
        if r["advantage"] == 0:
            continue
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        logits = model(ids).logits[0, len(r["prompt_ids"]) - 1 : -1] / temperature
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(r["prompt_ids"]) :, None])
        (-r["advantage"] * logp.sum() / total).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def agreement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """Cosine, norm ratio a / b and |a - b| / |b| over the tensors both name, and the tensor whose
    own cosine is lowest."""
    names = [n for n in b if n in a]
    assert "model.embed_tokens.weight" in names, sorted(b)[:5]
    pairs = {n: (a[n].double().flatten(), b[n].double().flatten()) for n in names}
    dot = sum(float(x @ y) for x, y in pairs.values())
    sq_a = sum(float(x @ x) for x, _ in pairs.values())
    sq_b = sum(float(y @ y) for _, y in pairs.values())
    diff = sum(float((x - y) @ (x - y)) for x, y in pairs.values())
    cosines = {n: float(x @ y / (x.norm() * y.norm()).clamp(min=1e-300)) for n, (x, y) in pairs.items()}
    worst = min(cosines, key=cosines.get)
    return {
        "tensors": len(names),
        "cosine": dot / (sq_a * sq_b) ** 0.5,
        "norm_ratio": (sq_a / sq_b) ** 0.5,
        "relative_difference": (diff / sq_b) ** 0.5,
        "worst": (worst, cosines[worst]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="the rollout's seed (m2po's run.seed)")
    ap.add_argument("--keep", type=Path, help="keep the rows, the gradient and the logs in this folder")
    args = ap.parse_args()
    if not TRL_PYTHON.exists():
        sys.exit(f"no TRL venv at {TRL_PYTHON.parent.parent}; run: bash scripts/trl_venv.sh")
    with tempfile.TemporaryDirectory(prefix="peer-trl-gradient-") as tmp_name:
        tmp = args.keep or Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        mine = m2po_side(args.seed, tmp)
        print(
            f"m2po, rollout step {mine['step']}: {mine['tokens']} response tokens, reward mean {sum(mine['rewards']) / len(mine['rewards']):.3f}; "
            f"engine-learner |logprob| mismatch mean {mine['rollout/logprob_mismatch_mean']:.2e}, "
            f"max {mine['rollout/logprob_mismatch_max']:.2e} at temperature 0.7; "
            f"on-policy clipped share {100 * mine['clipped share']:.2f}%",
            flush=True,
        )
        worker = ROOT / "bench" / "peer_trl_worker.py"
        grads = {"m2po": load_file(str(tmp / "m2po_grads.safetensors"))}
        for name, extra in [(TRL, []), (TRL_FULL, ["--full"])]:
            out, trl_grads = tmp / "trl_gradient.json", tmp / "trl_grads.safetensors"
            cmd = [
                str(TRL_PYTHON),
                str(worker),
                "--gradient",
                str(tmp / "rows.json"),
                str(trl_grads),
                str(out),
                *extra,
            ]
            with (tmp / "trl.log").open("a") as log:
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            if done.returncode:
                sys.exit(
                    f"TRL worker exited with {done.returncode}:\n" + (tmp / "trl.log").read_text()[-3000:]
                )
            theirs = json.loads(out.read_text())
            grads[name] = load_file(str(trl_grads))
            print(
                f"{name} ({theirs['dtype']}, gradient checkpointing {theirs['gradient_checkpointing']}, the input "
                f"embedding's padding_idx {theirs['padding_idx']}{' cleared' if theirs['full'] else ''}): the same "
                f"prompt ids {theirs['prompt_ids_equal']}, the same rewards {theirs['rewards_equal']}; advantages "
                f"within {theirs['advantage_max_diff']:.1e} of m2po's, its logprobs within "
                f"{theirs['logprob_vs_engine_max']:.1e} of the engine's",
                flush=True,
            )
        grads[LITERAL] = literal_gradient(json.loads((tmp / "rows.json").read_text()))
    ok = True
    for a, b in [("m2po", TRL), ("m2po", TRL_FULL), ("m2po", LITERAL), (TRL, LITERAL), (TRL_FULL, LITERAL)]:
        g = agreement(grads[a], grads[b])
        ok &= g["cosine"] >= 0.999
        print(
            f"gradient, {a} against {b} ({g['tensors']} tensors): cosine {g['cosine']:.6f}, norm {a} / {b} "
            f"{g['norm_ratio']:.6f}, |{a} - {b}| / |{b}| {g['relative_difference']:.2e}; lowest cosine "
            f"{g['worst'][1]:.6f} ({g['worst'][0]})"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
