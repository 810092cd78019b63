"""Run the test suite against the newest releases of every dependency and write what changed.

    python tools/newest_releases.py                 # the main environment: ~20 minutes on 2 cores
    python tools/newest_releases.py --env vllm      # vLLM's CPU build and tests_vllm/
    python tools/newest_releases.py --write-lock    # ...and, if every test passed, adopt them in the lock file

CI installs from the lock files (constraints/), so no release elsewhere can turn it red. This script is how a
new release is adopted on purpose: it installs the environment at the newest releases (torch stays at the lock's
version; ``--torch`` tries another) in its own virtualenv, runs the environment's tests (for ``main``: the fast
set and the whole Hugging Face family sweep), and writes a report (``docs/newest_releases_<env>.md``): the
versions that differ from the lock, the model types transformers now maps to ``AutoModelForCausalLM`` that
docs/hf_families.md does not list (with what ``apply_nmst`` does with each), the failures, and the deprecation
warnings. Then: fix what failed, regenerate the family table (``python tools/hf_family_table.py`` in that
virtualenv) and adopt the releases with ``--write-lock`` in a commit of its own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from environments import ENVIRONMENTS, ROOT, Environment, frozen, install, python_of, write_lock

# Run in the new virtualenv: every type transformers maps to AutoModelForCausalLM against docs/hf_families.md,
# and the sweep's own outcome() for each one the table does not list.
_TYPES = """
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, "tests")
import transformers
transformers.logging.set_verbosity_error()
from hf_families import causal_lm_types
from test_hf_families import listed_outcomes, outcome
listed, now = listed_outcomes(), causal_lm_types()
new = {}
for t in sorted(set(now) - set(listed)):
    try:
        new[t] = list(outcome(t))
    except BaseException as error:
        new[t] = ["error", f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"]
print(json.dumps(dict(transformers=transformers.__version__, new=new, removed=sorted(set(listed) - set(now)))))
"""


def run_tests(env: Environment, venv_dir: Path, command: tuple[str, ...]) -> dict:
    """One test command in the virtualenv: its exit status, its summary line, failures and deprecations."""
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        variables = dict(os.environ, **dict(env.test_env), NMST_RELEASE_REPORT=report.name,
                         PYTHONPATH=os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([str(python_of(venv_dir)), "-m", *command, "-q", "-p", "no:cacheprovider",
                               "-p", "release_report_plugin"], cwd=ROOT, env=variables, capture_output=True,
                              text=True)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        try:
            result = json.loads(Path(report.name).read_text() or "{}")
        except json.JSONDecodeError:
            result = {}
    return dict(command=" ".join(command), returncode=done.returncode, summary=lines[-1] if lines else "",
                failures=result.get("failures", []), warnings=result.get("warnings", []),
                tail=(done.stdout + done.stderr)[-3000:] if not result else "")


def model_types(venv_dir: Path) -> dict:
    done = subprocess.run([str(python_of(venv_dir)), "-c", _TYPES], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return dict(error=done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def version_changes(env: Environment, versions: dict[str, str]) -> list[tuple[str, str, str]]:
    """(package, locked version or "—", newest or "—") of every package that differs from the lock."""
    locked = {}
    for line in env.lock.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            locked[name] = version
    names = sorted(set(locked) | set(versions), key=str.lower)
    return [(n, locked.get(n, "—"), versions.get(n, "—")) for n in names if locked.get(n) != versions.get(n)]


def report(env: Environment, torch: str, changes, types, runs) -> str:
    lines = [f"# Newest releases: the `{env.name}` environment",
             "",
             f"Written by `python tools/newest_releases.py --env {env.name}` on "
             f"{datetime.date.today().isoformat()}, against the lock file `{env.lock.relative_to(ROOT)}`; "
             f"torch held at `{torch}`. CI installs from the lock; this is what the newest releases would change.",
             "", "## Versions that differ from the lock", ""]
    if changes:
        lines += ["| package | lock | newest |", "|---|---|---|"]
        lines += [f"| {name} | {old} | {new} |" for name, old, new in changes]
    else:
        lines.append("None: the lock holds the newest releases.")
    if types is not None:
        lines += ["", "## Model types", ""]
        if "error" in types:
            lines += ["The type listing failed:", "", "```", types["error"], "```"]
        else:
            lines.append(f"transformers {types['transformers']} maps {len(types['new'])} type(s) to "
                         "`AutoModelForCausalLM` that docs/hf_families.md does not list"
                         + (f", and no longer maps {', '.join(types['removed'])}" if types["removed"] else "") + ".")
            if types["new"]:
                lines += ["", "| model type | outcome | note |", "|---|---|---|"]
                lines += [f"| `{t}` | {result} | {note.replace('|', '/')} |"
                          for t, (result, note) in types["new"].items()]
    for run in runs:
        lines += ["", f"## `{run['command']}`", "", f"Exit status {run['returncode']}: {run['summary']}"]
        if run["failures"]:
            lines += ["", "| failed test | phase | message |", "|---|---|---|"]
            lines += [f"| `{f['test']}` | {f['when']} | {f['message'].replace('|', '/')} |" for f in run["failures"]]
        if run["tail"]:
            lines += ["", "```", run["tail"], "```"]
        deprecations = Counter((w["category"], w["message"], w["where"]) for w in run["warnings"])
        if deprecations:
            first = {}
            for w in run["warnings"]:
                first.setdefault((w["category"], w["message"], w["where"]), w["test"])
            lines += ["", f"{len(deprecations)} distinct deprecation warning(s), the project's own code first:", "",
                      "| category | message | raised at | tests | first test |", "|---|---|---|---|---|"]
            ours = ("nmst_fast/", "train/", "tests/", "benchmarks/")
            ordered = sorted(deprecations.items(), key=lambda kv: (not kv[0][2].startswith(ours), -kv[1]))
            lines += [f"| {c} | {m.replace('|', '/')} | `{w}` | {n} | `{first[(c, m, w)]}` |"
                      for (c, m, w), n in ordered]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=sorted(ENVIRONMENTS), default="main")
    parser.add_argument("--venv", type=Path, default=None,
                        help="the virtualenv to install into (default: .venv-newest-<env>)")
    parser.add_argument("--torch", default=None, help="torch requirement (default: the lock's version)")
    parser.add_argument("--out", type=Path, default=None, help="the report (default: docs/newest_releases_<env>.md)")
    parser.add_argument("--write-lock", action="store_true",
                        help="if every test passed, write the installed versions into the lock file")
    args = parser.parse_args()
    env = ENVIRONMENTS[args.env]
    venv_dir = args.venv or ROOT / f".venv-newest-{env.name}"
    install(env, venv_dir, newest=True, torch=args.torch)
    versions = frozen(venv_dir)
    torch = args.torch or f"torch=={versions.get('torch', '?')}"
    types = model_types(venv_dir) if env.name == "main" else None
    runs = []
    for command in env.tests:
        print(f"running {' '.join(command)} ...", flush=True)
        runs.append(run_tests(env, venv_dir, command))
        print(f"  {runs[-1]['summary']}", flush=True)
    out = args.out or ROOT / "docs" / f"newest_releases_{env.name}.md"
    out.write_text(report(env, torch, version_changes(env, versions), types, runs))
    print(f"wrote {out}")
    if args.write_lock:
        if any(run["returncode"] for run in runs):
            sys.exit(f"not writing {env.lock}: tests failed against the newest releases (see {out})")
        write_lock(env, versions)
        print(f"wrote {env.lock}")


if __name__ == "__main__":
    main()
