"""experiments/gpu_check.sh's set-up, before anything of attnres is importable: is this machine
one the project supports (Python, torch, triton, a CUDA device), which requirements must come
from the carried wheels (`.whl/`), is attnres installed from this checkout, and the random token
files stage (c) trains on. Standard library, torch and `packaging` only (the device has them).

    python experiments/gpu_check_env.py preflight --out DIR [--dry]   # one line and exit 2 when unsupported
    python experiments/gpu_check_env.py needs            # requirements to install from .whl/, one a line
    python experiments/gpu_check_env.py wheels           # what --fetch-wheels downloads, one a line
    python experiments/gpu_check_env.py tokens DIR --vocab 32768 --train 1000000 --val 100000
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: dependencies of attnres that the device image lacks (/work/.library/device/KINDS.md's package
#: list): --fetch-wheels downloads these, with the specifiers of pyproject.toml
DEVICE_LACKS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "hydra-joblib-launcher")
#: what `pip install --no-build-isolation -e .` needs besides the image: the build backend, the
#: package its editable wheels import, and hatchling's own requirements
BUILD = ("hatchling>=1.21", "editables~=0.3", "trove-classifiers", "tomlkit>=0.11.1", "pathspec>=0.10.1",
         "pluggy>=1.0.0", "packaging>=24.2")
#: stage (a) runs pytest; the image has it, a bare machine may not
TESTS = ("pytest>=8",)


def pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def write_json(path: Path, data: dict) -> None:
    """Atomically: a file under DIR is its previous version or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def unmet(requirement: str) -> bool:
    """Whether `requirement` (a PEP 508 string) is missing here or installed at a version outside it."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate():
        return False
    version = installed(req.name)
    return version is None or not req.specifier.contains(version, prereleases=True)


def spec_of(name: str, requirements: list[str]) -> str:
    from packaging.requirements import Requirement

    return next(r for r in requirements if Requirement(r).name.lower() == name)


def attnres_installed() -> bool:
    """attnres installed (so its entry point, the conf/ it maps and the Hydra launcher shim are
    there) and importable from this checkout, not from another copy."""
    if installed("attnres") is None:
        return False
    spec = importlib.util.find_spec("attnres")  # sys.path[0] is experiments/: only an install finds it
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(REPO)


def needs() -> list[str]:
    """Requirements to install from the carried wheels: unmet runtime dependencies (never torch:
    preflight refuses an unsupported one), then what the editable install of attnres needs."""
    project = pyproject()["project"]
    out = [r for r in project["dependencies"] if not r.startswith("torch") and unmet(r)]
    out += [r for r in TESTS if unmet(r)]
    if not attnres_installed():
        out += [r for r in BUILD if unmet(r)]
    return out


def wheels() -> list[str]:
    """The requirements --fetch-wheels downloads (pure-Python wheels; antlr4 is built from its sdist)."""
    deps = pyproject()["project"]["dependencies"]
    return [spec_of(name, deps) for name in DEVICE_LACKS] + list(BUILD)


def preflight(out: Path, dry: bool) -> int:
    """Check the machine before any stage spends time; record what was found in DIR/stages.json."""
    from packaging.specifiers import SpecifierSet

    project = pyproject()["project"]
    env = {"python": platform.python_version(), "machine": platform.machine(), "host": platform.node(),
           "torch": installed("torch"), "triton": installed("triton") or installed("pytorch-triton"),
           "pytorch-lightning": installed("pytorch-lightning"), "dry": dry}
    problems = []
    if platform.python_version() not in SpecifierSet(project["requires-python"]):
        problems.append(f"Python {platform.python_version()} is not {project['requires-python']} (pyproject.toml)")
    torch_spec = spec_of("torch", project["dependencies"]).removeprefix("torch")
    triton_spec = spec_of("triton", project["optional-dependencies"]["triton"]).removeprefix("triton")
    if env["torch"] is None:
        problems.append("torch is not installed; the device image brings it (do not install it from wheels)")
    elif not SpecifierSet(torch_spec).contains(env["torch"], prereleases=True):
        problems.append(f"torch {env['torch']} is not {torch_spec} (pyproject.toml)")
    if env["triton"] is None:
        problems.append(f"triton is not installed; the GPU paths need triton{triton_spec}")
    elif not SpecifierSet(triton_spec).contains(env["triton"], prereleases=True):
        problems.append(f"triton {env['triton']} is not {triton_spec} (pyproject.toml's triton extra)")
    if not problems:
        import torch

        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["gpu"] = props.name
            env["capability"] = f"{props.major}.{props.minor}"
            env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            env["gpus"] = torch.cuda.device_count()
        elif not dry:
            problems.append(f"no CUDA device visible to torch {env['torch']} (CUDA build {torch.version.cuda}); "
                            "on a machine without a GPU run experiments/gpu_check.sh --dry")
    write_json(out / "stages.json", {"env": env, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {},
                                     "problems": problems})
    if problems:
        print(f"gpu_check.sh: error: {problems[0]}", file=sys.stderr)
        return 2
    print("gpu_check.sh: " + ", ".join(f"{k} {v}" for k, v in env.items() if v not in (None, False, True)))
    return 0


def tokens(folder: Path, vocab: int, n_train: int, n_val: int) -> None:
    """Uniformly random token ids in nanoGPT's raw uint16 files (data=tokens): GPT-small's shape
    with a vocabulary of `vocab`, no corpus needed; the loss stays near ln(vocab)."""
    import numpy as np

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    rng.integers(0, vocab, n_train, dtype=np.uint16).tofile(folder / "train.bin")
    rng.integers(0, vocab, n_val, dtype=np.uint16).tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": "uint16"}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pre = sub.add_parser("preflight")
    pre.add_argument("--out", type=Path, required=True)
    pre.add_argument("--dry", action="store_true")
    sub.add_parser("needs")
    sub.add_parser("wheels")
    sub.add_parser("installed")
    tok = sub.add_parser("tokens")
    tok.add_argument("folder", type=Path)
    tok.add_argument("--vocab", type=int, required=True)
    tok.add_argument("--train", type=int, required=True)
    tok.add_argument("--val", type=int, required=True)
    args = p.parse_args(argv)
    if args.cmd == "preflight":
        return preflight(args.out, args.dry)
    if args.cmd in ("needs", "wheels"):
        for requirement in needs() if args.cmd == "needs" else wheels():
            print(requirement)
        return 0
    if args.cmd == "installed":
        return 0 if attnres_installed() else 1
    tokens(args.folder, args.vocab, args.train, args.val)
    return 0


if __name__ == "__main__":
    sys.exit(main())
