"""`m2po eval`: sample every selected benchmark with vLLM, grade with the training grader, cache, report.

For each target (checkpoint) the prompts of all selected benchmarks are submitted to one engine at
once and vLLM batches them. Finished samples are graded in chunks between engine steps (a chunk
costs about a millisecond a sample, against seconds of decoding), and every graded sample is
appended to its cache file at once, so a killed evaluation resumes where it stopped. Layout of the output directory (`--out`):

    results.json, results.md          this invocation: every target x benchmark
    <label>-<identity>/               one per checkpoint (see eval/targets.py, Target.identity)
        target.json, results.json     what was evaluated, and its results
        <benchmark>-<key>.jsonl       one line per graded sample: problem_id, sample, answer,
                                      correct, tokens, finished

`<key>` hashes the checkpoint, the sampling protocol, the prompt template and the benchmark's
content, so results are reused only when all four match. Neither the number of samples nor
`--limit` is part of the key: raising either generates only the samples that are missing.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement

from m2po_cli.answers import extract_boxed
from m2po_cli.data import DataError
from m2po_cli.eval.config import BenchmarkSpec, EngineOptions, EvalConfig, Protocol
from m2po_cli.eval.data import BenchPlan, EvalProblem, Job, append_records, digest
from m2po_cli.eval.episodes import as_row, run_episodes
from m2po_cli.eval.report import markdown_table, rich_table, summarize_benchmark, summarize_target
from m2po_cli.eval.sampling import progress_bars, sample_seed, sampling_params
from m2po_cli.eval.targets import Target, TargetError, stable_hash
from m2po_cli.grader import Grader
from m2po_cli.rollout.episode import Episodes, episodes_of
from m2po_cli.rollout.settings import is_finished

GRADE_CHUNK = 256  # samples graded per call while the engine runs


def run(
    targets: list[Target],
    specs: list[BenchmarkSpec],
    problems: dict[str, list[EvalProblem]],
    cfg: EvalConfig,
    out: Path,
    limit: int | None,
    console: Console,
) -> list[str]:
    """`m2po eval` after its arguments are checked: evaluate, write results.json and results.md, show
    the table (on stdout; progress is on `console`). Return one line per target that could not be
    evaluated: the others' results are written all the same."""
    for spec in specs:
        if len(problems[spec.name]) != spec.num_problems:
            console.print(
                f"[yellow]warning[/]: {spec.name} has {len(problems[spec.name])} problems, "
                f"the benchmark has {spec.num_problems}"
            )
    summaries, failures = evaluate(targets, specs, problems, cfg, out, limit, console)
    if not summaries:
        return failures
    results = {"config": cfg.model_dump(mode="json"), "limit": limit, "targets": summaries}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown_table(summaries, limit))
    stdout = Console(soft_wrap=True)
    table = rich_table(summaries, limit)
    # Never squeeze labels and numbers into ellipses (rich's default in a narrow or piped console).
    natural = Measurement.get(stdout, stdout.options.update_width(1000), table).maximum
    stdout.width = max(stdout.width, natural)
    stdout.print(table)
    console.print(f"results: {out / 'results.json'}, {out / 'results.md'}", soft_wrap=True)
    return failures


def evaluate(
    targets: list[Target],
    specs: list[BenchmarkSpec],
    problems: dict[str, list[EvalProblem]],
    cfg: EvalConfig,
    out: Path,
    limit: int | None,
    console: Console,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Evaluate every target on every benchmark: one summary per target evaluated (see
    eval/report.py), and one line for each target that could not be (a damaged or missing checkpoint,
    a corrupt cache file)."""
    engine = EvalEngine(cfg.engine)
    graders: list[Grader] = []  # started when the first target needs one
    summaries, failures = [], []
    try:
        for target in targets:
            try:
                summaries.append(
                    evaluate_target(target, specs, problems, cfg, out, limit, console, engine, graders)
                )
            except (TargetError, DataError) as e:  # reported once all targets are done
                failures.append(str(e))
    finally:
        engine.close()
        for grader in graders:
            grader.close()
    return summaries, failures


def evaluate_target(
    target: Target,
    specs: list[BenchmarkSpec],
    problems: dict[str, list[EvalProblem]],
    cfg: EvalConfig,
    out: Path,
    limit: int | None,
    console: Console,
    engine: EvalEngine,
    graders: list[Grader],
) -> dict[str, Any]:
    model_dir = target.model_dir()
    target_dir = out / f"{slug(target.label)}-{target.identity()[:8]}"
    target_dir.mkdir(parents=True, exist_ok=True)
    info = {"label": target.label, "kind": target.kind, "path": target.path, "model_dir": str(model_dir)}
    (target_dir / "target.json").write_text(json.dumps(info, indent=2) + "\n")
    episodes = target_episodes(cfg, model_dir, target.path)
    plans = plan_target(target, model_dir, specs, problems, cfg, target_dir, limit, episodes)
    jobs = [job for plan in plans for job in plan.jobs]
    _report_plan(console, target.label, plans, jobs)
    if jobs:
        if not graders:
            graders.append(Grader(cfg.grader.workers, cfg.grader.timeout_s))
        engine.load(model_dir, context_length(model_dir, cfg))
        by_name = {p.spec.name: p for p in plans}
        if episodes.multi_turn:
            run_episodes(engine.llm, graders[0], jobs, cfg.protocol, by_name, console, episodes)
        else:
            run_jobs(engine.llm, graders[0], jobs, cfg.protocol, by_name, console)
    summary = summarize_target(info, {p.spec.name: summarize_benchmark(p) for p in plans})
    (target_dir / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --- planning ------------------------------------------------------------------------------------


def target_episodes(cfg: EvalConfig, model_dir: Path, name: str) -> Episodes:
    """The episodes every sample of a target runs (`[env]`; one turn without), checked before sampling."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return episodes_of(cfg.env, cfg.protocol.max_new_tokens, tokenizer, model_dir, name)


def context_length(model_dir: Path, cfg: EvalConfig) -> int:
    """The engine's context: prompt budget + response budget (an episode's, with `[env]`), capped at
    the model's own limit."""
    config = json.loads((model_dir / "config.json").read_text())
    protocol = cfg.protocol
    wanted = protocol.max_prompt_tokens + cfg.env.episode_tokens(protocol.max_new_tokens)
    # Architectures without this key state their context otherwise; vLLM rejects a `wanted` beyond it.
    return min(wanted, config.get("max_position_embeddings", wanted))


def plan_target(
    target: Target,
    model_dir: Path,
    specs: list[BenchmarkSpec],
    problems: dict[str, list[EvalProblem]],
    cfg: EvalConfig,
    target_dir: Path,
    limit: int | None,
    episodes: Episodes,
) -> list[BenchPlan]:
    from transformers import AutoTokenizer

    from m2po_cli.data import encode_prompt

    protocol = cfg.protocol
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    max_len = context_length(model_dir, cfg)
    identity = target.identity()
    env = [cfg.env.model_dump()] if cfg.env.name else []  # one turn: the key of a run without [env]
    plans = []
    for spec in specs:
        template = protocol.prompt_template or spec.prompt_template
        key = stable_hash([identity, _sampling(protocol), template, digest(problems[spec.name]), *env])
        plan = BenchPlan(
            spec,
            problems[spec.name][:limit],
            protocol.samples or spec.samples,
            target_dir / f"{spec.name}-{key[:12]}.jsonl",
        )
        plan.records = read_records(plan.cache)
        for problem in plan.problems:
            opening = episodes.opening(as_row(problem))
            ids = encode_prompt(tokenizer, template, problem.problem, opening, episodes.tools)
            room = max_len - len(ids)
            if len(ids) > protocol.max_prompt_tokens or room < 1:
                plan.skipped.append(problem.id)
                continue
            plan.clamped += room < protocol.max_new_tokens
            missing = [i for i in range(plan.num_samples) if (problem.id, i) not in plan.records]
            if missing:
                job = Job(spec.name, problem, ids, missing, min(protocol.max_new_tokens, room))
                plan.jobs.append(job)
        plans.append(plan)
    return plans


def _sampling(protocol: Protocol) -> list:
    p = protocol
    return [p.temperature, p.top_p, p.max_new_tokens, p.max_prompt_tokens, p.seed]


def read_records(path: Path) -> dict[tuple[str, int], dict]:
    """Graded samples of a cache file by (problem id, sample index).

    A line cut short by a kill mid-write can only be the last one, without its newline: it is
    dropped from the file. Any other unreadable line is an error naming the file and the line.
    """
    if not path.exists():
        return {}
    lines = path.read_text().splitlines(keepends=True)
    records = {}
    for i, line in enumerate(lines):
        try:
            r = json.loads(line)
            key = (r["problem_id"], r["sample"])
        except (json.JSONDecodeError, KeyError, TypeError):
            if i != len(lines) - 1 or line.endswith("\n"):
                raise DataError(
                    f"{path}: line {i + 1} is not a sample record; delete the file to sample its benchmark again"
                ) from None
            path.write_text("".join(lines[:i]))
            break
        records[key] = r
    return records


# --- generation and grading ----------------------------------------------------------------------


class EvalEngine:
    """One vLLM engine, kept across targets of the same architecture (weights reloaded in place)."""

    def __init__(self, cfg: EngineOptions):
        self.cfg = cfg
        self.llm = None
        self.signature: str | None = None

    def load(self, model_dir: Path, max_model_len: int) -> None:
        signature = stable_hash([_config_files(model_dir), max_model_len])
        if self.llm is not None and signature == self.signature:
            self.llm.collective_rpc("m2po_load_weights_from", args=(str(model_dir),))
            self.llm.reset_prefix_cache()  # cached KV was computed by the previous weights
            return
        self.close()
        self.llm = build_eval_llm(model_dir, self.cfg, max_model_len)
        self.signature = signature

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


def build_eval_llm(model_dir: Path, cfg: EngineOptions, max_model_len: int):
    """An in-process `vllm.LLM` for evaluation (the CPU settings of training's engine)."""

    from m2po_cli.device import resolve_dtype
    from m2po_cli.rollout.engine import build_llm

    return build_llm(
        model_dir, cfg, dtype=resolve_dtype(cfg.dtype), max_model_len=max_model_len, in_process=True
    )


def run_jobs(
    llm, grader: Grader, jobs: list[Job], protocol: Protocol, plans: dict[str, BenchPlan], console: Console
) -> None:
    """Submit every sample to the engine at once, each its own seeded request (the prompt's KV is
    computed once, prefix caching); grade and append finished samples as they arrive."""
    from vllm import TokensPrompt

    requests = [(i, sample) for i, job in enumerate(jobs) for sample in job.samples]
    inputs = llm.renderer.render_cmpl(
        [TokensPrompt(prompt_token_ids=jobs[i].prompt_ids) for i, _ in requests]
    )
    for (i, sample), engine_input in zip(requests, inputs, strict=True):
        job = jobs[i]
        params = sampling_params(protocol, sample_seed(protocol, job, sample), job.max_tokens)
        llm.llm_engine.add_request(f"{i}:{sample}", engine_input, params)
    total = sum(len(j.samples) for j in jobs)
    with progress_bars(console) as progress:
        generated = progress.add_task("generated", total=total)
        graded = progress.add_task("graded", total=total)
        finished: list[tuple[Job, int, Any]] = []
        while llm.llm_engine.has_unfinished_requests():
            for out in llm.llm_engine.step():
                if out.finished:
                    i, sample = map(int, out.request_id.split(":"))
                    finished.append((jobs[i], sample, out.outputs[0]))
                    progress.advance(generated, 1)
            if len(finished) >= GRADE_CHUNK or (finished and not llm.llm_engine.has_unfinished_requests()):
                grade_and_append(grader, finished, plans, lambda k: progress.advance(graded, k))
                finished = []


def grade_and_append(
    grader: Grader, finished: list[tuple[Job, int, Any]], plans: dict[str, BenchPlan], advance: Callable
) -> None:
    scores = grader.grade_many(
        [c.text for _, _, c in finished], [job.problem.answer for job, _, _ in finished]
    )
    graded = [
        (
            job.bench,
            {
                "problem_id": job.problem.id,
                "sample": sample,
                "answer": extract_boxed(completion.text),
                "correct": score == 1.0,
                "tokens": len(completion.token_ids),
                "finished": is_finished(completion.finish_reason),
            },
        )
        for (job, sample, completion), score in zip(finished, scores, strict=True)
    ]
    append_records(plans, graded)
    advance(len(finished))


def _report_plan(console: Console, label: str, plans: list[BenchPlan], jobs: list[Job]) -> None:
    cached = sum(len(p.records) for p in plans)
    todo = sum(len(j.samples) for j in jobs)
    skipped = sum(len(p.skipped) for p in plans)
    too_long = f", {skipped} problems skipped (prompt too long)" if skipped else ""
    console.print(f"[bold]{label}[/]: {todo} samples to generate, {cached} cached{too_long}")


# --- helpers -------------------------------------------------------------------------------------


def _config_files(model_dir: Path) -> list:
    """Everything but the weights: equal for checkpoints that one engine can serve in turn."""
    weights = (".safetensors", ".safetensors.index.json")
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.endswith(weights))
    return [[p.name, hashlib.sha256(p.read_bytes()).hexdigest()] for p in files]


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-")
