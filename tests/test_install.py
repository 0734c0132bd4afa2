"""An installed package (a real ``pip install`` of this source tree) carries the built-in MGSM set and its license,
and ``specdec evaluate --tasks mgsm`` runs from it with no other data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from specdec import data

from models import perturbed_copy, tiny_llama

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_pip_install_ships_mgsm_and_evaluate_runs_on_it(tmp_path):
    source = tmp_path / "source"  # a copy, so that the build leaves nothing in the working tree
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    _mkdir(source)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    for name in ("specdec", "kernels"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=ignore)
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--no-compile", "--target", str(site), str(source)], capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    installed = site / "specdec" / "datasets" / "mgsm"
    expected = {"LICENSE.txt", "README.md", "SHA256SUMS"} | {f"mgsm_{lang}.tsv" for lang in data.MGSM_LANGUAGES}
    assert {path.name for path in installed.iterdir()} == expected
    for name in expected:
        assert (installed / name).read_bytes() == (REPO_ROOT / "specdec" / "datasets" / "mgsm" / name).read_bytes()

    work = _mkdir(tmp_path / "elsewhere")  # outside the source tree, with a tiny pair and nothing else
    tokenizer = data.build_char_tokenizer()
    verifier = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=0)
    verifier.save_pretrained(work / "verifier")
    tokenizer.save_pretrained(work / "verifier")
    perturbed_copy(verifier, noise=0.5, seed=1).save_pretrained(work / "drafter")
    env = {**os.environ, "PYTHONPATH": str(site), "SPECDEC_DEBUG": ""}
    where = subprocess.run([sys.executable, "-c", "import specdec.data as d; print(d.__file__); "
                            "print(sorted(d.load_builtin('mgsm')), len(d.load_builtin('mgsm')['te'].texts))"],
                           capture_output=True, text=True, env=env, cwd=work)
    assert where.returncode == 0, where.stderr
    assert where.stdout.splitlines() == [str(site / "specdec" / "data.py"), f"{sorted(data.MGSM_LANGUAGES)} 250"]
    run = subprocess.run([sys.executable, "-m", "specdec", "evaluate", "--verifier", "verifier", "--drafter",
                          "drafter", "--tasks", "mgsm", "--task-names", "en,de", "--max-examples", "2",
                          "--max-new-tokens", "2", "--cost-ratio", "0.5", "--no-progress"],
                         capture_output=True, text=True, env=env, cwd=work)
    assert run.returncode == 0, run.stderr
    assert "| en |" in run.stdout and "| de |" in run.stdout and "Traceback" not in run.stderr


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_the_readmes_cpu_install_selects_a_cpu_build_and_ci_runs_it_as_written():
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    install = readme.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.strip() for line in install.strip().splitlines() if line.strip().startswith("pip install")]
    torch_line = next(line for line in commands if "torch==" in line)
    # a bare `pip install torch` resolves to the CUDA build on Linux; the CPU build comes from PyTorch's CPU index
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    ci = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    for command in commands:
        assert command in ci, f"{command!r} is in README's install but not run by .ci/run"
