"""`m2po eval` with an environment (`[env]`): every sample an episode, as in training.

The samples of all jobs are sampled turn by turn (`rollout.episode.sample_episodes`, the colocated
mode's driver) in chunks, each sample its own seeded request; a finished chunk is scored (the
environment's `reward()`, else the grader on the model's turns' text) and appended to the cache,
so a killed evaluation resumes where it stopped. A record also holds the episode's turns, tool calls
and failed calls.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from m2po_cli.answers import extract_boxed
from m2po_cli.data import Problem, Prompt
from m2po_cli.eval.config import Protocol
from m2po_cli.eval.data import BenchPlan, EvalProblem, Job, append_records
from m2po_cli.eval.sampling import progress_bars, sample_seed, sampling_params
from m2po_cli.grader import Grader
from m2po_cli.rollout.episode import Episode, Episodes, sample_episodes
from m2po_cli.rollout.settings import is_finished
from m2po_cli.rollout.types import Completion

EPISODE_CHUNK = 256  # samples whose episodes run together, then are graded and written


def as_row(problem: EvalProblem) -> Problem:
    """A benchmark problem as the dataset row an environment's reset() reads (with its `id`)."""
    return Problem(0, problem.problem, problem.answer, {"id": problem.id})


def run_episodes(
    llm, grader: Grader, jobs: list[Job], protocol: Protocol, plans: dict[str, BenchPlan], console: Console,
    episodes: Episodes,
) -> None:  # fmt: skip
    """Every missing sample of `jobs` as an episode, `EPISODE_CHUNK` at a time; each chunk graded and
    appended to its benchmark's cache."""
    samples = [(job, sample) for job in jobs for sample in job.samples]
    with progress_bars(console) as progress:
        done = progress.add_task("episodes", total=len(samples))
        for start in range(0, len(samples), EPISODE_CHUNK):
            chunk = samples[start : start + EPISODE_CHUNK]
            prompts = [Prompt(as_row(job.problem), job.prompt_ids) for job, _ in chunk]
            seeds = [sample_seed(protocol, job, sample) for job, sample in chunk]
            groups = sample_episodes(eval_generate(llm, protocol), episodes, prompts, seeds)
            append(grader, chunk, [g.episodes[0] for g in groups], plans)
            progress.advance(done, len(chunk))


def eval_generate(llm, protocol: Protocol):
    """`generate(token_ids, seeds, max_tokens)` for `sample_episodes`: one sample per request, the
    eval protocol's sampling (its top_p included), the engine's report of the tokens it was given."""
    from vllm import TokensPrompt

    def generate(token_ids: list[list[int]], seeds: list[int], max_tokens: list[int] | None):
        limits = max_tokens or [protocol.max_new_tokens] * len(seeds)
        params = [sampling_params(protocol, s, m) for s, m in zip(seeds, limits, strict=True)]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in token_ids], params, use_tqdm=False)
        return [[_completion(out.outputs[0], out.prompt_token_ids)] for out in outputs]

    return generate


def _completion(c, prompt_ids: list[int]) -> Completion:
    # The eval engine keeps no logprobs: an episode's need them only for training.
    finished = is_finished(c.finish_reason)
    return Completion(list(c.token_ids), [0.0] * len(c.token_ids), c.text, finished, prompt_ids=prompt_ids)


def append(
    grader: Grader, chunk: list[tuple[Job, int]], done: list[Episode], plans: dict[str, BenchPlan]
) -> None:
    """Score a chunk's episodes and append one record each to its benchmark's cache."""
    todo = [k for k, e in enumerate(done) if e.reward is None]
    graded = grader.grade_many([done[k].text for k in todo], [chunk[k][0].problem.answer for k in todo])
    scores: list[Any] = [e.reward for e in done]
    for k, score in zip(todo, graded, strict=True):
        scores[k] = score
    graded = [
        (
            job.bench,
            {
                "problem_id": job.problem.id,
                "sample": sample,
                "answer": extract_boxed(episode.text),
                "correct": score == 1.0,
                "tokens": sum(len(c.token_ids) for c in episode.turns),
                "finished": episode.finished,
                "turns": len(episode.turns),
                "tool_calls": episode.tool_calls,
                "tool_failures": episode.tool_failures,
            },
        )
        for (job, sample), episode, score in zip(chunk, done, scores, strict=True)
    ]
    append_records(plans, graded)
