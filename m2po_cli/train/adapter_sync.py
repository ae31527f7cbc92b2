"""LoRA weight syncs in separate mode: the adapter to every `vllm serve` engine, checked on arrival.

Every rank gathers the adapter (a few MB to a few hundred MB, `Learner.adapter_tensors`); rank 0
writes it as a PEFT folder where the engines can read it (shared memory when the run started them,
else `<run>/adapters/`) and, under the producer's swap, has each engine load it under the version's
name (`/v1/load_lora_adapter`). The engines are not paused and keep their KV cache: a request in
flight goes on with the adapter it named, so each token's version is its request's (`producer`), and
requests admitted from then on name the new one.

An adapter stays loaded, and its folder on disk (an engine reloads an evicted adapter from it), while
a request may still name it. The staleness bound says until when: a request submitted at version v is
trained by update v + max_staleness, which the learner cannot pass before it has been answered; so at
the push of version u every version below u - max_staleness is unloaded and its folder removed. An
engine holds at most `payload.lora_slots` adapters.

After each load every rank checks the engines (`push.probe_gap`): rank 0 asks each engine for the
probe's next-token logprobs under the new name (one prefill, at a higher priority than the rollouts,
so it waits neither behind the requests queued nor for decode steps), and all ranks score the same
tokens with the learner, which still holds that version; a mean gap above
`rollout.push_check_tolerance` stops the run in one line.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from m2po_cli.config import Recipe
from m2po_cli.learner.policy import Learner
from m2po_cli.lora import write_adapter
from m2po_cli.rollout.payload import ADAPTER_PREFIX, Adapter, adapter_name
from m2po_cli.rollout.server import (
    GENERATE,
    EngineError,
    EngineServer,
    sampling_body,
)
from m2po_cli.rollout.transport import PREFIX, WeightTransport, shm_root, sweep_orphans
from m2po_cli.train.push import (
    ADAPTERS,
    PROBE_SEED,
    PROBE_TOP,
    PUSH_MISMATCH,
    probe_gap,
    probe_prompt,
    require_agreement,
)

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
LOADED = "rollout/adapters_loaded"  # the metric: versions the engines hold after the last push (rank 0)


class AdapterTransport(WeightTransport):
    """`WeightTransport` of a LoRA run's adapter, in the serving `dtype`; `servers` (rank 0 only, with
    `swap`) take it; `vocab` bounds the probe's token ids."""

    def __init__(self, recipe: Recipe, learner: Learner, dtype: torch.dtype, swap, servers, vocab: int):
        super().__init__(learner.rank, recipe.rollout.sync_every, dtype, swap)
        self.recipe, self.servers = recipe, servers
        self.probe = probe_prompt(vocab)
        self.loaded: list[int] = []  # versions the engines hold, oldest first
        self.mismatch = 0.0  # the last check's gap (`rollout/push_check_mismatch`)
        self.folder: Path | None = None
        if servers is not None:
            if all(s.proc is not None for s in servers):  # started here: this host reads shared memory
                self.swept = sweep_orphans(shm_root())  # a killed run's folders
                prefix = f"{PREFIX}{recipe.run.name}-adapters-pid{os.getpid()}-"
                self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir=shm_root()))
            else:  # attached engines read the run's folder (on a file system they share)
                self.folder = recipe.run_dir / ADAPTERS / "separate"
                self.folder.mkdir(parents=True, exist_ok=True)

    def _send(self, learner: Learner) -> int:
        tensors = list(learner.adapter_tensors(self.dtype))  # every rank: the gathers
        version = learner.version
        if self.swap is not None:
            folder = write_adapter(
                self.folder / adapter_name(version), tensors, learner.lora, self.recipe.model.path
            )
            self.swap(lambda servers: self._load(servers, folder, version), version)
        self._check(learner, version)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def _load(self, servers: list[EngineServer], folder: Path, version: int) -> None:
        if not self.loaded:  # an attached engine may hold a former run's adapters under these names
            for server in servers:
                for model in server.http.get("/v1/models").json().get("data") or []:
                    if model["id"].startswith(ADAPTER_PREFIX):
                        server.post(UNLOAD, json={"lora_name": model["id"]})
                server.set_version(version)  # numeric spans; each token's version is its adapter's
        for server in servers:
            server.post(LOAD, json={"lora_name": adapter_name(version), "lora_path": str(folder)})
        self.loaded.append(version)
        for old in [v for v in self.loaded if v < version - self.recipe.staleness.max_staleness]:
            for server in servers:  # every request of `old` has been answered (the module's docstring)
                server.post(UNLOAD, json={"lora_name": adapter_name(old)})
            shutil.rmtree(self.folder / adapter_name(old), ignore_errors=True)
            self.loaded.remove(old)

    def _check(self, learner: Learner, version: int) -> None:
        """Rank 0 has every engine score the probe's next tokens under the new adapter; every rank
        compares them with the learner's."""
        answers: list = [None]
        if self.servers is not None:
            answers = [[self._probe(server, adapter_name(version)) for server in self.servers]]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(answers, src=0)
        self.mismatch = probe_gap(learner, self.probe, answers[0])
        require_agreement(self.mismatch, self.recipe.rollout.push_check_tolerance, Adapter(Path(), version))

    def _probe(self, server: EngineServer, model: str) -> dict[int, float]:
        """`VLLMEngine.next_logprobs` of a `vllm serve` engine, ahead of the rollouts it queues (the
        engines of a LoRA run schedule by priority; rollouts keep the default, 0)."""
        body = sampling_body(self.probe, self.recipe.rollout, PROBE_SEED, model, max_tokens=1)
        body["sampling_params"]["logprobs"] = PROBE_TOP
        body["priority"] = -1
        choices = server.post(GENERATE, json=body).json().get("choices") or []
        content = choices[0]["logprobs"]["content"] if choices and choices[0].get("logprobs") else []
        if not content:
            raise EngineError(f"rollout server {server.url}: the push check's probe got no logprobs")
        return {entry["token_id"]: entry["logprob"] for entry in content[0]["top_logprobs"]}

    def take_metrics(self) -> dict[str, float]:
        return super().take_metrics() | {PUSH_MISMATCH: self.mismatch, LOADED: float(len(self.loaded))}

    def remove_files(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
