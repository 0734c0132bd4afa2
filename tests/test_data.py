"""The built-in task suite, the character tokenizer and the task-file loaders (specdec.data)."""

from __future__ import annotations

import json

import pytest

from specdec import data
from specdec.fairness import TaskData


def test_suite_is_deterministic_and_seeded():
    first = data.synthetic_task_suite(5, seed=3)
    again = data.synthetic_task_suite(5, seed=3)
    other = data.synthetic_task_suite(5, seed=4)
    assert first == again
    assert first != other
    assert set(first) == set(data.TASK_NAMES)
    assert data.generate_examples("copy", 4, split="train") != data.generate_examples("copy", 4, split="eval")


def test_tasks_have_their_structure():
    for task, examples in data.synthetic_task_suite(20, seed=0).items():
        for ex in examples:
            assert ex.prompt and ex.continuation and ex.text == ex.prompt + ex.continuation
            if task == "copy":
                word = ex.prompt.removeprefix("copy ").removesuffix("|")
                assert ex.continuation == word + "."
            elif task == "reverse":
                word = ex.prompt.removeprefix("reverse ").removesuffix("|")
                assert ex.continuation == word[::-1] + "."
            elif task == "count":
                start = int(ex.prompt.removeprefix("count ").removesuffix(":"))
                numbers = [int(n) for n in ex.continuation.rstrip(".").split()]
                assert numbers == list(range(start + 1, start + 1 + len(numbers)))
            elif task == "arithmetic":
                for step in ex.text.rstrip(";").split(";"):
                    left, total = step.split("=")
                    a, b = left.split("+")
                    assert int(a) + int(b) == int(total)
    latin = data.generate_examples("grammar_latin", 6, seed=1)
    cyrillic = data.generate_examples("grammar_cyrillic", 6, seed=1)
    assert all(not any("a" <= c <= "z" for c in ex.text) for ex in cyrillic)
    assert data.transliterate_to_cyrillic("the fox.") == "тхе фож."
    assert len(set(data.LATIN_TO_CYRILLIC.values())) == 26  # one-to-one
    assert all(ex.text.endswith(".") for ex in latin)


def test_skewed_mixture_apportions_exactly():
    examples = data.sample_mixture(data.SKEWED_MIXTURE, 1000, seed=0)
    counts = {task: sum(ex.task == task for ex in examples) for task in data.TASK_NAMES}
    assert len(examples) == 1000
    assert counts["grammar_cyrillic"] == 10 and counts["reverse"] == 30
    assert data.sample_mixture(data.SKEWED_MIXTURE, 50, seed=1) == data.sample_mixture(data.SKEWED_MIXTURE, 50, seed=1)
    with pytest.raises(ValueError, match="unknown built-in task"):
        data.sample_mixture({"poetry": 1.0}, 10)
    with pytest.raises(ValueError, match="non-negative"):
        data.sample_mixture({"copy": -1.0}, 10)


def test_char_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = data.build_char_tokenizer()
    text = data.generate_examples("grammar_cyrillic", 1)[0].text + " 12+3=15;"
    encoded = tokenizer(text)["input_ids"]
    assert encoded[0] == tokenizer.bos_token_id and len(encoded) == len(text) + 1
    assert tokenizer.decode(encoded, skip_special_tokens=True) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer("Ω")["input_ids"][1] == tokenizer.unk_token_id
    batch = tokenizer(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]  # left padding for generation
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert reloaded(text)["input_ids"] == encoded
    assert reloaded.decode(encoded, skip_special_tokens=True) == text
    assert len(reloaded) == len(tokenizer)


def test_suite_to_task_data():
    tasks = data.suite_to_task_data(data.synthetic_task_suite(3))
    assert isinstance(tasks["copy"], TaskData)
    assert len(tasks["copy"].prompts) == len(tasks["copy"].texts) == 3


def test_load_jsonl(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"task": "en", "prompt": "Q: 1+1?", "text": "Q: 1+1? A: 2"}, {"task": "de", "text": "F: 2+2? A: 4"},
            {"task": "de", "prompt": "F: 3+3?", "completion": " A: 6"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    tasks = data.load_tasks(path)
    assert set(tasks) == {"en", "de"}
    assert tasks["en"].prompts == ["Q: 1+1?"] and tasks["en"].texts == ["Q: 1+1? A: 2"]
    assert tasks["de"].prompts == ["F: 3+3?"] and tasks["de"].texts == ["F: 2+2? A: 4", "F: 3+3? A: 6"]
    assert data.load_tasks(path, max_examples=1)["de"].texts == ["F: 2+2? A: 4"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"prompt": "x"}', "'task'"),
    ('{"task": "a"}', "'text' field"),
    ('["a"]', "JSON object"),
    ('{"task": "a", "text": 3}', "must be a string"),
])
def test_load_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task": "ok", "text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(data.TaskFileError, match=message) as error:
        data.load_tasks(path)
    assert "bad.jsonl:2" in str(error.value)


def test_shared_data_layouts(tmp_path):
    """The four shared data sets' layouts, in miniature: GSM8K JSONL without a task field, MSVAMP JSON lists, mCoT
    JSON lines with a chain-of-thought response, NTREX one-sentence-per-line files next to a DOCUMENT_IDS.tsv."""
    gsm = tmp_path / "train.jsonl"
    gsm.write_text(json.dumps({"question": "2+2?", "answer": "4\n#### 4"}) + "\n", encoding="utf-8")
    tasks = data.load_tasks(gsm, as_task_data=False)
    assert tasks == {"train": data.TaskTexts(["2+2?"], ["2+2?" + data.QA_SEPARATOR + "4\n#### 4"])}

    msvamp = tmp_path / "msvamp"
    msvamp.mkdir()
    for lang, question in (("en", "How many?"), ("de", "Wie viele?")):
        rows = [{"query": "How many?", "question": question, "equation": "+ 1 2", "answer": "3.0"}]
        (msvamp / f"test_{lang}.json").write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    tasks = data.load_tasks(msvamp, as_task_data=False)
    assert sorted(tasks) == ["de", "en"] and tasks["de"].texts == ["Wie viele?" + data.QA_SEPARATOR + "3.0"]

    mcot = tmp_path / "mcot"
    mcot.mkdir()
    for family in ("mgsm", "msvamp"):
        row = {"question": "Question:\nQ?\nAnswer:\n", "response": "Think. The answer is 3.", "answer": 3}
        (mcot / f"mcot_ft_{family}_de.json").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n",
                                                         encoding="utf-8")
    tasks = data.load_tasks(mcot, as_task_data=False)  # two file families: tasks named after the files
    assert sorted(tasks) == ["mcot_ft_mgsm_de", "mcot_ft_msvamp_de"]
    assert tasks["mcot_ft_msvamp_de"].texts == ["Question:\nQ?\nAnswer:\nThink. The answer is 3."] * 2

    ntrex = tmp_path / "ntrex"
    ntrex.mkdir()
    (ntrex / "DOCUMENT_IDS.tsv").write_text("bbc.1\nbbc.1\n", encoding="utf-8")
    (ntrex / "README.md").write_text("# about\n", encoding="utf-8")
    for kind, lang in (("ref", "deu"), ("ref", "zho-CN"), ("src", "eng")):
        (ntrex / f"newstest2019-{kind}.{lang}.txt").write_text(f"{lang} one\n\n{lang} two\n", encoding="utf-8")
    tasks = data.load_tasks(ntrex, as_task_data=False)  # one file per language: tasks named by MGSM's codes
    assert sorted(tasks) == ["de", "en", "zh"] and tasks["en"] == data.TaskTexts([], ["eng one", "eng two"])
    assert tasks["zh"].texts == ["zho-CN one", "zho-CN two"]

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"task": "t", "prompt": "b"}) + "\n",
                     encoding="utf-8")
    with pytest.raises(data.TaskFileError, match="mixed.jsonl:2: has a 'task' field but the first row has none"):
        data.load_tasks(mixed)


def test_load_tsv_both_layouts(tmp_path):
    with_header = tmp_path / "mixed.tsv"
    with_header.write_text("task\ttext\nen\thello there\nfr\tbonjour\n", encoding="utf-8")
    tasks = data.load_tasks(with_header)
    assert tasks["en"].texts == ["hello there"] and tasks["fr"].texts == ["bonjour"]
    qa = tmp_path / "gsm_en.tsv"
    qa.write_text('What is "2+2"?\t4\nAnd 3+3?\t6\n', encoding="utf-8")
    tasks = data.load_tasks(qa)
    assert list(tasks) == ["gsm_en"]
    assert tasks["gsm_en"].prompts == ['What is "2+2"?', "And 3+3?"]
    assert tasks["gsm_en"].texts[0] == 'What is "2+2"?' + data.QA_SEPARATOR + "4"
    bom = tmp_path / "bom.tsv"  # e.g. a spreadsheet export: byte-order mark before the header
    bom.write_bytes("task\ttext\na\tx\nb\ty\n".encode("utf-8-sig"))
    assert sorted(data.load_tasks(bom)) == ["a", "b"]
    qa_header = tmp_path / "qa.tsv"
    qa_header.write_text("Question\tAnswer\nq1\ta1\n", encoding="utf-8")
    assert data.load_tasks(qa_header)["qa"].prompts == ["q1"]


@pytest.mark.parametrize(("name", "content", "message"), [
    ("one.tsv", "just a question\n", "question<TAB>answer"),
    ("empty.tsv", "", "empty"),
    ("short.tsv", "task\ttext\nen\n", "short.tsv:2"),
    ("blank.tsv", "q1\ta1\n\n\nbad\n", "blank.tsv:4"),  # the line in the file, blank lines counted
])
def test_load_tsv_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(data.TaskFileError, match=message):
        data.load_tasks(path)


def test_load_mgsm_folder(tmp_path):
    folder = tmp_path / "mgsm"
    folder.mkdir()
    (folder / "mgsm_en.tsv").write_text("Two plus two?\t4\nThree plus three?\t6\n", encoding="utf-8")
    (folder / "mgsm_ru.tsv").write_text("Два плюс два?\t4\n", encoding="utf-8")
    (folder / "README.md").write_text("not a task", encoding="utf-8")
    tasks = data.load_tasks(folder)
    assert sorted(tasks) == ["en", "ru"]
    assert tasks["ru"].prompts == ["Два плюс два?"]
    assert tasks["en"].texts == ["Two plus two?\n4", "Three plus three?\n6"]
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(data.TaskFileError, match="<name>_<lang>.tsv"):
        data.load_tasks(empty)


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(data.TaskFileError, match="not found"):
        data.load_tasks(tmp_path / "absent.jsonl")
    other = tmp_path / "tasks.csv"
    other.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(data.TaskFileError, match="unsupported"):
        data.load_tasks(other)


def test_read_prompts_file(tmp_path):
    plain = tmp_path / "prompts.txt"
    plain.write_text("count 3:\n\nline one\\nline two\n", encoding="utf-8")
    assert data.read_prompts_file(plain) == ["count 3:", "line one\nline two"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"prompt": "b"}\n', encoding="utf-8")
    assert data.read_prompts_file(jsonl) == ["a", "b"]
    jsonl.write_text('{"text": "a"}\n', encoding="utf-8")
    with pytest.raises(data.TaskFileError, match="'prompt' field"):
        data.read_prompts_file(jsonl)


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    plain = tmp_path / "bom.txt"
    plain.write_bytes("count 5:\nsecond\n".encode("utf-8-sig"))
    assert data.read_prompts_file(plain) == ["count 5:", "second"]


def test_a_pretty_printed_json_object_gets_a_clear_error(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"task": "a", "text": "x"}, indent=2), encoding="utf-8")
    with pytest.raises(data.TaskFileError, match="one JSON object spread over several lines"):
        data.load_tasks(path)
    lines = tmp_path / "lines.json"  # JSON lines in a .json file still load
    lines.write_text('{"task": "a", "text": "x"}\n{"task": "b", "text": "y"}\n', encoding="utf-8")
    assert set(data.load_tasks(lines)) == {"a", "b"}


def test_data_arguments_are_checked_by_name(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"task": "a", "text": "x"}\n', encoding="utf-8")
    for bad in ("3", 2.5, 0, True):
        with pytest.raises(ValueError, match="max_examples"):
            data.load_tasks(path, max_examples=bad)
    with pytest.raises(ValueError, match="num_examples"):
        data.generate_examples("count", "3")
    with pytest.raises(ValueError, match="num_examples"):
        data.sample_mixture({"count": 1.0}, 2.5)
    with pytest.raises(ValueError, match="weights"):
        data.sample_mixture({"count": float("nan")}, 5)
    with pytest.raises(TypeError, match="tasks must be a list"):
        data.synthetic_task_suite(3, tasks="count")
    assert set(data.synthetic_task_suite(2, tasks=["count"])) == {"count"}


# ------------------------------------------------------------------------------------------------ language codes
def test_language_codes_map_the_ntrex_files_to_the_mgsm_codes():
    assert set(data.LANGUAGE_CODES.values()) == set(data.MGSM_LANGUAGES)  # the 11 languages, one to one
    assert len(data.LANGUAGE_CODES) == len(data.MGSM_LANGUAGES)
    assert data.LANGUAGE_CODES["deu"] == "de" and data.LANGUAGE_CODES["zho-CN"] == "zh"


def test_a_folder_with_two_files_for_one_language_names_its_tasks_after_the_files(tmp_path):
    """``x.deu.txt`` and ``x_de.tsv`` are one language once the codes are mapped: tasks fall back to file names."""
    (tmp_path / "news.deu.txt").write_text("Ein Satz.\n", encoding="utf-8")
    (tmp_path / "mgsm_de.tsv").write_text("Frage?\t1\n", encoding="utf-8")
    assert sorted(data.load_tasks(tmp_path)) == ["mgsm_de", "news.deu"]


# ------------------------------------------------------------------------------------------------- built-in MGSM
def _answer(text: str) -> str:
    return text.rsplit(data.QA_SEPARATOR, 1)[1]


def test_builtin_mgsm_is_the_parallel_data_set():
    tasks = data.load_builtin("mgsm", as_task_data=False)
    assert tuple(tasks) == data.MGSM_LANGUAGES
    for name, task in tasks.items():
        assert len(task.prompts) == len(task.texts) == 250, name
        assert all(text.startswith(prompt + data.QA_SEPARATOR) for prompt, text in zip(task.prompts, task.texts,
                                                                                      strict=True))
    # line i is one problem in every language: the answers agree
    english = [_answer(text) for text in tasks["en"].texts]
    for name, task in tasks.items():
        assert [_answer(text) for text in task.texts] == english, name
    assert tasks["en"].texts[1].endswith("How many bolts in total does it take?\n3")
    assert any("\u0995" <= char <= "\u09ff" for char in tasks["bn"].prompts[0])  # Bengali script


def test_builtin_mgsm_ships_with_its_license_source_and_checksums():
    import hashlib

    folder = data.builtin_path("mgsm")
    info = data.BUILTIN_DATASETS["mgsm"]
    license_text = (folder / info.license_file).read_text(encoding="utf-8")
    assert "Attribution 4.0 International" in license_text and info.license == "CC BY 4.0"
    note = (folder / "README.md").read_text(encoding="utf-8")
    for needle in ("CC BY 4.0", "google-research/url-nlp", "452a21ad3dae5668c06ceeac21ff073e1e40f9be", "2210.03057"):
        assert needle in note
    sums = dict(reversed(line.split("  ./")) for line in (folder / "SHA256SUMS").read_text().splitlines())
    assert sorted(sums) == sorted(["LICENSE.txt"] + [f"mgsm_{lang}.tsv" for lang in data.MGSM_LANGUAGES])
    for name, digest in sums.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name


def test_load_tasks_resolves_the_builtin_name(tmp_path, monkeypatch):
    by_name = data.load_tasks("mgsm", as_task_data=False, names=["bn", "en"], max_examples=3)
    assert list(by_name) == ["bn", "en"]  # in the order asked for
    assert by_name["en"] == data.load_builtin("mgsm", as_task_data=False, max_examples=3)["en"]
    assert len(by_name["bn"].texts) == 3
    with_task_data = data.load_builtin("mgsm", names=["de"], max_examples=2)
    assert isinstance(with_task_data["de"], TaskData) and len(with_task_data["de"].prompts) == 2
    # a folder named like a built-in set is read as the folder it is
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mgsm").mkdir()
    (tmp_path / "mgsm" / "mgsm_xx.tsv").write_text("q?\t1\n", encoding="utf-8")
    assert list(data.load_tasks("mgsm")) == ["xx"]


def test_builtin_and_task_names_are_checked():
    with pytest.raises(ValueError, match="name must be a built-in data set .*mgsm.*'gsm8k'"):
        data.load_builtin("gsm8k")
    with pytest.raises(data.UnknownTaskError, match="no task named 'xx', 'yy'; the tasks are bn, de, en"):
        data.load_builtin("mgsm", names=["en", "xx", "yy"])
    with pytest.raises(data.TaskFileError, match="^mgsm: no task named 'xx'; the tasks are bn, de, en"):
        data.load_tasks("mgsm", names=["xx"])  # a built-in set is named as it was given
    with pytest.raises(TypeError, match="names must be a list of task names"):
        data.load_builtin("mgsm", names="en")
    with pytest.raises(ValueError, match="names must name at least one task"):
        data.load_builtin("mgsm", names=[])


def test_a_missing_builtin_folder_says_to_reinstall(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "BUILTIN_DATA_DIR", tmp_path)
    with pytest.raises(data.TaskFileError, match="missing from this installation.*reinstall"):
        data.load_builtin("mgsm")
