"""The recipe schema: TOML tables parsed into typed, frozen models, one module per owner.

`tables` (the loader and TOML output, shared with eval's configs: defaults < file < `--set`, one-line
errors), `data` (`[model]`, `[data]`, `[reward]`), `rollout` (`[rollout]`, `[staleness]`, `[reuse]`),
`learner` (`[train]`, `[parallel]`, `[optim]`), `loss` (`[algorithm]`, `[loss]`), `env` (`[env]`), `recipe` (the
whole recipe, its checks across tables and the facts derived from them) and `docs`
(`docs/recipes.md`). Every field carries a one-line description; the same text feeds the docs and
`--help`. Nothing here imports torch or vllm, so `--dry-run` and validation errors are fast.
"""

from m2po_cli.config.data import (
    PAPER_PROMPT_TEMPLATE,
    SYNTHETIC_SOURCES,
    DataConfig,
    ModelConfig,
    RewardConfig,
    SyntheticConfig,
    check_template,
)
from m2po_cli.config.env import BUILTIN_ENVS, EnvConfig
from m2po_cli.config.learner import LORA_TARGETS, LoraConfig, OptimConfig, ParallelConfig, TrainConfig
from m2po_cli.config.loss import AlgorithmConfig, LossConfig
from m2po_cli.config.recipe import (
    CheckpointConfig,
    InspectConfig,
    LoggingConfig,
    Recipe,
    RunConfig,
    load_recipe,
)
from m2po_cli.config.rollout import EngineTable, ReuseConfig, RolloutConfig, StalenessConfig
from m2po_cli.config.tables import ConfigError, Table, field

__all__ = [
    "PAPER_PROMPT_TEMPLATE",
    "SYNTHETIC_SOURCES",
    "BUILTIN_ENVS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "LORA_TARGETS",
    "LoraConfig",
    "DataConfig",
    "EngineTable",
    "EnvConfig",
    "InspectConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "Recipe",
    "ReuseConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "StalenessConfig",
    "SyntheticConfig",
    "Table",
    "TrainConfig",
    "check_template",
    "field",
    "load_recipe",
]
