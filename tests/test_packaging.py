"""What the distribution installs, and the kernels' separation from the rest of the library."""

import ast
import importlib.metadata
from pathlib import Path

import nmst_fast.kernels

KERNEL_DIR = Path(nmst_fast.kernels.__file__).parent


def test_the_distribution_installs_one_top_level_package():
    # A top-level ``kernels`` (where the kernels lived until the twenty-first session) is Hugging
    # Face's hub-kernels package: transformers looks it up by that name, and pip would let either
    # distribution overwrite the other's files. Only ``nmst_fast`` may be ours.
    top_level = {name for name, distributions in importlib.metadata.packages_distributions().items()
                 if "nmst-fast" in distributions}
    assert top_level == {"nmst_fast"}


def _imported_modules(path: Path):
    """(module name, relative level) of every import statement in one source file."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level


def test_kernels_import_nothing_from_the_library_and_no_autograd():
    sources = sorted(KERNEL_DIR.glob("*.py"))
    assert len(sources) > 5, sources  # the glob found the kernel modules
    for path in sources:
        for module, level in _imported_modules(path):
            where = f"{path.name} imports {'.' * level}{module}"
            assert level <= 1, where  # relative imports stay inside the kernels package
            if level == 0 and module.startswith("nmst_fast"):
                assert module.startswith("nmst_fast.kernels"), where
            assert not module.startswith("torch.autograd"), where
