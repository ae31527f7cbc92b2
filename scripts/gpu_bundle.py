"""vLLM and what m2po needs beside it, for a GPU machine with no network, in two transfers.

Some GPU machines come with torch but no network and cap what one command may carry (64 MiB). This
builds, on a machine that reaches the package index, the smallest vLLM that runs the dense offline
(colocated) path, split in two parts that each fit, and unpacks them there:

    python scripts/gpu_bundle.py build [--vllm 0.26.0] [--wheels DIR]   # here: .gpu-bundle/one, two
    python3 scripts/gpu_bundle.py unpack .gpu-bundle/one                 # there, first transfer
    python3 scripts/gpu_bundle.py unpack .gpu-bundle/two                 # there, second transfer
    python3 scripts/gpu_bundle.py check                                  # there: every import resolves

Part one is vLLM's main CUDA library (`_C_stable_libtorch`, xz); part two is FlashAttention 3 (what
SM90 picks), the rest of vLLM without the kernels the dense path never loads (FA2, MoE, FlashMLA,
DeepGEMM, ...), and the wheels of what the machine lacks. Unpacked under `SITE`, put on the path by a
`.pth` file in the interpreter's own site-packages, so that child processes that set their own
`PYTHONPATH` see it too. The vLLM release must pin the machine's torch (0.26.0 for torch 2.11);
`scripts/gpu_shim.py` supplies the names the pinned release has and such an older one lacks.
"""

from __future__ import annotations

import argparse
import importlib
import io
import lzma
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".gpu-bundle"
SITE = Path("/tmp/m2po-site")
LIMIT = 60 * 2**20  # one transfer carries 64 MiB with the repository; keep room for it
PYTHON, PLATFORMS = "3.12", ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# Part one alone; vLLM imports it whatever the model.
MAIN_LIBRARY = "vllm/_C_stable_libtorch.abi3.so"
# The compiled parts of the dense offline path besides it: FA3, sleep mode's allocator, small helpers.
KEEP_LIBRARIES = (
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/cumem_allocator.abi3.so",
    "vllm/spinloop.abi3.so",
    "vllm/fs_io_C.abi3.so",
)
# What the dense offline path imports and the machine lacks: vLLM's, then m2po's and torchtitan's.
WHEELS = (
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "fastapi", "starlette",
    "openai", "jiter", "distro", "sniffio", "openai-harmony", "msgspec", "pyzmq", "cbor2", "pybase64",
    "cachetools", "partial-json-parser",
    "torchtitan==0.3.0", "torchdata==0.11.0", "spmd_types==0.2.3", "torch_checkpointing==0.1.1",
    "tyro", "docstring-parser", "typeguard", "shtab",
    "math-verify", "latex2sympy2_extended", "antlr4-python3-runtime==4.13.2",
)  # fmt: skip
# What `check` imports there: the engine, the learner, the grader.
IMPORTS = (
    "vllm",
    "vllm.entrypoints.llm",
    "torchtitan",
    "math_verify",
    "m2po_cli.rollout.engine",
    "m2po_cli.learner.policy",
)


def download(names: list[str], into: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", PYTHON, "--implementation", "cp", *platforms, "-d", str(into), *names]
    subprocess.run(cmd, check=True)


def xz_tar(out: Path, members: dict[str, bytes]) -> int:
    """Write `members` (archive name -> bytes) as one .tar.xz; its size."""
    with (
        lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as raw,
        tarfile.open(fileobj=raw, mode="w") as tar,
    ):
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, fileobj=io.BytesIO(data))
    return out.stat().st_size


def build(vllm: str, cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    wheel = next(cache.glob(f"vllm-{vllm}-*.whl"), None)
    if wheel is None:
        download([f"vllm=={vllm}"], cache)
        wheel = next(cache.glob(f"vllm-{vllm}-*.whl"))
    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "one").mkdir(parents=True)
    (OUT / "two" / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        one = {MAIN_LIBRARY: zf.read(MAIN_LIBRARY)}
        two = {n: zf.read(n) for n in names if not n.endswith(".so") or n in KEEP_LIBRARIES}
    sizes = {
        "one": xz_tar(OUT / "one" / "vllm-lib.tar.xz", one),
        "two": xz_tar(OUT / "two" / "vllm.tar.xz", two),
    }
    download(list(WHEELS), OUT / "two" / "wheels")
    sizes["two"] += sum(p.stat().st_size for p in (OUT / "two" / "wheels").iterdir())
    for part, size in sizes.items():
        print(f".gpu-bundle/{part}: {size / 2**20:.1f} MiB")
        if size > LIMIT:
            raise SystemExit(
                f"gpu_bundle: part {part} is {size / 2**20:.1f} MiB, over {LIMIT / 2**20:.0f} MiB"
            )


def unpack(part: Path, site: Path, pth_dir: Path) -> None:
    """Extract a part under `site`, install its wheels there (no dependencies: the list is whole),
    and put `site` and the shim on every interpreter start's path."""
    site.mkdir(parents=True, exist_ok=True)
    for archive in sorted(part.glob("*.tar.xz")):
        with tarfile.open(archive) as tar:
            tar.extractall(site, filter="data")
    wheels = sorted((part / "wheels").glob("*.whl"))
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*cmd, "--target", str(site), "--upgrade", *map(str, wheels)], check=True)
    shutil.copy(ROOT / "scripts" / "gpu_shim.py", site / "m2po_gpu_shim.py")
    (pth_dir / "m2po-gpu-bundle.pth").write_text(f"{site}\nimport m2po_gpu_shim\n")
    print(f"unpacked {part.name} into {site}")


def check() -> None:
    sys.path.insert(0, str(ROOT))
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise SystemExit(f"gpu_bundle check: import {name}: {e}") from None
        print(f"import {name}: ok ({getattr(module, '__version__', '')})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="download and pack the two parts into .gpu-bundle/")
    b.add_argument("--vllm", default="0.26.0", help="the vLLM release that pins the machine's torch")
    b.add_argument("--wheels", type=Path, default=Path(tempfile.gettempdir()) / "m2po-gpu-wheels")
    u = sub.add_parser("unpack", help="unpack one part on the GPU machine")
    u.add_argument("part", type=Path)
    u.add_argument("--site", type=Path, default=SITE)
    u.add_argument("--pth-dir", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    sub.add_parser("check", help="import what the colocated path imports")
    args = ap.parse_args()
    if args.verb == "build":
        build(args.vllm, args.wheels)
    elif args.verb == "unpack":
        unpack(args.part, args.site, args.pth_dir)
    else:
        check()


if __name__ == "__main__":
    main()
