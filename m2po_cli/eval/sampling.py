"""How `m2po eval` samples: each sample its own seeded request, with the protocol's sampling; and the
progress bars it shows."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from m2po_cli.eval.config import Protocol
from m2po_cli.eval.data import Job
from m2po_cli.rollout.settings import request_seed


def sampling_params(protocol: Protocol, seed: int, max_tokens: int):
    """One sample's sampling, seeded (`sample_seed`): top_p < 1 is allowed here (training's
    RolloutConfig forbids it)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        seed=seed,
        temperature=protocol.temperature,
        top_p=protocol.top_p,
        top_k=0,
        min_p=0.0,
        max_tokens=max_tokens,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def sample_seed(protocol: Protocol, job: Job, sample: int) -> int:
    """The seed of one sample: the protocol's seed, the benchmark, the problem and the sample index."""
    return request_seed(protocol.seed, job.bench, job.problem.id, sample)


def progress_bars(console: Console) -> Progress:
    """The bars of an evaluation: generated and graded samples (or finished episodes)."""
    return Progress(
        TextColumn("{task.description:>9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("samples"),
        TimeElapsedColumn(),
        console=console,
    )
