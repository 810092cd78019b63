"""What the distribution installs, and the kernels' separation from the rest of the library."""

import ast
import importlib.metadata
from pathlib import Path

import nmst_fast.kernels

KERNEL_DIR = Path(nmst_fast.kernels.__file__).parent


def test_the_distribution_installs_one_top_level_package():
    # A top-level ``kernels`` is Hugging Face's hub-kernels package: transformers looks it up by that
    # name, and pip would let either distribution overwrite the other's files. Only ``nmst_fast`` may be ours.
    top_level = {name for name, distributions in importlib.metadata.packages_distributions().items()
                 if "nmst-fast" in distributions}
    assert top_level == {"nmst_fast"}


def _imported_names(tree: ast.AST):
    """(dotted name, relative level) of everything one source file imports: ``from torch import
    autograd`` gives ``torch.autograd``, ``from . import lanes`` gives (``lanes``, 1)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            prefix = f"{node.module}." if node.module else ""
            yield from ((prefix + alias.name, node.level) for alias in node.names)


def test_kernels_import_nothing_from_the_library_and_no_autograd():
    sources = sorted(KERNEL_DIR.rglob("*.py"))
    assert len(sources) > 5, sources  # the glob found the kernel modules
    for path in sources:
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, level in _imported_names(tree):
            where = f"{path.name} imports {'.' * level}{name}"
            assert level <= 1, where  # relative imports stay inside the kernels package
            if level == 0 and name.startswith("nmst_fast"):
                assert name.startswith("nmst_fast.kernels"), where
            assert not name.startswith("torch.autograd"), where
        # nor reaches it as an attribute (torch.autograd.Function)
        assert not any(isinstance(node, ast.Attribute) and node.attr == "autograd" for node in ast.walk(tree)), path


def test_the_wheel_carries_the_cpu_kernels_source(tmp_path):
    # The CPU row kernels are built from their C++ source on the user's machine: a wheel without it
    # would leave every user on the torch-op path.
    import subprocess
    import sys
    import zipfile

    root = KERNEL_DIR.parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(root)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("nmst_fast-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for source in ("row_lse.cpp", "llama_sampler.cpp", "head_row.h", "__init__.py"):
        assert f"nmst_fast/kernels/cpu/{source}" in names, source
    assert not any(name.startswith(("tests/", "train/", "benchmarks/")) for name in names)
