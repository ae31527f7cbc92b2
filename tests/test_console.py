"""The console shows the run; third-party logs and warnings go to the run's log file, errors to both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROUTING_SETS = ("PYTHONWARNINGS", "TORCH_CPP_LOG_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH")
CODE = """
import logging, sys, warnings
from pathlib import Path
from m2po_cli import console
console.route_third_party(Path(sys.argv[1]), verbose=sys.argv[2] == "1")
logging.getLogger("vllm.engine").warning("vllm warns")
logging.getLogger("torch.distributed").info("torch informs")
warnings.warn("a deprecation", FutureWarning)
logging.getLogger("vllm.engine").error("vllm fails")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_third_party_output_goes_to_the_log_file(tmp_path, verbose):
    log = tmp_path / "third-party.log"
    # A fresh process, as the CLI's is: none of what routing sets, which a CLI run in this process
    # (by an earlier test or fixture) may have left in its environment.
    env = {k: v for k, v in os.environ.items() if k not in ROUTING_SETS} | {"PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", CODE, str(log), "1" if verbose else "0"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    messages = ["vllm warns", "torch informs", "a deprecation", "vllm fails"]
    assert all(m in log.read_text() for m in messages)
    shown = [m for m in messages if m in proc.stderr]
    assert shown == (messages if verbose else ["vllm fails"]), proc.stderr
    assert proc.stdout == ""
