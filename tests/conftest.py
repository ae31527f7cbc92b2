"""Shared fixtures. `char_tokenizer`: a real fast tokenizer built offline (no hub).

The suite pins what its numbers depend on, so that it decides on the code and not on the machine
or the shell it runs in: torch's intra-op threads (a parallel reduction sums in an order that
depends on the thread count) for this process and for every command a test starts, unless the test
sets its own; and Hypothesis draws the same examples on every run.
"""

import os

# Before anything imports torch: OpenMP reads this once, at start-up.
TEST_THREADS = 2
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(TEST_THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.set_num_threads(TEST_THREADS)
settings.register_profile("m2po", derandomize=True)
settings.load_profile("m2po")
from tokenizers import Regex, Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(autouse=True)
def _environment_per_test():
    """The CLI sets process-wide variables for the processes it starts (third-party logging, vLLM's
    options); a test that runs it in-process must not hand them to the tests after it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character or newline (others -> <unk>), ChatML-style template."""
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        additional_special_tokens=specials[1:],
        chat_template=CHAT_TEMPLATE,
    )


# --- real-stack fixtures --------------------------------------------------------------------------

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

# vLLM and inductor side files (ZMQ sockets, compile caches) stay out of the user's folders.
_SIDE = Path(tempfile.mkdtemp(prefix="m2po-tests-"))
for var, sub in [
    ("VLLM_CACHE_ROOT", "vllm"),
    ("VLLM_RPC_BASE_PATH", "rpc"),
    ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
]:
    os.environ.setdefault(var, str(_SIDE / sub))
    Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("WANDB_MODE", "offline")

from tests.device_rule import gpu_group_on_cpu  # noqa: E402

# Every process group of the suite refuses what the GPU's group would refuse (`device_rule`).
os.environ["M2PO_DIST_BACKEND"] = gpu_group_on_cpu()

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.toml"


def recipe_for(tmp_path: Path, *overrides: str):
    """The quickstart recipe, writing under tmp_path, with `--set`-style overrides."""
    from m2po_cli.config import load_recipe

    base = [f'run.output_dir="{tmp_path}"', 'logging.console="plain"']
    return load_recipe(QUICKSTART, base + list(overrides))


def no_record(run_dir: Path, learner):
    """A `train_on` recorder that records nothing (`inspect.every = 0`)."""
    from m2po_cli.config import InspectConfig
    from m2po_cli.record import Recorder

    return Recorder(run_dir, InspectConfig(every=0), 0, learner.rank, learner.world)


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu(n)`: skipped unless n CUDA devices (default 1) are visible."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    found = torch.cuda.device_count()
    for item in marked:
        args = item.get_closest_marker("gpu").args
        need = args[0] if args else 1
        if found < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {found}"))
