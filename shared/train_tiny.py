"""Train the fleet's built-in ``tiny`` model from text that ships with Python itself.

Nothing may be downloaded at run time, so the project trains its own small Llama-style
causal LM on the standard library's documentation (``pydoc_data.topics``) and the
docstrings of a fixed list of stdlib modules, all under the PSF licence. The result is
small enough to commit (weights <= 8 MB) and reads as English-like prose.

Usage::

    python -m shared.train_tiny --out shared/tiny_model

Everything is seeded and the data order is fixed, so a rerun on the same Python, torch
and transformers versions reproduces the run; docstrings differ between Python versions,
which is why the Python version is recorded next to the corpus size in ``TRAINING.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import math
import platform
import random
import re
import sys
import time
import warnings
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"

# A fixed, sorted list (not ``sys.stdlib_module_names``) so the corpus does not shift when a
# Python release adds modules; ones that fail to import (removed, platform-specific) are skipped.
# Modules with import-time side effects (this, antigravity, tkinter, turtle) are left out.
MODULES: tuple[str, ...] = tuple(sorted("""
    abc argparse array ast asyncio base64 bdb binascii bisect builtins bz2 calendar cmath cmd code
    codecs codeop collections colorsys compileall concurrent.futures configparser contextlib
    contextvars copy copyreg csv dataclasses datetime decimal difflib dis doctest email
    email.message email.utils enum filecmp fileinput fnmatch fractions ftplib functools gc getopt
    gettext glob graphlib gzip hashlib heapq hmac html html.parser http http.client http.cookies
    http.server imaplib importlib importlib.metadata inspect io ipaddress itertools json keyword
    linecache locale logging logging.handlers lzma mailbox math mimetypes multiprocessing netrc
    numbers operator optparse os pathlib pdb pickle pkgutil platform plistlib poplib pprint
    py_compile pydoc queue quopri random re reprlib runpy sched secrets selectors shelve shlex
    shutil signal smtplib socket socketserver sqlite3 ssl stat statistics string struct
    subprocess symtable sys sysconfig tarfile tempfile textwrap threading time timeit token
    tokenize trace traceback tracemalloc types typing unittest unittest.mock urllib.parse
    urllib.request uuid warnings wave weakref wsgiref.handlers xml.dom.minidom
    xml.etree.ElementTree xmlrpc.client zipfile zipimport zlib zoneinfo
""".split()))

# Characters that make up ordinary prose; a paragraph must be almost all of these to be kept.
PROSE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()-")
# Typographic punctuation in the docs, mapped to ASCII so the byte-level vocab is not spent on it.
ASCII_PUNCT = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"',
                             "\u2013": "-", "\u2014": "-", "\u2026": "..."})


def prose_paragraphs(text: str) -> list[str]:
    """Split reST-ish doc text into paragraphs and keep the ones that read as English prose."""
    kept: list[str] = []
    for para in re.split(r"\n\s*\n", text.translate(ASCII_PUNCT)):
        lines = [ln for ln in para.splitlines() if not ln.lstrip().startswith((">>>", "..."))]
        flat = " ".join(" ".join(lines).split())
        flat = re.sub(r"\*\*?([^*\s][^*]*)\*\*?", r"\1", flat)  # *emphasis* / **strong**
        # Short fragments are headings, signatures or table cells, not sentences.
        if len(flat.split()) < 8 or not flat[0].isupper():
            continue
        if sum(ch in PROSE_CHARS for ch in flat) / len(flat) < 0.95:
            continue  # mostly code, grammar rules or symbols
        kept.append(flat)
    return kept


def stdlib_docstrings() -> list[str]:
    """Docstrings of MODULES, their public functions/classes and class methods, deduplicated."""
    seen: set[str] = set()
    docs: list[str] = []

    def add(doc: object) -> None:
        if isinstance(doc, str) and doc not in seen:
            seen.add(doc)
            docs.append(inspect.cleandoc(doc))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules warn on import; we only read docs
        for name in MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - any import failure just means "not on this host"
                continue
            add(module.__doc__)
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                    continue
                add(obj.__doc__)
                if inspect.isclass(obj):
                    for meth, member in sorted(vars(obj).items()):
                        if not meth.startswith("_") or meth == "__init__":
                            add(getattr(member, "__doc__", None))
    return docs


def gather_corpus() -> list[str]:
    """One document per doc topic / docstring, paragraphs joined by newlines."""
    from pydoc_data.topics import topics

    sources = [topics[key] for key in sorted(topics)] + stdlib_docstrings()
    return [doc for doc in ("\n".join(prose_paragraphs(src)) for src in sources) if doc]


def build_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte is in the vocab, so any text round-trips) with a bos prefix."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=1024, clean_up_tokenization_spaces=False,
    )


def encode_stream(tok: PreTrainedTokenizerFast, corpus: list[str]) -> torch.Tensor:
    """All documents as one id stream, each as ``bos text eos`` so the model learns boundaries."""
    ids: list[int] = []
    # The backend encodes without the wrapper's "longer than model_max_length" warning;
    # its post-processor already puts bos in front of each document.
    for enc in tok.backend_tokenizer.encode_batch(corpus):
        ids.extend(enc.ids)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def make_model(tok: PreTrainedTokenizerFast, args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, max_position_embeddings=1024, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32",  # serving dtype; weights saved as fp16
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < args.warmup:
        return float(args.lr * (step + 1) / args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return float(args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))))


@torch.no_grad()
def eval_loss(model: LlamaForCausalLM, data: torch.Tensor, seq_len: int) -> float:
    model.eval()
    n = len(data) // seq_len
    x = data[: n * seq_len].view(n, seq_len)
    total = 0.0
    for i in range(0, n, 16):
        # labels == input_ids: the model shifts them by one internally.
        total += model(input_ids=x[i : i + 16], labels=x[i : i + 16]).loss.item() * len(x[i : i + 16])
    model.train()
    return total / n


def train(args: argparse.Namespace) -> None:
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    corpus = gather_corpus()
    n_chars = sum(len(doc) for doc in corpus)
    tok = build_tokenizer(corpus, args.vocab)
    stream = encode_stream(tok, corpus)
    split = int(len(stream) * 0.98)  # last 2% held out to see whether the model generalises
    train_ids, val_ids = stream[:split], stream[split:]
    print(f"corpus: {len(corpus)} docs, {n_chars} chars, {len(stream)} tokens "
          f"(vocab {len(tok)}), python {platform.python_version()}", flush=True)

    model = make_model(tok, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} params", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    # Batches are random windows of the stream drawn from a seeded generator: a fixed order.
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len)
    loss_ema = float("nan")
    step = 0
    for step in range(args.steps):
        if time.perf_counter() - start > args.time_budget:
            print(f"time budget hit at step {step}; stopping early", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(train_ids) - args.seq_len, (args.batch,), generator=gen)
        window = train_ids[starts[:, None] + offsets]
        # bf16 autocast roughly doubles CPU throughput where the CPU has bf16 instructions.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(input_ids=window, labels=window).loss  # shifted inside the model
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if step == 0 else 0.95 * loss_ema + 0.05 * loss.item()
        if step % 50 == 0:
            extra = f"  val {eval_loss(model, val_ids, args.seq_len):.3f}" if step % 200 == 0 else ""
            print(f"step {step:5d}  loss {loss.item():.3f}  ema {loss_ema:.3f}{extra}  "
                  f"{time.perf_counter() - start:.0f}s", flush=True)
    steps_done = step + 1
    val = eval_loss(model, val_ids, args.seq_len)
    wall = time.perf_counter() - start
    bpc = val * len(val_ids) / len(tok.decode(val_ids.tolist())) / math.log(2)
    print(f"final train loss (ema) {loss_ema:.3f}  val loss {val:.3f} ({bpc:.3f} bits/char)  "
          f"wall {wall:.0f}s", flush=True)

    save(model, tok, args, n_params=n_params, n_chars=n_chars, n_docs=len(corpus),
         n_tokens=len(stream), steps=steps_done, loss=loss_ema, val=val, wall=wall)


def save(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, args: argparse.Namespace,
         **stats: float) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=False, max_new_tokens=64,
    )
    # Stored at half precision to stay small; config.dtype says float32, which is what loads.
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    size = (out / "model.safetensors").stat().st_size
    (out / "TRAINING.md").write_text(f"""# tiny model

Trained by `python -m shared.train_tiny --out {args.out}` (see that file for the recipe).

- corpus: Python standard library documentation (`pydoc_data.topics`) and docstrings of
  {len(MODULES)} stdlib modules, prose paragraphs only; PSF License Agreement (Python {platform.python_version()})
- corpus size: {stats['n_docs']:.0f} documents, {stats['n_chars']:.0f} characters, {stats['n_tokens']:.0f} tokens
- tokenizer: byte-level BPE, {len(tok)} tokens (`{PAD}`, `{BOS}`, `{EOS}`)
- model: Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, intermediate {args.intermediate},
  {stats['n_params']:.0f} parameters (tied embeddings), stored as float16, {size} bytes
- training: {stats['steps']:.0f} steps of {args.batch} x {args.seq_len} tokens, AdamW lr {args.lr}, seed {args.seed}
- final loss: {stats['loss']:.4f} (train, EMA), {stats['val']:.4f} (held-out 2%)
- wall time: {stats['wall']:.0f} s on {args.threads} CPU threads
- versions: python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}

model.safetensors sha256: {sha}
""")
    print(f"saved to {out} ({size} bytes)\nmodel.safetensors sha256: {sha}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", default="shared/tiny_model")
    p.add_argument("--steps", type=int, default=1200, help="fixed step count (reproducible)")
    p.add_argument("--time-budget", type=float, default=14 * 60.0,
                   help="seconds; a safety net that stops early on slow hosts (not reproducible)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the forward pass (weights and optimizer stay fp32)")
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args(sys.argv[1:]))
