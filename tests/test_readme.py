"""The README's Python examples run as written, in order, in one namespace, offline.

The README loads two hub models (``Qwen/Qwen2.5-1.5B`` and ``Qwen/Qwen2.5-0.5B``); here they are replaced by tiny
random models saved to local folders, with a byte-level BPE tokenizer trained on the built-in MGSM texts. That
substitution of the two model names is the only change made to the code blocks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import specdec
from specdec import data

from models import byte_level_tokenizer, tiny_llama

README = Path(__file__).resolve().parents[1] / "README.md"
VERIFIER_ID, DRAFTER_ID = "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-0.5B"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def python_blocks(text: str) -> list[str]:
    """The ```python fenced blocks of a markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """The README's model ids -> folders of tiny models (the verifier has 5 layers: the README skips 4)."""
    root = tmp_path_factory.mktemp("readme-models")
    corpus = [text for task in data.load_builtin("mgsm").values() for text in task.texts]
    tokenizer = byte_level_tokenizer(320, corpus)
    models = {VERIFIER_ID: tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=5, seed=0),
              DRAFTER_ID: tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=1)}
    folders = {}
    for model_id, model in models.items():
        folder = root / model_id.replace("/", "--")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[model_id] = str(folder)
    return folders


def test_the_readme_has_the_examples_this_test_runs():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    code = "\n".join(blocks)
    for name in ("specdec.generate", "generation_config", "streamer", "stop_strings", "output_logprobs",
                 "layer_skip_drafter", "rejection_sample", "divergence", "evaluate", "finetune_drafter"):
        assert name in code, name
    assert VERIFIER_ID in blocks[0] and DRAFTER_ID in blocks[0]


def test_readme_python_examples_run_as_written(stand_ins, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # (the examples write fairness.png)
    namespace: dict = {"__name__": "readme"}
    for index, block in enumerate(python_blocks(README.read_text(encoding="utf-8"))):
        for model_id, folder in stand_ins.items():
            block = block.replace(f'"{model_id}"', repr(folder))
        exec(compile(block, f"README.md python block {index + 1}", "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out
    assert "'acceptance_rate'" in printed and "| task |" in printed, "the summary and the report were printed"
    assert (tmp_path / "fairness.png").is_file()
    assert isinstance(namespace["result"], specdec.FinetuneResult)
