"""tools/environments.py's virtualenv step (what ``.ci/run`` runs first): it installs into a virtualenv already in
the checkout, whether the README's ``python3 -m venv .venv`` made it (its interpreter a link, which creating over
it again failed on: shutil.SameFileError) or the tool itself did, run after run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def environments():
    spec = importlib.util.spec_from_file_location("environments", ROOT / "tools" / "environments.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("environments", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def runs(venv_dir: Path) -> bool:
    done = subprocess.run([str(venv_dir / "bin" / "python"), "-c", "import sys; print(sys.prefix)"],
                          capture_output=True, text=True, timeout=60)
    return done.returncode == 0 and Path(done.stdout.strip()).resolve() == venv_dir.resolve()


def test_a_venv_made_the_readmes_way_is_installed_into(tmp_path):
    venv_dir = tmp_path / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv_dir)], check=True, timeout=120)
    assert (venv_dir / "bin" / "python").is_symlink()
    marker = venv_dir / "marker"
    marker.write_text("kept")
    environments().ensure_venv(venv_dir)  # raised SameFileError when it created the venv over the link
    assert runs(venv_dir) and marker.read_text() == "kept"


def test_the_tools_own_venv_is_made_once_and_used_again(tmp_path):
    venv_dir = tmp_path / ".venv"
    tool = environments()
    tool.ensure_venv(venv_dir)
    assert runs(venv_dir)
    made = (venv_dir / "pyvenv.cfg").stat().st_mtime_ns
    tool.ensure_venv(venv_dir)  # a second `.ci/run` in the same checkout
    assert runs(venv_dir) and (venv_dir / "pyvenv.cfg").stat().st_mtime_ns == made
