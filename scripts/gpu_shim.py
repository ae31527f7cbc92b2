"""Names the project's vLLM release and torch have and an older GPU machine's lack, added as their
modules are imported (installed by `scripts/gpu_bundle.py unpack`; never part of the package).

- vLLM before 0.27 (the release that pins torch 2.11): `LLMEngine.set_weight_version`, and
  `CompletionOutput.weight_versions` (None: every token of a completion has its batch's version,
  which is what the colocated engine checks);
- torch 2.11: `torch.distributed.fsdp.DataParallelMeshDims`, which torchtitan 0.3.0 imports at module
  level for parallelisers m2po never calls.
"""

from __future__ import annotations

import importlib.abc
import sys


def _engine(module) -> None:
    engine = module.LLMEngine
    if not hasattr(engine, "set_weight_version"):
        engine.set_weight_version = lambda self, version: setattr(self, "m2po_weight_version", version)


def _outputs(module) -> None:
    if not hasattr(module.CompletionOutput, "weight_versions"):
        module.CompletionOutput.weight_versions = None


def _fsdp(module) -> None:
    if not hasattr(module, "DataParallelMeshDims"):
        module.DataParallelMeshDims = type("DataParallelMeshDims", (), {})


PATCHES = {"vllm.v1.engine.llm_engine": _engine, "vllm.outputs": _outputs, "torch.distributed.fsdp": _fsdp}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module executes, before anything else reads it."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run, patch=PATCHES[name]):
                    run(module)
                    patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


sys.meta_path.insert(0, _AfterImport())
