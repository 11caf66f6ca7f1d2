"""A regular (non-editable) install carries every file the C kernels need: build the wheel from a copy of the
sources, install it into a fresh virtualenv (the running environment's site-packages for torch & co, wherever
the suite runs, but tokenmill imported from the venv, not this checkout), and there compile and load every
kernel library into an empty cache and generate with a tiny model under TOKENMILL_REQUIRE_KERNELS=1, so any
fallback to the torch path fails."""
import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")

# Runs inside the venv, from a temporary working directory.
_CHECK = """
import json, os, sys
import tokenmill
assert tokenmill.__file__.startswith(sys.prefix), f"tokenmill imported from {tokenmill.__file__}, not the venv"
site_dirs = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
from tokenmill import LLM, SamplingParams
from tokenmill.worker import kernels_report
libraries = kernels_report.load_all_libraries()
llm = LLM(sys.argv[1], num_gpu_blocks_override=32, block_size=16)
out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
print(json.dumps({"file": tokenmill.__file__, "site_dirs": site_dirs, "libraries": libraries,
                  "kernels": llm.engine.executor.kernels(), "tokens": len(out[0].outputs[0].token_ids)}))
"""


def _build_wheel(tmp_path) -> str:
    """The wheel of a clean copy of the sources (no stale build/ or egg-info from this checkout)."""
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "tokenmill"), src / "tokenmill",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    return glob.glob(str(tmp_path / "dist" / "tokenmill-*.whl"))[0]


def _kernel_sources() -> set[str]:
    return {os.path.relpath(p, ROOT) for ext in ("c", "h")
            for p in glob.glob(os.path.join(ROOT, "tokenmill", "**", f"*.{ext}"), recursive=True)}


def _running_site_packages() -> list[str]:
    """The site-packages directories this interpreter imports from (a virtualenv's own, and the base's when it
    has --system-site-packages). `venv --system-site-packages` would give the *base* interpreter's instead, which
    inside a virtualenv holds none of the suite's dependencies."""
    return [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]


def _install(wheel: str, tmp_path) -> str:
    """A fresh venv that imports the running environment's packages (torch & co) after its own, with the wheel
    installed into it; returns its python. A .pth line adds a directory to sys.path without processing the .pth
    files inside it, so the editable install of this checkout there stays invisible to the venv."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(own, "zz_running_env.pth"), "w") as f:
        f.write("\n".join(_running_site_packages()) + "\n")
    # pip comes from the running environment; --ignore-installed never touches the editable install there
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", wheel],
                   check=True, capture_output=True)
    return python


def test_wheel_installs_working_kernels(tiny, tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        missing = _kernel_sources() - set(z.namelist())
        assert "tokenmill/serve/chat_templates/hermes_tools.jinja" in z.namelist()  # --chat-template hermes_tools
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())  # pyproject's license-files
    assert not missing, f"the wheel lacks kernel sources {sorted(missing)}"
    python = _install(wheel, tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CC") and not k.startswith("TOKENMILL_")}
    env.update(TOKENMILL_CACHE_DIR=str(tmp_path / "cache"), TOKENMILL_REQUIRE_KERNELS="1")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = subprocess.run([python, "-c", _CHECK, tiny("llama")], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(tmp_path / "venv"))
    # The venv sees its own packages and the running environment's, never a base interpreter's that the suite
    # itself does not import from: that is what broke inside a virtualenv whose base lacks the dependencies, and
    # on a base that has them (CI's) it would pass by luck, so check the paths rather than rely on an import error.
    foreign = [p for p in result["site_dirs"]
               if not p.startswith(str(tmp_path / "venv")) and p not in _running_site_packages()]
    assert not foreign, f"the venv imports from {foreign}, which the running interpreter does not"
    num_libraries = len([s for s in _kernel_sources() if s.endswith(".c")])  # one library per C file
    assert result["libraries"] == {name: "loaded" for name in result["libraries"]}
    assert len(result["libraries"]) == num_libraries
    assert result["kernels"]["fallbacks"] == [] and result["tokens"] == 4
    assert len(glob.glob(str(tmp_path / "cache" / "kernels" / "*.so"))) == num_libraries  # compiled here


def test_ci_runs_the_readme_test_command_in_a_virtualenv():
    """.ci/run's command is the README's test command, character for character, and that command makes and
    activates a virtualenv first, so CI exercises what a user runs (inside a venv, where test_wheel once failed)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = [line for line in f.read().splitlines() if line.endswith("python -m pytest -q")]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line for line in f.read().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(readme) == 1 and ci[-1] == readme[0], (readme, ci[-1])
    assert readme[0].startswith("python3 -m venv .venv && . .venv/bin/activate && ")
