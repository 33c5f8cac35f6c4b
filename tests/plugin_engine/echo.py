"""The echo engine: every step, each running sequence makes the next token of
its own prompt (special tokens left out); past the prompt, the end of sequence.
A job's text is thus its prompt, cut at ``max_new_tokens``.

No model: the built-in tiny model's tokenizer admits and detokenizes the jobs.
"""

from __future__ import annotations

from tokenfleet.shared.settings import Settings
from tokenfleet.workers import budget
from tokenfleet.workers.engine import BatchShape, Engine
from tokenfleet.workers.engines import BuiltEngine
from tokenfleet.workers.null_runner import null_tokenizer
from tokenfleet.workers.sequence import Sequence

MAX_MODEL_LEN = 4096


class EchoEngine(Engine):
    def __init__(self, eos_token_id: int, special_ids: set[int]) -> None:
        super().__init__({eos_token_id}, MAX_MODEL_LEN)
        self.eos_token_id = eos_token_id
        self.special_ids = special_ids
        self.echoes: dict[str, tuple[Sequence, list[int]]] = {}  # job id -> (seq, its tokens)
        self.admitted = False  # sequences added since the last step

    @property
    def num_running(self) -> int:
        return len(self.echoes)

    def _add(self, seq: Sequence) -> None:
        tokens = [t for t in seq.prompt_ids if t not in self.special_ids]
        self.echoes[seq.job_id] = (seq, tokens)
        self.admitted = True

    def _run(self) -> list[tuple[Sequence, int]]:
        made = []
        for seq, tokens in self.echoes.values():
            at = len(seq.generated)  # a resumed job goes on after its tokens
            made.append((seq, tokens[at] if at < len(tokens) else self.eos_token_id))
        self.last_batch, self.admitted = BatchShape(len(made), self.admitted), False
        return made

    def _release(self, seq: Sequence) -> None:
        del self.echoes[seq.job_id]


def build_echo(settings: Settings) -> BuiltEngine:
    """The factory the ``echo`` entry point names."""
    tokenizer = null_tokenizer()
    settings = budget.apply(settings, budget.resolve(settings, None, MAX_MODEL_LEN))
    engine = EchoEngine(int(tokenizer.eos_token_id), set(tokenizer.all_special_ids))
    return BuiltEngine(engine, tokenizer, settings)
