"""The learner: a torchtitan decoder sharded with FSDP2, AdamW, and the per-token logprobs it trains on.

The same code runs in one process (a one-rank gloo group) and under `torchrun` (gloo on CPU, NCCL on
GPU). Gradients are SUMMED across ranks, never averaged: each rank's loss is already divided by the
global token count of the optimizer batch, so the sum is the token-mean over the whole batch (and gloo
has no PREMUL_SUM/AVG reduce-scatter anyway).

Sequences are right-padded `[B, L]` rows: prompt then response; `mask_BL` marks response tokens.
On the mask, position t of `logprobs_BL` holds log pi(token_t | tokens_<t) at the sampling
temperature; elsewhere it is 0 (only response tokens are scored, see `logprobs.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from m2po_cli.config import Recipe
from m2po_cli.distributed import add_into, init_distributed, sum_over_ranks
from m2po_cli.hf_weights import HFWeights, export_dtype
from m2po_cli.learner.batch import IDLE, Batch, plan_micro_batches
from m2po_cli.learner.build import build_model
from m2po_cli.learner.forward import forward_logprobs
from m2po_cli.learner.logprobs import install_head
from m2po_cli.learner.mask_correction import correction_rows, correction_weights, provisional_keep
from m2po_cli.lora import with_lora, write_adapter
from m2po_cli.loss import PolicyLoss
from m2po_cli.loss_metrics import ratio_quantiles
from m2po_cli.titan import ModelArch, load_arch


class Learner:
    """Owns the sharded model, the optimizer and the LR schedule."""

    def __init__(self, model_dir: Path, recipe: Recipe):
        self.recipe = recipe
        self.rank, self.world = init_distributed(timedelta(minutes=recipe.run.collective_timeout_minutes))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.arch: ModelArch = load_arch(model_dir)
        self.lora = recipe.lora if recipe.lora.enabled else None
        if self.lora is not None:
            self.arch = replace(self.arch, config=with_lora(self.arch.config, self.lora))
        self.replicas, _ = recipe.parallel.degrees(self.world)
        self.model = build_model(self.arch, recipe, model_dir, self.rank, self.world, self.device)
        self.head = install_head(self.model)
        scale = self.lora.alpha / self.lora.rank if self.lora is not None else 0.0
        self.hf = HFWeights(self.model, self.arch.adapter, self.rank, scale)
        o = recipe.optim
        # Fused: one kernel over all parameters per state update, on the CPU as on a GPU (the
        # default on the CPU is a Python loop of ~10 ops per parameter, ~0.8 s a step at 135M).
        # With LoRA only the adapter trains: the frozen base gets neither gradients nor AdamW state.
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.version = 0  # optimizer updates applied
        self._provisional_z = math.inf  # the previous update's mask threshold (`mask_correction`)
        self._correction_frac = 0.0  # the last update's correction share (what `auto` judges by)

    def _lr_factor(self, update: int) -> float:
        o = self.recipe.optim
        if update < o.warmup_updates:
            return (update + 1) / o.warmup_updates
        total = max(1, self.recipe.run.steps * self.recipe.updates_per_step - o.warmup_updates)
        progress = min(1.0, (update - o.warmup_updates) / total)
        if o.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if o.schedule == "linear":
            return 1 - progress
        return 1.0

    def forward_logprobs(
        self, batch: Batch, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[B, L]` logprobs (with grad if enabled) and entropies of the response tokens; 0 elsewhere."""
        temperature = self.recipe.rollout.temperature
        return forward_logprobs(self.model, self.head, batch, temperature, self.device, with_entropy)

    def micro_batches(self, batch: Batch) -> list[tuple[torch.Tensor, Batch]]:
        """(row index, rows) of this rank's micro-batches (`plan_micro_batches`), padded with idle
        ones (no rows, `IDLE`) to the largest count of any rank: FSDP2 gathers weights in every
        forward, so all ranks run the same number."""
        batch, parts = plan_micro_batches(batch, self.recipe.train)
        count = torch.tensor([len(parts)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        idle = [(torch.zeros(0, dtype=torch.long), IDLE)] * (int(count) - len(parts))
        return [(index, batch.take(index)) for index in parts] + idle

    @torch.no_grad()
    def score(self, batch: Batch, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Current-policy logprobs (and entropies) of the response tokens of `batch`; `[B, L]`, 0 elsewhere.

        A collective (every rank calls it, with its own rows). No grad; logits are never whole.
        """
        logprobs_BL = torch.zeros_like(batch.mask_BL)
        entropy_BL = torch.zeros_like(batch.mask_BL) if with_entropy else None
        for index, part in self.micro_batches(batch):
            lp, ent = self.forward_logprobs(part, with_entropy)
            if not index.numel():
                continue
            logprobs_BL[index, : lp.shape[1]] = lp.cpu()
            if with_entropy:
                entropy_BL[index, : ent.shape[1]] = ent.cpu()
        return logprobs_BL, entropy_BL

    def update(self, batch: Batch, loss_fn: PolicyLoss, num_tokens: int) -> dict[str, float]:
        """One optimizer update on this rank's rows; `num_tokens` counts the whole global batch.

        Micro-batches hold rows of similar length (`micro_batches`); each one's loss is divided by
        the global `num_tokens`, so the gradient is the token mean whatever the grouping. A loss
        with a global mask gets it either from a no-grad pass run first (`score_first`) or from the
        training forwards themselves, with a correction afterwards (`correct_after`); both give the
        same gradient and metrics. `train.global_pass` picks one (`auto`: when every rank's rows are
        one micro-batch, the mask from that forward before its backward, with no other pass;
        otherwise the cheaper way, judged by what the previous update's correction cost).
        """
        parts = self.micro_batches(batch)  # a collective: every rank gets the same count
        if len(parts) == 1 and self._in_forward_possible(loss_fn):
            metrics, log_ratio_BL = self._update_in_forward(batch, parts[0], loss_fn, num_tokens)
        elif loss_fn.keep_mask_aux and self._correct_after():
            metrics, log_ratio_BL = self._update_correct_after(batch, parts, loss_fn, num_tokens)
        else:
            metrics, log_ratio_BL = self._update_score_first(batch, parts, loss_fn, num_tokens)
        grad_norm = self._clip()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        metrics.update(ratio_quantiles(log_ratio_BL, batch.mask_BL, group=dist.group.WORLD))
        out = {k: float(v) for k, v in metrics.items()}
        out["optim/grad_norm"] = grad_norm
        out["optim/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _in_forward_possible(self, loss_fn: PolicyLoss) -> bool:
        """Whether `auto` may take the global mask from the training forward itself: then every
        rank's rows must be one micro-batch (`update` checks, over all ranks)."""
        return loss_fn.needs_global_pass and self.recipe.train.global_pass == "auto"

    def _update_in_forward(
        self, batch: Batch, micro: tuple[torch.Tensor, Batch], loss_fn: PolicyLoss, num_tokens: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Every rank's rows are one micro-batch: its forward's logprobs give the global mask (or
        cap) by `prepare` before its backward runs, so no other pass is needed. The gradient and
        metrics are `score_first`'s: the same logprobs, the same `prepare`."""
        index, part = micro
        lp, _ = self.forward_logprobs(part)
        log_ratio_BL = torch.zeros_like(batch.mask_BL)
        length = part.tokens_BL.shape[1]
        if index.numel():
            log_ratio_BL[index, :length] = (lp.detach().cpu() - part.behaviour_logprobs_BL) * part.mask_BL
        aux_BL, metrics = loss_fn.prepare(
            log_ratio_BL, batch.advantages_BL, batch.mask_BL, group=dist.group.WORLD, rows_B=batch.rows_B
        )
        if loss_fn.keep_mask_aux:  # what `correct_after` would cost, should the batch outgrow one pass
            metrics["m2po/correction_frac"] = self._correct(batch, log_ratio_BL, aux_BL, None, 0)
            self._provisional_z = loss_fn.mask_threshold(metrics)
        if index.numel():
            aux = aux_BL[index, :length]
        else:  # a rank without rows: its idle row scores nothing but joins every collective
            part = replace(part, mask_BL=torch.zeros_like(part.mask_BL))
            aux = torch.zeros(part.mask_BL.shape, dtype=aux_BL.dtype)
        split = self._split(part, batch.split_B is not None)
        loss, m = self._loss(loss_fn, lp, part, aux.to(self.device), num_tokens, split)
        self._backward(loss, True)
        return metrics | sum_over_ranks({**m, "loss/loss": loss}), log_ratio_BL

    def _correct_after(self) -> bool:
        if self.recipe.train.global_pass == "auto":
            # A correction of share f costs a forward and backward over f of the tokens (~3f
            # forwards); the no-grad pass one forward.
            return 3 * self._correction_frac <= 1
        return self.recipe.train.global_pass == "correct_after"

    def _update_score_first(
        self, batch: Batch, parts: list[tuple[torch.Tensor, Batch]], loss_fn: PolicyLoss, num_tokens: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Gradients accumulated; the metrics and the raw log-ratios the forwards saw."""
        metrics: dict[str, torch.Tensor] = {}
        aux_BL = None
        if loss_fn.needs_global_pass:
            current_BL, _ = self.score(batch)
            log_ratio_BL = (current_BL - batch.behaviour_logprobs_BL) * batch.mask_BL
            aux_BL, global_metrics = loss_fn.prepare(
                log_ratio_BL, batch.advantages_BL, batch.mask_BL, group=dist.group.WORLD, rows_B=batch.rows_B
            )
            metrics.update(global_metrics)
            if loss_fn.keep_mask_aux:  # what `correct_after` would have cost, for `auto`
                metrics["m2po/correction_frac"] = self._correct(batch, log_ratio_BL, aux_BL, None, 0)
                self._provisional_z = loss_fn.mask_threshold(metrics)
        additive: dict[str, torch.Tensor] = {}
        splitting = batch.split_B is not None  # the same on every rank
        seen_log_ratio_BL = torch.zeros_like(batch.mask_BL)  # raw ratios at the step's start
        for index, part, lp, last in self._forwards(parts):
            length = part.tokens_BL.shape[1]
            seen_log_ratio_BL[index, :length] = (
                lp.detach().cpu() - part.behaviour_logprobs_BL
            ) * part.mask_BL
            aux = aux_BL[index, :length].to(self.device) if aux_BL is not None else None
            loss, m = self._loss(loss_fn, lp, part, aux, num_tokens, self._split(part, splitting))
            self._backward(loss, last)
            add_into(additive, {**m, "loss/loss": loss})  # additive: each micro-batch's share of the mean
        if not batch.num_rows:  # no rows here: join the other ranks' sum with zeros of the same keys
            with torch.no_grad():
                zeros = torch.zeros(batch.mask_BL.shape)
                loss, m = loss_fn(*[zeros] * 4, aux_BL, num_tokens, self._split(batch, splitting))
            additive = {k: torch.zeros(()) for k in [*m, "loss/loss"]}
        return metrics | sum_over_ranks(additive), seen_log_ratio_BL

    def _update_correct_after(
        self, batch: Batch, parts: list[tuple[torch.Tensor, Batch]], loss_fn: PolicyLoss, num_tokens: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The global mask from the training forwards' own logprobs (`mask_correction`): forwards and
        backwards under the provisional mask, the exact mask by `prepare`, then `_correct`. Metrics
        come from the saved logprobs and the exact mask, as `score_first` gives them."""
        provisional_BL = torch.zeros_like(batch.mask_BL, dtype=torch.bool)
        current_BL = torch.zeros_like(batch.mask_BL)
        for index, part, lp, last in self._forwards(parts):
            length = part.tokens_BL.shape[1]
            current_BL[index, :length] = lp.detach().cpu()
            log_ratio_BL = (current_BL[index, :length] - part.behaviour_logprobs_BL) * part.mask_BL
            keep_BL = self._provisional_keep(log_ratio_BL, part)
            provisional_BL[index, :length] = keep_BL
            loss, _ = self._loss(loss_fn, lp, part, keep_BL.to(self.device), num_tokens)
            self._backward(loss, last)
        log_ratio_BL = (current_BL - batch.behaviour_logprobs_BL) * batch.mask_BL
        keep_BL, metrics = loss_fn.prepare(
            log_ratio_BL, batch.advantages_BL, batch.mask_BL, group=dist.group.WORLD, rows_B=batch.rows_B
        )
        metrics["m2po/correction_frac"] = self._correct(
            batch, log_ratio_BL, keep_BL, provisional_BL, num_tokens
        )
        self._provisional_z = loss_fn.mask_threshold(metrics)
        with torch.no_grad():
            args = (batch.behaviour_logprobs_BL, batch.advantages_BL, batch.mask_BL, keep_BL, num_tokens)
            loss, m = loss_fn(current_BL, *args, self._split(batch, batch.split_B is not None))
        return metrics | sum_over_ranks({**m, "loss/loss": loss}), log_ratio_BL

    def _provisional_keep(self, log_ratio_BL: torch.Tensor, batch: Batch) -> torch.Tensor:
        return provisional_keep(log_ratio_BL, batch.advantages_BL, batch.mask_BL.bool(), self._provisional_z)

    def _correct(
        self,
        batch: Batch,
        log_ratio_BL: torch.Tensor,
        keep_BL: torch.Tensor,
        provisional_BL: torch.Tensor | None,
        num_tokens: int,
    ) -> torch.Tensor:
        """Accumulate the correction's gradient (`mask_correction`) over the rows where `keep_BL` and
        `provisional_BL` differ; return its share of the tokens at the rank where it is largest.

        `provisional_BL` None: nothing runs; the share is what a correction would have cost.
        A collective: every rank runs as many correction micro-batches as the busiest one.
        """
        run = provisional_BL is not None
        if not run:
            provisional_BL = self._provisional_keep(log_ratio_BL, batch)
        rows_K, cut_K, change_BL = correction_rows(keep_BL, provisional_BL)
        share = torch.tensor([float(cut_K.sum()) / max(int(batch.lengths_B.sum()), 1)], dtype=torch.float64)
        dist.all_reduce(share, op=dist.ReduceOp.MAX)
        self._correction_frac = float(share)
        if not run:
            return share[0]
        weight_KL = correction_weights(change_BL, log_ratio_BL, batch.advantages_BL, num_tokens)[rows_K]
        mask_KL = (change_BL[rows_K] != 0).float()  # only the changed tokens are scored
        prompts_K = None if batch.prompt_lengths_B is None else batch.prompt_lengths_B[rows_K]
        fix = Batch(
            batch.tokens_BL[rows_K], mask_KL, weight_KL, batch.advantages_B[rows_K], cut_K, None, prompts_K
        )
        for index, _, lp, last in self._forwards(self.micro_batches(fix)):
            weight = weight_KL[index, : lp.shape[1]].to(self.device)
            self._backward(-(lp * weight).sum(), last)
        return share[0]

    def _loss(self, loss_fn, lp, part, aux, num_tokens, split_BL=None):
        return loss_fn(
            lp,
            part.behaviour_logprobs_BL.to(self.device),
            part.advantages_BL.to(self.device),
            part.mask_BL.to(self.device),
            aux,
            num_tokens,
            split_BL,
        )

    def _split(self, part: Batch, splitting: bool) -> torch.Tensor | None:
        """The `[B, L]` token classes of `part` for the loss's metrics when the batch has them
        (`splitting`, the same on every rank); a part without (an idle one) is all class 0."""
        if not splitting:
            return None
        split_B = part.split_B if part.split_B is not None else torch.zeros(part.num_rows, dtype=torch.long)
        return split_B[:, None].expand(part.mask_BL.shape).to(self.device)

    def _forwards(
        self, parts: list[tuple[torch.Tensor, Batch]]
    ) -> Iterator[tuple[torch.Tensor, Batch, torch.Tensor, bool]]:
        """(row index, rows, logprobs with grad, whether it is the last) per micro-batch; the caller
        runs the backward (`_backward`). A rank with fewer micro-batches than another runs an idle
        forward and backward for each missing one (`micro_batches` pads `parts` with them)."""
        for i, (index, part) in enumerate(parts):
            last = i == len(parts) - 1  # every rank runs the same count
            lp, _ = self.forward_logprobs(part)
            if not index.numel():
                self._backward(lp.sum() * 0.0, last)  # this rank's share of FSDP2's collectives
                continue
            yield index, part, lp, last

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Accumulate `loss`'s gradient. With replicas (HSDP) the gradients cross between them only at
        the last micro-batch of a pass: the earlier ones are reduce-scattered within the shard group
        and summed there, so the network between nodes carries them once per pass, not per micro-batch."""
        if self.replicas > 1:
            self.model.set_requires_all_reduce(last)
        loss.backward()

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.recipe.optim.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    # --- weights out ------------------------------------------------------------------------------

    def hf_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under HF names, cast to `dtype`, one parameter at a time (`HFWeights.stream`)."""
        return self.hf.stream(dtype)

    def adapter_tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter under PEFT keys, one tensor at a time (`HFWeights.adapter_tensors`)."""
        return self.hf.adapter_tensors(dtype)

    def hf_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return self.hf.shapes()

    def export_hf(self, out_dir: Path, model_dir: Path, shard_bytes: int = 4 * 2**30) -> None:
        """Write a safetensors checkpoint with the source's config and tokenizer (rank 0 writes); with
        LoRA, the base with the adapter merged in."""
        self.hf.export(out_dir, model_dir, self.recipe.model.dtype, shard_bytes)

    def export_adapter(self, out_dir: Path) -> None:
        """The LoRA adapter as a PEFT folder (rank 0 writes; every rank gathers), in the export dtype."""
        dtype = getattr(torch, export_dtype(self.recipe.model.dtype))
        tensors = list(self.adapter_tensors(dtype))
        if self.rank == 0:
            write_adapter(out_dir, tensors, self.lora, self.recipe.model.path)

    # --- checkpoint state -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint holds: the trained parameters (with LoRA the adapter alone: the base is
        the model's checkpoint, read again at resume) and their optimizer state."""
        return {
            "model": get_model_state_dict(self.model, options=self._state_options),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
        }

    def load_state_dict(self, state: dict) -> None:
        # With LoRA the checkpoint holds the adapter alone (`state_dict` made the template it was
        # read into): the frozen base, read from the model's checkpoint, is not in it.
        options = replace(self._state_options, strict=self.lora is None)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])

    @property
    def _state_options(self) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=self.lora is not None)

    def extra_state(self) -> dict:
        # The mask's provisional threshold and last correction share: a resumed run takes the same
        # way to the mask as the uninterrupted one.
        mask = {"provisional_z": self._provisional_z, "correction_frac": self._correction_frac}
        return {"scheduler": self.scheduler.state_dict(), "version": self.version, "global_mask": mask}

    def load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self._provisional_z = state["global_mask"]["provisional_z"]
        self._correction_frac = state["global_mask"]["correction_frac"]
