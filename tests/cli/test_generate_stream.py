"""``specdec generate`` streams text to the terminal as rounds commit tokens, and passes transformers' options
(--repetition-penalty, --min-new-tokens, --stop) with their meaning: the completion is the verifier's own."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from specdec import data
from specdec.cli import main

from models import perturbed_copy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("stream-pair")
    tokenizer = data.build_char_tokenizer()
    verifier = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=0, init_std=0.3)
    drafter = perturbed_copy(verifier, noise=0.1, seed=1)
    verifier.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    drafter.save_pretrained(root / "drafter")
    return str(root / "verifier"), str(root / "drafter")


def _verifier_completion(model_dir: str, prompt: str, **options) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer, **options)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_generate_streams_the_completion_and_keeps_transformers_options(capsys, monkeypatch, pair_dirs):
    verifier_dir, drafter_dir = pair_dirs
    free = _verifier_completion(verifier_dir, "count 3:", max_new_tokens=16, repetition_penalty=1.3)
    stop = free[6:8]  # two characters the free completion reaches after a few rounds
    expected = _verifier_completion(verifier_dir, "count 3:", max_new_tokens=16, repetition_penalty=1.3,
                                    min_new_tokens=4, stop_strings=[stop])
    assert expected != free and expected.endswith(stop), "the stop string must end the completion early"
    puts = []
    original_put = TextStreamer.put
    monkeypatch.setattr(TextStreamer, "put", lambda self, value: (puts.append(value), original_put(self, value))[1])
    command = ["generate", "--verifier", verifier_dir, "--drafter", drafter_dir, "--prompt", "count 3:",
               "--max-new-tokens", "16", "-k", "3", "--repetition-penalty", "1.3", "--min-new-tokens", "4",
               "--stop", stop]
    assert main(command) == 0
    streamed = capsys.readouterr().out
    streamed_puts = len(puts)
    assert streamed_puts >= 3, "the prompt, the first token, then at least one round"
    assert main([*command, "--no-stream"]) == 0
    printed = capsys.readouterr().out
    assert len(puts) == streamed_puts
    summary = "1 prompt(s): "  # (the last line, with the wall time)
    assert streamed.split(summary)[0] == printed.split(summary)[0], "streaming prints what the batch output prints"
    assert f"### prompt 1: 'count 3:'\ncount 3:{expected}\n[" in streamed
