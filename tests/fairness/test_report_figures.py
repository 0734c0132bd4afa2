"""evaluate's figures against values computed here by hand: eval mode, characters per token, the per-character
speed-up, the texts counted, and the inputs it must accept or leave alone."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from specdec.compat import SpecdecWarning
from specdec.fairness import TaskData, evaluate

from models import tiny_llama

VOCAB = 40
K, C = 4, 0.1

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class WordTokenizer:
    """One token per letter a-z (ids 3-28) and one for the word ``hello`` (id 29); ``%`` is unknown (id 30); bos 1
    and eos 2 are special, as Hugging Face tokenizers list them in ``all_special_ids``."""

    bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 0, 30
    all_special_ids = [0, 1, 2, 30]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        i = 0
        while i < len(text):
            if text.startswith("hello", i):
                ids.append(29)
                i += 5
            else:
                ids.append(3 + ord(text[i]) - ord("a") if "a" <= text[i] <= "z" else self.unk_token_id)
                i += 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = []
        for t in ids:
            if 3 <= t < 29:
                out.append(chr(ord("a") + t - 3))
            elif t == 29:
                out.append("hello")
            elif not skip_special_tokens:
                out.append({0: "<pad>", 1: "<s>", 2: "</s>", 30: "<unk>"}[t])
        return "".join(out)


def model(seed: int, **overrides: object) -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=seed, init_std=0.4, **overrides)


def speedup_by_hand(alpha: float) -> float:
    """S(alpha) = (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)) (DESIGN.md)."""
    return (1 - alpha ** (K + 1)) / ((1 - alpha) * (K * C + 1))


def alpha_by_hand(verifier: torch.nn.Module, drafter: torch.nn.Module, texts: list[list[int]]) -> float:
    """Mean over every prefix of sum_x min(p, q), each text run alone through eval-mode copies of the models."""
    verifier, drafter = copy.deepcopy(verifier).eval(), copy.deepcopy(drafter).eval()
    values: list[float] = []
    with torch.no_grad():
        for ids in texts:
            x = torch.tensor([ids])
            p = torch.softmax(verifier(input_ids=x).logits[0, :-1].double(), -1)
            q = torch.softmax(drafter(input_ids=x).logits[0, :-1].double(), -1)
            values += torch.minimum(p, q).sum(-1).tolist()
    return sum(values) / len(values)


def run(verifier, drafter, tasks, **kwargs):
    return evaluate(verifier, drafter, tasks, num_draft_tokens=K, cost_ratio=C, wall_clock=False, progress=False,
                    max_new_tokens=3, **kwargs)


TEXTS = [[5, 9, 12, 7, 22, 3], [17, 4, 4, 30, 8], [11, 6, 25, 14]]


def test_train_mode_models_are_measured_in_eval_mode_and_keep_their_modes():
    verifier, drafter = model(0, attention_dropout=0.3), model(1, attention_dropout=0.3)
    verifier.train()
    drafter.train()
    drafter.model.layers[0].self_attn.eval()  # a submodule with a mode of its own must get it back
    modes = [m.training for m in (*verifier.modules(), *drafter.modules())]
    expected = alpha_by_hand(verifier, drafter, TEXTS)
    first = run(verifier, drafter, {"a": TEXTS}).task("a").alpha
    second = run(verifier, drafter, {"a": TEXTS}).task("a").alpha
    assert first == pytest.approx(expected, rel=1e-5) and second == pytest.approx(expected, rel=1e-5)
    assert [m.training for m in (*verifier.modules(), *drafter.modules())] == modes


def test_characters_per_token_leave_out_bos_for_strings_and_token_ids():
    verifier, drafter = model(0), model(1)
    tokenizer = WordTokenizer()
    # 4 characters, one token each: rho = 1 whether or not a BOS is prepended (BOS is no text)
    strings = {"a": ["abcd", "efgh"]}
    for special in (False, True):
        report = run(verifier, drafter, strings, tokenizer=tokenizer, add_special_tokens=special)
        assert report.task("a").chars_per_token == pytest.approx(1.0)
    ids = {"a": [[1, 3, 4, 5, 6], [1, 7, 8, 9, 10, 2]]}  # bos + 4 letters, bos + 4 letters + eos
    assert run(verifier, drafter, ids, tokenizer=tokenizer).task("a").chars_per_token == pytest.approx(1.0)
    # 'hello' is 5 characters in one token: (5 + 2) characters over 3 text tokens
    report = run(verifier, drafter, {"a": ["helloab"]}, tokenizer=tokenizer, add_special_tokens=True)
    assert report.task("a").chars_per_token == pytest.approx(7 / 3)


def test_char_speedup_is_rho_times_s_and_depends_on_its_task_alone():
    verifier, drafter = model(0), model(1)
    tokenizer = WordTokenizer()
    hello = {"texts": ["hellohelloab", "abhellohello"]}  # 12 characters in 4 tokens: rho = 3
    alone = run(verifier, drafter, {"hello": hello}, tokenizer=tokenizer).task("hello")
    paired = run(verifier, drafter, {"hello": hello, "letters": ["abcdefg", "hijklmn"]}, tokenizer=tokenizer)
    alpha = alpha_by_hand(verifier, drafter, [tokenizer.encode(t) for t in hello["texts"]])
    assert alone.chars_per_token == pytest.approx(3.0)
    assert alone.char_speedup_predicted == pytest.approx(3.0 * speedup_by_hand(alpha), rel=1e-5)
    assert paired.task("hello").char_speedup_predicted == pytest.approx(alone.char_speedup_predicted, rel=1e-9)
    assert paired.task("letters").char_speedup_predicted == pytest.approx(
        1.0 * speedup_by_hand(paired.task("letters").alpha), rel=1e-9)
    # the generation variant: rho_T times the speed-up predicted from the measured tokens per call
    with_prompts = run(verifier, drafter, {"hello": {**hello, "prompts": ["hello", "ab"]}}, tokenizer=tokenizer)
    row = with_prompts.task("hello")
    assert row.char_speedup_predicted_generation == pytest.approx(3.0 * row.tokens_per_call / (K * C + 1))


def test_texts_too_short_to_teacher_force_are_not_counted_and_are_warned_about():
    verifier, drafter = model(0), model(1)
    tokenizer = WordTokenizer()
    texts = ["abcd", "hello", "fgh"]  # 'hello' is one token: no prefix with a next token
    with pytest.warns(SpecdecWarning, match=r"task 'a': 1 of its 3 texts have fewer than 2 tokens"):
        row = run(verifier, drafter, {"a": texts}, tokenizer=tokenizer).task("a")
    assert (row.num_texts, row.num_texts_dropped, row.num_tokens) == (2, 1, 3 + 2)
    assert row.chars_per_token == pytest.approx(1.0)  # (4 + 3) characters over (4 + 3) tokens, 'hello' left out
    assert row.alpha == pytest.approx(alpha_by_hand(verifier, drafter, [tokenizer.encode(t) for t in texts[::2]]),
                                      rel=1e-5)
    # max_length cuts first: with every text left with one token, nothing is measured
    with pytest.warns(SpecdecWarning, match="longer than max_length=1"), \
            pytest.raises(ValueError, match=r"tasks\['a'\].texts has no text of at least 2 tokens"):
        run(verifier, drafter, {"a": texts}, tokenizer=tokenizer, max_length=1)


def _specdec_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, SpecdecWarning)]


def test_max_examples_checks_only_the_examples_it_uses():
    verifier, drafter = model(0), model(1)
    tokenizer = WordTokenizer()
    tasks = {"a": {"texts": ["abcdef", "%%%%%%%%"], "prompts": ["abc", "%%%%%%%%%"]}}
    unused = _specdec_warnings(lambda: run(verifier, drafter, tasks, tokenizer=tokenizer, max_examples=1))
    assert unused == []
    used = _specdec_warnings(lambda: run(verifier, drafter, tasks, tokenizer=tokenizer))
    assert any("unknown" in message for message in used)


def test_a_task_with_prompts_and_an_empty_text_list_is_measured_on_generation():
    verifier, drafter = model(0), model(1)
    report = run(verifier, drafter, {"a": {"prompts": [[5, 9], [7]], "texts": []},
                                     "b": TaskData(prompts=[[4, 4, 8]], texts=[])})
    for name in ("a", "b"):
        row = report.task(name)
        assert row.alpha is None and row.num_texts == 0 and row.num_prompts > 0
        assert 0.0 <= row.alpha_measured <= 1.0 and not math.isnan(row.tokens_per_call)
    with pytest.raises(ValueError, match=r"tasks\['a'\] has neither prompts nor texts"):
        run(verifier, drafter, {"a": {"prompts": [], "texts": []}})
