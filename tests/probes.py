"""What tests ask a rollout engine and a run never does: the weight version every worker holds, and
the logprob of each token of given sequences at temperature 1 (to hold the engine to the learner)."""

from __future__ import annotations

from m2po_cli.rollout.engine import VLLMEngine
from m2po_cli.rollout.server import EngineServer


def require_version(engine: VLLMEngine, version: int) -> None:
    """Raise unless every worker of the in-process engine holds learner version `version`'s weights."""
    held = engine.llm.collective_rpc("m2po_version")
    if held != [version] * len(held):
        raise RuntimeError(
            f"the rollout engine holds weight version {held}, the learner is at {version}: "
            "a weight push was skipped"
        )


def prompt_logprobs(engine, sequences: list[list[int]]) -> list[list[float]]:
    """Logprob of each token given its prefix (temperature 1), tokens 1..L-1 of each sequence, from
    an in-process engine or from the server of a test's HTTP engine (`.server`)."""
    if not isinstance(engine, VLLMEngine):
        return server_prompt_logprobs(engine.server, sequences)
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False
    )
    return [
        [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
        for out, seq in zip(outputs, sequences, strict=True)
    ]


def server_prompt_logprobs(server: EngineServer, sequences: list[list[int]]) -> list[list[float]]:
    """`prompt_logprobs` of a `vllm serve` server, over its completions route."""
    out = []
    for seq in sequences:
        body = {"model": server.model_name, "prompt": seq, "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 1.0}  # fmt: skip
        entries = server.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
        out.append([entry[str(tok)]["logprob"] for entry, tok in zip(entries[1:], seq[1:], strict=True)])
    return out
