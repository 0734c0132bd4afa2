"""The prepare stage: the training corpus and the shared tokenizer, from the data folder, written to the work folder.

Training text, by language (MGSM codes) and domain:

* ``cot``: mCoT-7B's chain-of-thought answers to the MSVAMP problems, ``mcot_msvamp/mcot_outputs/
  mcot_ft_msvamp_<lang>.json`` (JSON lines ``question``/``response``; the question already holds the
  ``Question:`` / ``Answer:`` template and the language's "let's think step by step"); for English also GSM8K train
  (``gsm8k/train.jsonl``), put in the same template, its calculator annotations ``<<...>>`` removed and its final
  ``#### n`` written as "The answer is n.";
* ``news``: NTREX-128 (``ntrex128/newstest2019-ref.<code>.txt``, English ``newstest2019-src.eng.txt``), sentences
  grouped by document (``DOCUMENT_IDS.tsv``) into texts of at most ``news_max_lines`` sentences.

MGSM is evaluation only: ``mcot_ft_mgsm_*`` and ``mgsm/`` are never read here, and a training text whose question is
one of the evaluation set's questions is dropped (counted in the manifest). Every (language, domain) keeps a seeded
held-out share (``heldout_fraction``, at most ``heldout_max`` texts) that no model trains on.

The tokenizer is a byte-level BPE (``tokenizers``; digits split one by one) of ``vocab_size`` tokens, trained on the
same number of characters of every language (``tokenizer_chars_per_language``, default as many as the smallest
language has), with ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3; encoding prepends ``<bos>``. With a
pretrained verifier (``verifier.pretrained``) no tokenizer is trained: the verifier's own is saved instead, and its
special ids are used throughout (:func:`special_ids`; SmolLM2's adds no BOS and pads with its EOS).

Written: ``<work>/corpus/train.jsonl.gz`` and ``heldout.jsonl.gz`` (rows ``lang``, ``domain``, ``prompt``,
``text``), ``<work>/corpus/manifest.json`` (counts, characters, tokens and characters per token by language and
domain, the sources with their sizes, the prompt triggers), ``<work>/tokenizer/`` (``save_pretrained``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.data import LANGUAGE_CODES, SPECIAL_TOKENS, load_jsonl_tasks
from specdec.training.finetune import held_out_split

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
"""The special ids of the pipeline's own BPE (:func:`train_tokenizer`); a pretrained verifier's follow its tokenizer
(:func:`special_ids`)."""
DOMAINS = ("cot", "news")
DEFAULT_TRIGGER = "Let's think step by step."
FILE_CODES = {short: long for long, short in LANGUAGE_CODES.items()}
"""MGSM code -> NTREX-128's file code (``de`` -> ``deu``)."""


def _mcot_examples(path: Path, lang: str) -> list[tuple[str, str]]:
    """``(prompt, text)`` of every row of an mCoT output file: the question (its template included) and the question
    followed by the response (:func:`specdec.data.load_jsonl_tasks`)."""
    entry = load_jsonl_tasks(path, task=lang)[lang]
    if len(entry.prompts) != len(entry.texts):
        raise ValueError(f"{path}: every row needs a non-empty 'question' and a 'response'")
    return list(zip(entry.prompts, entry.texts, strict=True))


def _gsm8k_pairs(path: Path) -> list[tuple[str, str]]:
    """``(question, answer)`` of every row of GSM8K's JSON lines (the raw answer, to rewrite); ValueError naming a row
    without them."""
    pairs = []
    with path.open(encoding="utf-8-sig") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            question, answer = row.get("question"), row.get("answer")
            if not isinstance(question, str) or not isinstance(answer, str):
                raise ValueError(f"{path}:{number}: needs string fields 'question' and 'answer'")
            pairs.append((question, answer))
    return pairs


def read_triggers(data: Path) -> dict[str, str]:
    """language -> "let's think step by step" in it, from ``mcot_msvamp/prompt.txt`` (``lang || phrase`` lines)."""
    path = data / "mcot_msvamp" / "prompt.txt"
    triggers = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8-sig").splitlines():
            lang, sep, phrase = line.partition("||")
            if sep and lang.strip() and phrase.strip():
                triggers[lang.strip()] = phrase.strip()
    return triggers


def cot_prompt(question: str, trigger: str) -> str:
    """The mCoT template: what a chain-of-thought answer continues."""
    return f"Question:\n{question.strip()}\nAnswer:\n{trigger}\n"


def _gsm8k_answer(answer: str) -> str:
    answer = re.sub(r"<<[^>]*>>", "", answer)
    body, sep, final = answer.rpartition("####")
    return f"{body.strip()}\nThe answer is {final.strip()}." if sep else answer.strip()


def _question_of(prompt: str) -> str:
    """The bare question inside an mCoT prompt (``Question:\\n<q>\\nAnswer:...``)."""
    match = re.match(r"\s*Question:\s*\n(?P<q>.*?)\nAnswer:", prompt, flags=re.S)
    return (match["q"] if match else prompt).strip()


def _news_file(folder: Path, lang: str) -> Path:
    """NTREX-128's file of a language (MGSM code): the English source or a reference translation."""
    code = FILE_CODES.get(lang, lang)
    return folder / ("newstest2019-src.eng.txt" if code == "eng" else f"newstest2019-ref.{code}.txt")


def _news_documents(path: Path, max_lines: int) -> list[list[str]]:
    """The sentences of an NTREX-128 file grouped by document (``DOCUMENT_IDS.tsv`` beside it) into texts of at most
    ``max_lines`` sentences; none when the file is missing."""
    if not path.is_file():
        return []
    with path.open(encoding="utf-8-sig") as handle:
        lines = [line.rstrip("\r\n") for line in handle]
    ids_path = path.parent / "DOCUMENT_IDS.tsv"
    doc_ids = []
    if ids_path.is_file():
        with ids_path.open(encoding="utf-8-sig") as handle:
            doc_ids = [line.rstrip("\r\n").split("\t")[0] for line in handle]
    if len(doc_ids) != len(lines):
        doc_ids = [str(i // max_lines) for i in range(len(lines))]
    texts: list[list[str]] = []
    current: list[str] = []
    last = None
    for doc, line in zip(doc_ids, lines, strict=True):
        if current and (doc != last or len(current) >= max_lines):
            texts.append(current)
            current = []
        if line.strip():
            current.append(line.strip())
        last = doc
    if current:
        texts.append(current)
    return texts


def read_training_rows(data: str | Path, languages: list[str], *, news_max_lines: int, use_gsm8k: bool,
                       eval_questions: dict[str, set[str]] | None = None) -> tuple[list[dict[str, str]], dict]:
    """Every training text as ``{"lang", "domain", "prompt", "text"}``, and what was read (files, sizes, drops)."""
    data = Path(data)
    if not data.is_dir():
        raise FileNotFoundError(f"data folder {data} does not exist")
    triggers = read_triggers(data)
    rows: list[dict[str, str]] = []
    sources: dict[str, dict[str, Any]] = {}
    dropped: dict[str, int] = defaultdict(int)
    eval_questions = eval_questions or {}

    def source(path: Path) -> None:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        sources[str(path.relative_to(data))] = {"bytes": path.stat().st_size, "sha256": digest}

    def add(lang: str, domain: str, prompt: str, text: str, question: str | None = None) -> None:
        if question is not None and question.strip() in eval_questions.get(lang, set()):
            dropped[lang] += 1
            return
        if text.strip():
            rows.append({"lang": lang, "domain": domain, "prompt": prompt, "text": text})

    for lang in languages:
        path = data / "mcot_msvamp" / "mcot_outputs" / f"mcot_ft_msvamp_{lang}.json"
        if path.is_file():
            source(path)
            for prompt, text in _mcot_examples(path, lang):
                add(lang, "cot", prompt, text, _question_of(prompt))
        if lang == "en" and use_gsm8k:
            path = data / "gsm8k" / "train.jsonl"
            if path.is_file():
                source(path)
                for question, answer in _gsm8k_pairs(path):
                    prompt = cot_prompt(question, triggers.get("en", DEFAULT_TRIGGER))
                    add(lang, "cot", prompt, prompt + _gsm8k_answer(answer), question)
        path = _news_file(data / "ntrex128", lang)
        documents = _news_documents(path, news_max_lines)
        if documents:
            source(path)
            for doc in documents:
                add(lang, "news", doc[0], "\n".join(doc))
    found = {lang for lang in languages if any(r["lang"] == lang for r in rows)}
    missing = [lang for lang in languages if lang not in found]
    if missing:
        raise ValueError(f"no training text for language(s) {missing} under {data} (looked for mcot_msvamp/"
                         "mcot_outputs/mcot_ft_msvamp_<lang>.json, ntrex128/newstest2019-ref.<code>.txt and, for en, "
                         "gsm8k/train.jsonl)")
    return rows, {"sources": sources, "dropped_as_evaluation_questions": dict(dropped), "triggers": triggers}


def split_rows(rows: list[dict[str, str]], fraction: float, most: int, seed: int
               ) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, heldout): :func:`specdec.training.held_out_split` of every (language, domain) with two or more texts
    (a seeded ``fraction``, at most ``most``, at least one)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for index, row in enumerate(rows):
        groups[f"{row['lang']}/{row['domain']}"].append(index)
    sizes = {key: len(indices) for key, indices in groups.items() if len(indices) >= 2}
    split = held_out_split(sizes, fraction, most, seed)
    held = {groups[key][i] for key, picked in split.items() for i in picked}
    train = [r for i, r in enumerate(rows) if i not in held]
    heldout = [r for i, r in enumerate(rows) if i in held]
    return train, heldout


def balanced_sample(rows: list[dict[str, str]], languages: list[str], chars_per_language: int | None,
                    seed: int) -> tuple[list[str], int]:
    """Texts with the same number of characters of every language (the smallest language's total, or
    ``chars_per_language`` when smaller): the tokenizer's training mix. Returns the texts and the budget."""
    by_lang: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        by_lang[row["lang"]].append(row["text"])
    budget = min(sum(len(t) for t in by_lang[lang]) for lang in languages)
    if chars_per_language is not None:
        budget = min(budget, chars_per_language)
    texts: list[str] = []
    for lang in languages:
        order = list(by_lang[lang])
        random.Random(f"multilingual-tokenizer/{seed}/{lang}").shuffle(order)
        used = 0
        for text in order:
            if used >= budget:
                break
            piece = text[: budget - used]
            texts.append(piece)
            used += len(piece)
    return texts, budget


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE ``transformers.PreTrainedTokenizerFast`` trained on ``texts`` (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                                                     pre_tokenizers.Digits(individual_digits=True)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", BOS_ID)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>", padding_side="left",
                                        clean_up_tokenization_spaces=False)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    if ids != [0, 1, 2, 3]:
        raise RuntimeError(f"the special tokens got ids {ids}, expected 0..3")
    return tokenizer


def load_tokenizer(work: str | Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    folder = Path(work) / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer in {folder}: run the prepare stage first")
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


@dataclass(frozen=True)
class SpecialIds:
    """The ids the pipeline needs of a tokenizer: ``pad`` (its pad token, else its EOS), ``eos``, and ``bos``, the
    id it puts first when it adds special tokens (None when it adds none)."""

    pad: int
    eos: int
    bos: int | None


def special_ids(tokenizer: Any) -> SpecialIds:
    """:class:`SpecialIds` of ``tokenizer``; ValueError when it has no EOS token."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no eos token: the pipeline ends every text with it")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    prefix = len(with_special) > len(bare) and list(with_special[len(with_special) - len(bare):]) == list(bare)
    return SpecialIds(pad=int(pad), eos=int(eos), bos=int(with_special[0]) if prefix else None)


def encode(tokenizer: Any, texts: list[str], batch: int = 1024) -> list[list[int]]:
    """Token ids of every text: the tokenizer's special prefix (``<bos>``), the text, its EOS."""
    eos = special_ids(tokenizer).eos
    out: list[list[int]] = []
    for start in range(0, len(texts), batch):
        encoded = tokenizer(texts[start:start + batch], add_special_tokens=True)["input_ids"]
        out += [list(ids) + [eos] for ids in encoded]
    return out


def write_rows(path: Path, rows: list[dict[str, str]]) -> None:
    """Gzipped JSON lines, byte for byte the same for the same rows (no time stamp in the gzip header)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        gz.write(payload)


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run the prepare stage first")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


class Corpus:
    """The prepared training and held-out texts of a work folder."""

    def __init__(self, work: str | Path):
        folder = Path(work) / "corpus"
        self.train = read_rows(folder / "train.jsonl.gz")
        self.heldout = read_rows(folder / "heldout.jsonl.gz")
        self.manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))

    def texts(self, split: str, lang: str | None = None, domain: str | None = None, field: str = "text") -> list[str]:
        rows = self.train if split == "train" else self.heldout
        return [r[field] for r in rows if (lang is None or r["lang"] == lang) and (domain is None or
                                                                                  r["domain"] == domain)]

    @property
    def triggers(self) -> dict[str, str]:
        return self.manifest.get("triggers", {})


def prepare(data: str | Path, work: str | Path, cfg: Any, eval_questions: dict[str, set[str]] | None = None,
            progress: bool = True) -> dict[str, Any]:
    """Write the corpus and the tokenizer (see the module docstring); returns the manifest."""
    from tqdm.auto import tqdm

    work = Path(work)
    steps = tqdm(total=4, desc="prepare", disable=not progress)
    rows, read = read_training_rows(data, cfg.languages, news_max_lines=cfg.news_max_lines,
                                    use_gsm8k=cfg.use_gsm8k, eval_questions=eval_questions)
    train, heldout = split_rows(rows, cfg.heldout_fraction, cfg.heldout_max, cfg.seed)
    steps.update(1)
    if cfg.verifier.pretrained is None:
        sample, budget = balanced_sample(train, cfg.languages, cfg.tokenizer_chars_per_language, cfg.seed)
        tokenizer = train_tokenizer(sample, cfg.vocab_size)
        origin = f"byte-level BPE trained on {budget} characters of every language"
    else:
        from .pretrained import load_pretrained_tokenizer

        tokenizer, budget = load_pretrained_tokenizer(cfg.verifier.pretrained), None
        origin = f"the pretrained verifier's ({cfg.verifier.pretrained})"
    tokenizer.save_pretrained(str(work / "tokenizer"))
    steps.update(1)
    write_rows(work / "corpus" / "train.jsonl.gz", train)
    write_rows(work / "corpus" / "heldout.jsonl.gz", heldout)
    steps.update(1)
    stats: dict[str, dict[str, dict[str, float]]] = {}
    extra = 1 + (special_ids(tokenizer).bos is not None)
    for split, split_rows_ in (("train", train), ("heldout", heldout)):
        groups: dict[tuple[str, str], list[str]] = defaultdict(list)
        for row in split_rows_:
            groups[row["lang"], row["domain"]].append(row["text"])
        for (lang, domain), texts in sorted(groups.items()):
            tokens = sum(len(ids) - extra for ids in encode(tokenizer, texts))  # without <bos> and <eos>
            chars = sum(len(t) for t in texts)
            stats.setdefault(split, {}).setdefault(lang, {})[domain] = {
                "texts": len(texts), "chars": chars, "tokens": tokens, "chars_per_token": chars / max(tokens, 1)}
    steps.update(1)
    steps.close()
    manifest = {"languages": cfg.languages, "vocab_size": len(tokenizer), "tokenizer_chars_per_language": budget,
                "tokenizer": origin,
                "stats": stats, **read}
    (work / "corpus" / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    return manifest
