"""Model loading: any Hugging Face causal LM directory, or one of the built-in names.

Everything goes through ``from_pretrained``, the built-in models included, so
the tests exercise the same loading code a user's model takes. A model name is
a built-in name, a directory, or ``hf:<org>/<name>``: only that last form
touches the Hugging Face Hub (``fetch``, once, before a worker starts), so a
mistyped name is refused at once instead of spending minutes on the network.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tokenfleet.shared import synthetic, tiny

BUILTIN = ("tiny", *synthetic.SHAPES)
HUB_PREFIX = "hf:"  # the user's opt-in to the Hugging Face Hub: hf:<org>/<name>
# What from_pretrained needs of a directory, as (what, any of these file patterns).
NEEDED = (("config.json", ("config.json",)),
          ("tokenizer files (tokenizer.json, tokenizer.model or vocab.json)",
           ("tokenizer.json", "tokenizer.model", "vocab.json", "*.tiktoken")),
          ("weights (*.safetensors or pytorch_model*.bin)",
           ("*.safetensors", "pytorch_model*.bin")))
# What fetch downloads of a Hub model: config, tokenizer and safetensors weights.
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken"]


class ModelError(ValueError):
    """A model name that names nothing loadable here: a restart cannot fix it."""


def missing(path: Path) -> list[str]:
    """What a model directory lacks of what loading it needs; empty if nothing."""
    return [what for what, patterns in NEEDED
            if not any(next(path.glob(p), None) for p in patterns)]


def check(name: str) -> None:
    """Raise ``ModelError`` in one sentence unless ``name`` is a built-in model,
    a usable model directory or a ``hf:`` Hub id (``fetch`` gets those)."""
    if name in BUILTIN:
        return
    if name.startswith(HUB_PREFIX):
        repo = name.removeprefix(HUB_PREFIX)
        if repo.count("/") > 1 or not repo.strip("/"):
            raise ModelError(f"model {name!r}: give a Hub id as hf:<org>/<name>, e.g. "
                             "hf:Qwen/Qwen2.5-0.5B-Instruct")
        return
    path = Path(name).expanduser()
    if not path.exists() and name.startswith(("/", ".", "~")):
        raise ModelError(f"model {name!r}: no such directory; give a built-in model "
                         f"({', '.join(BUILTIN)}) or the directory of a Hugging Face model")
    if not path.exists():
        raise ModelError(f"model {name!r} is neither a built-in model ({', '.join(BUILTIN)}) nor "
                         f"a directory; a Hugging Face Hub id is given as hf:{name}")
    if not path.is_dir():
        raise ModelError(f"model {name!r} is a file; give a model directory")
    lacking = missing(path)
    if lacking:
        raise ModelError(f"model directory {name!r} lacks {', '.join(lacking)}: it is not a "
                         "Hugging Face model directory")


def fetch(name: str) -> str:
    """The local directory of a ``hf:`` model, downloaded now if it is not in the
    Hugging Face cache (HF_HUB_OFFLINE=1: the cache only); ``ModelError`` in one
    sentence if the Hub cannot give it."""
    from huggingface_hub import snapshot_download

    repo = name.removeprefix(HUB_PREFIX)
    try:
        path = Path(snapshot_download(repo, allow_patterns=HUB_FILES))
    except Exception as exc:  # network, auth, no such repo: each its own class
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"model {name!r}: the Hugging Face Hub did not give {repo} "
                         f"({type(exc).__name__}: {reason}); download it where the Hub is "
                         f"reachable (hf download {repo} --local-dir DIR) and give DIR") from None
    lacking = missing(path)
    if lacking:
        raise ModelError(f"model {name!r} on the Hub lacks {', '.join(lacking)}")
    return str(path)


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tokenfleet"


def resolve(name: str) -> str:
    """The directory that ``from_pretrained`` gets for a model name (a ``hf:``
    model from the Hugging Face cache, where ``fetch`` put it)."""
    if name.startswith(HUB_PREFIX):
        from huggingface_hub import snapshot_download

        repo = name.removeprefix(HUB_PREFIX)
        return str(snapshot_download(repo, allow_patterns=HUB_FILES, local_files_only=True))
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

    return AutoTokenizer.from_pretrained(resolve(name), local_files_only=True)


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
    tokenizer = load_tokenizer(name)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype, device), local_files_only=True
    )
    model.to(device).eval()
    return model, tokenizer
