"""specdec.compat: unknown tokens, texts cut at the models' positions, tokenizers and output sizes that differ."""

from __future__ import annotations

import re
import warnings

import pytest
from transformers import GPT2Config

from specdec import data
from specdec.compat import (
    UNKNOWN_TOKEN_THRESHOLD,
    SpecdecWarning,
    check_same_tokenizer,
    check_task_texts,
    model_positions,
    pair_positions,
    resolve_vocab_size,
    tokenizer_difference,
)

from models import tiny_llama


@pytest.fixture(scope="module")
def char_tokenizer():
    return data.build_char_tokenizer()  # the demo's 78-token character tokenizer


def _messages(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, SpecdecWarning)]


def test_unknown_tokens_on_mgsm_bengali_are_named_with_their_rate(char_tokenizer):
    tasks = data.load_builtin("mgsm", names=["en", "bn", "zh"], max_examples=20)
    with pytest.warns(SpecdecWarning) as record:
        checks = check_task_texts(tasks, char_tokenizer)
    messages = _messages(record)
    # the character tokenizer covers Latin letters (lower case), digits and some punctuation: English mostly fits
    assert checks["en"].unknown_rate < UNKNOWN_TOKEN_THRESHOLD
    assert checks["bn"].unknown_rate > 0.7 and checks["zh"].unknown_rate > 0.7
    assert len(messages) == 2 and not any("'en'" in m for m in messages)
    bengali = next(m for m in messages if m.startswith("task 'bn'"))
    assert f"{checks['bn'].unknown_rate:.1%} of its {checks['bn'].num_tokens:,} tokens are '<unk>'" in bengali
    # the figure is the share of the text's tokens (special tokens left out) that are <unk>
    ids = [i for text in tasks["bn"].texts + tasks["bn"].prompts
           for i in char_tokenizer.encode(text, add_special_tokens=False)]
    assert checks["bn"].num_tokens == len(ids)
    assert checks["bn"].unknown_tokens == sum(i == char_tokenizer.unk_token_id for i in ids)


def test_the_unknown_threshold_is_a_setting(char_tokenizer):
    tasks = {"mixed": ["ab\u0995\u0995"]}  # 2 known characters, 2 unknown: 50% (BOS is not counted)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpecdecWarning)
        checks = check_task_texts(tasks, char_tokenizer, unknown_threshold=0.5, add_special_tokens=True)
        assert checks["mixed"].unknown_rate == 0.5
        check_task_texts(tasks, char_tokenizer, unknown_threshold=None)
    with pytest.warns(SpecdecWarning, match=r"task 'mixed': 50.0% of its 4 tokens"):
        check_task_texts(tasks, char_tokenizer, unknown_threshold=0.49)


def test_texts_cut_at_the_positions_are_counted_per_task(char_tokenizer):
    tasks = {"long": data.TaskTexts(prompts=[], texts=["a" * 9, "b" * 30, "c" * 50]),
             "short": data.TaskTexts(prompts=[], texts=["abc"])}
    with pytest.warns(SpecdecWarning) as record:
        checks = check_task_texts(tasks, char_tokenizer, max_positions=20, add_special_tokens=True)
    long = checks["long"]
    # with BOS: 10, 31 and 51 tokens; at 20 positions two texts lose 11 and 31 tokens
    assert (long.texts_cut, long.tokens_cut, long.text_tokens, long.limit) == (2, 42, 92, 20)
    assert checks["short"].texts_cut == 0
    assert _messages(record) == ["task 'long': 2 of its 3 texts are longer than the models' 20 positions "
                                 "(max_position_embeddings): 42 of their 92 tokens (46%) are cut off and not measured"]
    # a lower max_length cuts first, and the message names it
    with pytest.warns(SpecdecWarning, match=r"task 'short': 1 of its 1 texts are longer than max_length=2: 2 of"):
        check_task_texts({"short": ["abc"]}, char_tokenizer, max_positions=20, max_length=2, add_special_tokens=True)


def test_prompts_that_leave_no_room_for_the_new_tokens(char_tokenizer):
    tasks = {"p": {"prompts": ["a" * 5, "b" * 15], "texts": None}}
    with pytest.warns(SpecdecWarning, match=r"task 'p': 1 of its 2 prompts leave fewer than max_new_tokens=8 of the "
                                            r"models' 20 positions"):
        checks = check_task_texts(tasks, char_tokenizer, max_positions=20, max_new_tokens=8)
    assert checks["p"].prompts_too_long == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpecdecWarning)  # 15 + 5 fits in 20
        check_task_texts(tasks, char_tokenizer, max_positions=20, max_new_tokens=5)
        assert check_task_texts(tasks, char_tokenizer, max_positions=20, max_new_tokens=8,
                                warn=False)["p"].prompts_too_long == 1


def test_token_id_lists_are_checked_as_they_are(char_tokenizer):
    unk = char_tokenizer.unk_token_id
    checks = check_task_texts({"ids": [[5, unk, unk, 6]]}, char_tokenizer, unknown_threshold=None)
    assert (checks["ids"].num_tokens, checks["ids"].unknown_tokens) == (4, 2)


def test_check_task_texts_arguments_are_checked(char_tokenizer):
    with pytest.raises(TypeError, match="tasks must be a mapping"):
        check_task_texts(["a"], char_tokenizer)
    with pytest.raises(TypeError, match=r"tasks\['a'\] must be a TaskData"):
        check_task_texts({"a": 3}, char_tokenizer)
    for wrong, error in ((1.5, ValueError), (1, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                         (float("inf"), ValueError), (True, TypeError), ("0.1", TypeError)):
        with pytest.raises(error) as caught:  # one message, whatever is wrong with the value
            check_task_texts({"a": ["x"]}, char_tokenizer, unknown_threshold=wrong)
        assert str(caught.value) == f"unknown_threshold must be a number in [0, 1) or None, got {wrong!r}"
    assert check_task_texts({"a": ["x"]}, char_tokenizer, unknown_threshold=0)["a"].num_texts == 1
    with pytest.raises(ValueError, match="max_positions"):
        check_task_texts({"a": ["x"]}, char_tokenizer, max_positions=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_task_texts({"a": ["x"]}, char_tokenizer, max_new_tokens=-1)


# ----------------------------------------------------------------------------------------------------- tokenizers
def test_different_tokenizers_are_an_error_that_says_how_they_differ(char_tokenizer):
    same = data.build_char_tokenizer()
    assert tokenizer_difference(char_tokenizer, same) is None
    check_same_tokenizer(char_tokenizer, same)
    wider = data.build_char_tokenizer(data.ALPHABET + "ABC")  # the same ids, and three more
    reordered = data.build_char_tokenizer(data.ALPHABET[::-1])  # the same tokens under other ids
    assert tokenizer_difference(char_tokenizer, wider, "v", "d") == "v has 78 tokens and d 81; 3 ids exist only in d"
    with pytest.raises(ValueError, match=re.escape(
            "the drafter's tokenizer differs from the verifier's tokenizer: the verifier's tokenizer has 78 tokens "
            "and the drafter's tokenizer 78; 74 of the ids both have map to different tokens (e.g. id 4: '0' against "
            "'\\n')")):
        check_same_tokenizer(char_tokenizer, reordered)
    with pytest.raises(ValueError, match=r"^the drafter \(d\) differs from the verifier \(v\): the verifier \(v\) "
                                         r"has 78 tokens and the drafter \(d\) 81"):
        check_same_tokenizer(char_tokenizer, wider, verifier_name="the verifier (v)", drafter_name="the drafter (d)")
    with pytest.raises(TypeError, match="get_vocab"):
        check_same_tokenizer(char_tokenizer, object())


# -------------------------------------------------------------------------------------------- output sizes, positions
def test_differing_output_sizes_need_vocab_size(char_tokenizer):
    verifier = tiny_llama(vocab_size=78, num_layers=1)
    drafter = tiny_llama(vocab_size=200, num_layers=1, seed=1)
    with pytest.raises(ValueError, match=r"the drafter has 200 output rows \(token ids\) and the verifier 78.*pass "
                                         r"vocab_size=78 \(the tokenizer has 78 tokens\)"):
        resolve_vocab_size(verifier, drafter, tokenizer=char_tokenizer)
    with pytest.raises(ValueError, match="pass --vocab-size 78 to compare"):
        resolve_vocab_size(verifier, drafter, option="--vocab-size")
    assert resolve_vocab_size(verifier, drafter, 78) == 78
    assert resolve_vocab_size(verifier, drafter, 50) == 50
    with pytest.raises(ValueError, match=r"vocab_size must be an int in \[1, 79\) \(the models' output sizes are 78 "
                                         r"and 200\), got 200"):
        resolve_vocab_size(verifier, drafter, 200)
    # the tokenizers were compared and match: the extra rows are padding of one vocabulary
    assert resolve_vocab_size(verifier, drafter, tokenizer=char_tokenizer, same_tokenizer=True) == 78
    assert resolve_vocab_size(verifier, tiny_llama(vocab_size=78, num_layers=1, seed=2)) is None


def test_model_positions():
    assert model_positions(tiny_llama(vocab_size=20, num_layers=1)) == 512
    short = tiny_llama(vocab_size=20, num_layers=1)
    short.config.max_position_embeddings = 64
    assert pair_positions(tiny_llama(vocab_size=20, num_layers=1), short) == 64

    class GPT2Like:
        config = GPT2Config(n_positions=96)

    assert model_positions(GPT2Like()) == 96
    assert model_positions(object()) is None and pair_positions(object(), object()) is None
