"""Time `m2po` (prepare: mask + global metrics, then loss + backward) against `grpo` (loss + backward).

Two synthetic optimizer batches of B x T positions with random response lengths (at least 2 million
valid tokens each): a heavy-tailed one and a worst case for the mask, with GRPO-like advantages. Prints
the median of several interleaved repeats and the ratio; exits 1 if m2po takes over 1.5 times grpo.

    .venv/bin/python bench/bench_loss.py [--batch 512] [--length 8192] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from m2po_cli.config.loss import GRPOLoss, M2POLoss
from m2po_cli.loss import build_loss

MAX_RATIO = 1.5


SCENARIOS = {
    # name: (std of the normal part, scale of the Student-t (2 dof) tail) of log r
    "stale": (0.1, 0.05),  # a heavy tail: M2 0.087 > tau, about 2% of trust-region tokens masked
    "wide": (0.3, 0.0),  # worst case for the mask: half the trust region has M2 > tau and is sorted
}


def synthetic_batch(batch: int, length: int, scenario: str, seed: int = 0) -> dict[str, torch.Tensor]:
    normal, tail = SCENARIOS[scenario]
    g = torch.Generator().manual_seed(seed)
    lengths_B = torch.randint(1, length + 1, (batch,), generator=g)
    mask_BT = torch.arange(length) < lengths_B[:, None]
    behaviour_BT = -torch.rand(batch, length, generator=g) * 4
    t_BT = torch.randn(batch, length, generator=g) / torch.randn(batch, length, generator=g).abs().clamp(
        min=0.05
    )
    log_ratio_BT = normal * torch.randn(batch, length, generator=g) + tail * t_BT
    advantages_BT = torch.randn(batch, 1, generator=g).expand(batch, length)
    return {
        "logprobs_BT": behaviour_BT + log_ratio_BT,
        "behaviour_logprobs_BT": behaviour_BT,
        "advantages_BT": advantages_BT,
        "mask_BT": mask_BT,
    }


def step(loss_fn, batch: dict[str, torch.Tensor], global_pass: bool) -> None:
    logprobs_BT = batch["logprobs_BT"].clone().requires_grad_()
    aux_BT = None
    if global_pass:
        log_ratio_BT = logprobs_BT.detach() - batch["behaviour_logprobs_BT"]
        aux_BT, _ = loss_fn.prepare(log_ratio_BT, batch["advantages_BT"], batch["mask_BT"])
    num_tokens = int(batch["mask_BT"].sum())
    loss, _ = loss_fn(
        logprobs_BT,
        batch["behaviour_logprobs_BT"],
        batch["advantages_BT"],
        batch["mask_BT"],
        aux_BT,
        num_tokens,
    )
    loss.backward()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(scenario: str, args: argparse.Namespace) -> float:
    batch = synthetic_batch(args.batch, args.length, scenario)
    num_tokens = int(batch["mask_BT"].sum())
    if num_tokens < 2_000_000:
        raise SystemExit(f"only {num_tokens:,} valid tokens; the benchmark needs at least 2 million")
    grpo, m2po = build_loss(GRPOLoss()), build_loss(M2POLoss())
    _, metrics = m2po.prepare(
        batch["logprobs_BT"] - batch["behaviour_logprobs_BT"], batch["advantages_BT"], batch["mask_BT"]
    )
    # Interleaved, after one warm-up each, so that a change of machine load affects both alike; the
    # ratio is the median of the per-pair ratios.
    grpo_s, m2po_s = [], []
    for _ in range(args.repeats + 1):
        grpo_s.append(timed(lambda: step(grpo, batch, global_pass=False)))
        m2po_s.append(timed(lambda: step(m2po, batch, global_pass=True)))
    ratio = statistics.median(m / g for m, g in zip(m2po_s[1:], grpo_s[1:], strict=True))
    print(
        f"[{scenario}] {num_tokens:,} valid tokens of {args.batch} x {args.length}; "
        f"{int(metrics['m2po/num_trust_region']):,} in the trust region, "
        f"{int(metrics['m2po/num_masked']):,} masked (M2 {float(metrics['m2po/m2_before']):.4f} -> "
        f"{float(metrics['m2po/m2_after']):.4f})"
    )
    print(f"  grpo (loss + backward):        median {statistics.median(grpo_s[1:]) * 1e3:7.1f} ms")
    print(f"  m2po (mask + loss + backward): median {statistics.median(m2po_s[1:]) * 1e3:7.1f} ms")
    print(f"  ratio m2po / grpo: {ratio:.2f} (median over pairs; limit {MAX_RATIO})")
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed repeats of each; the median is reported"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 keeps torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.repeats} timed repeats")
    ratios = [run(scenario, args) for scenario in SCENARIOS]
    return 0 if max(ratios) <= MAX_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
