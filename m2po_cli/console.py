"""What the console shows: the run's own messages, its progress, and real problems.

Third-party output goes to `third-party.log` in the run (or eval output) directory instead: vLLM's
logs, in every process it starts (through its logging-config hook), the `transformers` logs, and
Python warnings (torch, triton, DTensor, FutureWarnings...). `-v` shows them on the console as well.
Records at level ERROR and above always reach the console too, so no error is hidden. torch and
vLLM are not imported here: call `route_third_party` before they are.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.config
import os
import shutil
import sys
import tempfile
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def route_third_party(log_path: Path, verbose: bool) -> None:
    """Send third-party logs and warnings to `log_path` (appended); on the console only errors,
    or everything at INFO and above with `verbose`."""
    log_path = log_path.resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    console_level = "INFO" if verbose else "ERROR"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _FORMAT}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log_path), "formatter": "plain"},
            "console": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "level": console_level,
                "formatter": "plain",
            },
        },
        "root": {"handlers": ["file", "console"], "level": "INFO"},
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }
    logging.config.dictConfig(config)
    logging.captureWarnings(True)
    # vLLM configures its loggers from this file in this process and in every engine process it spawns.
    folder = tempfile.mkdtemp(prefix="m2po-logging-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    vllm_config = Path(folder) / "vllm-logging.json"
    vllm_config.write_text(json.dumps(config))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(vllm_config)
    if not verbose:
        # Processes spawned by vLLM and the grader start with these: their Python warnings and torch's
        # C++ warnings (printed straight to the terminal, past any Python handler) stay off the
        # console. Errors still show.
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def adopt_transformers(verbose: bool) -> None:
    """transformers prints through a handler of its own: hand its records to the handlers above."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if not verbose:
        hf_logging.disable_progress_bar()


def announce(log_path: Path) -> None:
    """The one line that says where the third-party output went."""
    print(f"third-party logs and warnings: {log_path} (-v shows them here)", file=sys.stderr)


def note(message: str) -> None:
    """A line for the user on the console (stderr) from rank 0, before a run's log exists."""
    from m2po_cli.torchrun import launch

    if launch().rank == 0:
        print(message, file=sys.stderr, flush=True)
