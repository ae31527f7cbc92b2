"""`scripts/gpu_bundle.py unpack` and `scripts/gpu_shim.py`, the parts that run on the GPU machine."""

from __future__ import annotations

import io
import lzma
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_bundle import unpack  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


def part_with(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir()
    with lzma.open(folder / "p.tar.xz", "wb") as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return folder


def test_an_unpacked_part_is_importable_by_every_interpreter_start_with_the_shim(tmp_path):
    """The `.pth` puts the site on the path at start-up (children that set PYTHONPATH see it too) and
    installs the shim, which adds a missing name to its module as the module is imported."""
    part = part_with(tmp_path / "one", {"m2po_bundled/__init__.py": "VALUE = 7\n"})
    site, pth_dir = tmp_path / "site", tmp_path / "pth"
    pth_dir.mkdir()
    unpack(part, site, pth_dir)
    assert (site / "m2po_bundled" / "__init__.py").exists() and (site / "m2po_gpu_shim.py").exists()
    code = (
        f"import site; site.addsitedir({str(pth_dir)!r})\n"
        "import m2po_gpu_shim, m2po_bundled\n"
        "m2po_gpu_shim.PATCHES['m2po_late'] = lambda m: setattr(m, 'ADDED', m.BASE + 1)\n"
        "import m2po_late\n"
        "print(m2po_bundled.VALUE, m2po_late.ADDED)\n"
    )
    (site / "m2po_late.py").write_text("BASE = 41\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": "/nonexistent"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7", "42"]
