"""Model loading: any Hugging Face causal LM directory, or one of the built-in names.

Everything goes through ``from_pretrained``, the built-in models included, so
the tests exercise the same loading code a user's model takes. Nothing is
downloaded unless the name is a hub id and the environment allows it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tokenfleet.shared import synthetic, tiny

BUILTIN = ("tiny", *synthetic.SHAPES)


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tokenfleet"


def resolve(name: str) -> str:
    """The directory (or hub id) that ``from_pretrained`` gets for a model name."""
    if name == "tiny":
        if not (tiny.SHIPPED / "config.json").exists():
            return resolve("tiny-random")  # a checkout without the trained weights
        return str(tiny.SHIPPED)
    if name in synthetic.SHAPES:
        path = cache_dir() / name
        if not (path / "model.safetensors").exists():
            tmp = path.with_name(f"{name}.tmp{os.getpid()}")
            synthetic.write(name, tmp)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)  # atomic: concurrent workers never see half a model
        return str(path)
    return name


def local_tokenizer_file(name: str) -> Path | None:
    """The ``tokenizer.json`` of a model already on this machine (never downloads
    or builds one), so a client can count a prompt's tokens; None elsewhere."""
    if name == "tiny":
        path = tiny.SHIPPED / "tokenizer.json"
    elif name in synthetic.SHAPES:
        path = cache_dir() / name / "tokenizer.json"
    else:
        path = Path(name).expanduser() / "tokenizer.json"
    return path if path.is_file() else None


def export(name: str, out: Path) -> Path:
    """Write a built-in model as a standard Hugging Face directory."""
    if name not in BUILTIN:
        raise ValueError(f"unknown built-in model {name!r}; built-in: {', '.join(BUILTIN)}")
    shutil.copytree(resolve(name), out, dirs_exist_ok=True)
    return out


def torch_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        # Half precision only where it is fast; the CPU computes in float32.
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def load_tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    path = resolve(name)
    offline = not Path(path).exists()  # a hub id: only if the user allows downloads
    return AutoTokenizer.from_pretrained(path, local_files_only=not offline)


def eos_token_ids(*sources: Any) -> set[int]:
    """Every end-of-sequence id the model's configs and tokenizer name."""
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def load(name: str, device: str = "cpu", dtype: str = "auto") -> tuple[Any, Any]:
    """Load (model, tokenizer) for serving: eval mode, on ``device``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a worker's log is not a terminal
    path = resolve(name)
    offline = not Path(path).exists()  # a hub id: only if the user allows downloads
    tokenizer = load_tokenizer(name)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype, device), local_files_only=not offline
    )
    model.to(device).eval()
    return model, tokenizer
