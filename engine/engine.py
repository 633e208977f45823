"""The engine's step API: add requests, step, abort, read stats.

One `step()` schedules a batch, runs it through the model, samples, detokenizes, applies stop
conditions and frees what finished. The HTTP server drives this loop from a thread; the
offline `LLM` drives it until every request is done.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fleetllm.engine import capacity, cpu_threads, kv_cache, prompt_logprobs
from fleetllm.engine.block_manager import KVCacheManager
from fleetllm.engine.config import (
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
    check_kv_pool,
    resolve_dtype,
)
from fleetllm.engine.engine_stats import EngineStats
from fleetllm.engine.executor import LocalExecutor, MultiprocExecutor, WorkerFailedError
from fleetllm.engine.grammar import GrammarCompiler
from fleetllm.engine.lora_adapter import LoRAAdapter, load_adapter
from fleetllm.engine.lora_slots import LoRASlots, adapter_names
from fleetllm.engine.model import LlamaForCausalLM
from fleetllm.engine.model_files import resolve_model
from fleetllm.engine.model_runner import ModelRunner, PromptRows, StepBuilder
from fleetllm.engine.parallel import check_tensor_parallel
from fleetllm.engine.quantization import check_quantization
from fleetllm.engine.request import Request, RequestOutput
from fleetllm.engine.sampler import SamplingRow, TokenCounts, sample
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.engine.scheduler import ScheduledRequest, Scheduler
from fleetllm.engine.spec_decode import NgramProposer, verify
from fleetllm.engine.stop_strings import StopStringMatcher
from fleetllm.engine.worker import WorkerSpec
from fleetllm.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)

# A synthetic request that checks the engine itself after a step in which every request
# failed: one greedy token of a one-token prompt (token id 0 is in every vocabulary).
_PROBE_ID = "\0engine-probe"  # never a caller's id: those are printable
_PROBE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class EngineFaultError(RuntimeError):
    """The engine cannot run requests any more (not the fault of any one request)."""


@dataclass
class _OutputText:
    """A request's text in the making: its detokenizer and, with stop strings, their matcher."""

    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        cfg = self.model_config
        self.dtype, why = resolve_dtype(config.dtype, cfg, self.device)
        dtype_name = str(self.dtype).removeprefix("torch.")
        extra = {"requested": config.dtype, "dtype": dtype_name, "reason": why}
        log.info("dtype chosen", extra=extra)
        self.max_model_len = cfg.context_limit(config.max_model_len)
        self.tokenizer: Tokenizer | None = None
        if not config.skip_tokenizer_init:
            self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.eos_token_ids = (
            self.tokenizer.stop_token_ids if self.tokenizer else frozenset(cfg.eos_token_ids)
        )
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, config.num_threads)
        tp = config.tensor_parallel_size
        check_tensor_parallel(cfg, tp)
        check_quantization(config.quantization, self.device)
        kv_cache.check_kv_cache_dtype(config.kv_cache_dtype, self.device)
        if config.num_kv_blocks is not None:
            # Before any worker starts.
            check_kv_pool(config.num_kv_blocks, config.block_size, self.max_model_len)
        worker_spec = WorkerSpec(
            model_dir=str(self.model_dir),
            dtype=self.dtype,
            device=config.device,
            max_positions=self.max_model_len,
            batch_hint=config.max_num_seqs,
            block_size=config.block_size,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            load_format=config.load_format,
            enforce_eager=config.enforce_eager,
            max_loras=config.max_loras if config.enable_lora else 0,
            max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
            # Ranks share the cores this process may use unless told otherwise.
            num_threads=cpu_threads.rank_threads(config.num_threads, tp),
            adaptive_threads=config.adaptive_threads,
        )
        self.executor = (
            LocalExecutor(worker_spec) if tp == 1 else MultiprocExecutor(worker_spec, tp)
        )
        try:
            num_blocks = config.num_kv_blocks or capacity.blocks_from_budget(
                self.executor.free_memory_per_rank(),
                config,
                cfg,
                self.max_model_len,
                self.dtype.itemsize,
            )
            check_kv_pool(num_blocks, config.block_size, self.max_model_len)
            self.kv_cache_bytes = self.executor.allocate_kv(num_blocks)  # per rank
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, config.publishes_kv_events
        )
        self.step_builder = StepBuilder(self.kv)
        spec = config.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # parsed by validate()
        proposer = NgramProposer(spec, self.max_model_len).propose if spec else None
        slots = config.max_loras if config.enable_lora else 0
        self.lora_slots = LoRASlots(slots, config.max_lora_rank)
        budget, policy = config.step_token_budget, config.scheduling_policy
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, budget, proposer, self.lora_slots, policy
        )
        # Sampling runs where the logits arrive: on the model's device in this process, on
        # the CPU when tensor-parallel ranks send them. Unseeded draws come from there; seeded
        # requests draw on the CPU (sampler.py).
        self.sample_device = self.device if tp == 1 else torch.device("cpu")
        self.generator = torch.Generator(device=self.sample_device).manual_seed(config.seed)
        # Called once a step is scheduled, before its forward pass: the KV-event publisher
        # sends evictions then, so no router routes on gone blocks for a whole forward pass.
        self.after_schedule: Callable[[], None] | None = None
        self.requests: dict[str, Request] = {}
        self._texts: dict[str, _OutputText] = {}
        self._prompt_tokens = 0
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted_tokens = 0
        self._generation_tokens = 0
        self._finished: Counter[str] = Counter()
        log.info(
            "engine ready",
            extra={
                "model": config.model,
                "dtype": str(self.dtype).removeprefix("torch."),
                "max_model_len": self.max_model_len,
                "num_kv_blocks": num_blocks,
                "block_size": config.block_size,
                "tensor_parallel_size": tp,
                "quantization": config.quantization,
                "kv_cache_dtype": config.kv_cache_dtype,
            },
        )

    @property
    def model(self) -> LlamaForCausalLM:
        """The model, where it runs in this process (tensor_parallel_size=1)."""
        if not isinstance(self.executor, LocalExecutor):
            raise AttributeError("the model runs in tensor-parallel worker processes")
        return self.executor.model

    @property
    def runner(self) -> ModelRunner:
        if not isinstance(self.executor, LocalExecutor) or self.executor.runner is None:
            raise AttributeError("the model runs in tensor-parallel worker processes")
        return self.executor.runner

    @property
    def weight_bytes(self) -> list[int]:
        """Bytes of model weights held by each tensor-parallel rank."""
        return self.executor.weight_bytes

    @property
    def lora_bytes(self) -> list[int]:
        """Bytes of the LoRA slots held by each tensor-parallel rank."""
        return self.executor.lora_bytes

    def check_health(self) -> None:
        """Raise if the engine can no longer run a step (a tensor-parallel rank died)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the worker processes, if any; the engine is unusable afterwards."""
        self.executor.shutdown()

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
    ) -> Request:
        """Queue a request. Every way in which a request can be invalid raises ValueError here,
        before it joins a batch; `cache_salt` keeps its prefix-cache blocks apart from those of
        requests with another salt (or none); `lora`: the adapter it runs with (`load_lora`)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("the engine takes n=1 requests; fan out n>1 into separate requests")
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.stop_token_ids or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if lora is not None:
            self.lora_slots.check(lora, self.model_config)
        text, token_ids = self._tokenize_prompt(prompt)
        req = Request(
            request_id, text, token_ids, params, self.eos_token_ids, arrival_time, cache_salt, lora
        )
        if params.structured_outputs is not None:
            req.grammar = self.grammars.grammar(params.structured_outputs)
        if self.tokenizer is not None:
            self._texts[request_id] = _OutputText(
                IncrementalDetokenizer(
                    self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens
                ),
                StopStringMatcher(params.stop, params.include_stop_str_in_output)  # type: ignore[arg-type]
                if params.stop
                else None,
            )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; unknown or finished ids are ignored. Returns
        its final output (in its output kind; text still held back for stop strings is not
        released)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._texts.pop(request_id, None)
        self.scheduler.abort(req)
        req.finish("abort")
        self._finished["abort"] += 1
        return req.take_output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read and check the PEFT adapter in folder `path` for this model. It touches no
        engine state: call it from any thread, off the step loop."""
        self.lora_slots.check()
        return load_adapter(name, path, self.model_config, self.lora_slots.max_rank)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine was started without a tokenizer: send token ids")
        return self.tokenizer.encode(prompt)

    def _tokenize_prompt(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, token_ids = prompt, self.encode(prompt)
        elif isinstance(prompt, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            text, token_ids = None, list(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids must be in [0, {self.model_config.vocab_size}), got {bad[0]}"
                )
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}: it must be shorter, leaving room for at least one "
                "generated token"
            )
        return text, token_ids

    # -- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration; returns an output for each request that gained tokens or finished
        in it, in the request's output kind (FINAL_ONLY requests only when they finish).

        An exception raised for one request fails that request alone (finish reason "error",
        its blocks freed) and the step goes on for the others. When every request of a step
        fails, a probe request tells whether the engine itself still works; if it does not,
        `EngineFaultError` is raised. Any exception that escapes is an engine fault: the
        engine's state can no longer be trusted.
        """
        out = self.scheduler.schedule()
        if self.after_schedule is not None:
            self.after_schedule()
        if not out.scheduled:
            return []
        num_scheduled = len(out.scheduled)
        failures: dict[str, Exception] = {}
        logits, sampled, prompt_rows = self._execute(out.scheduled, failures)
        if prompt_rows:
            logits = prompt_logprobs.record(logits, prompt_rows, failures)
        outputs: list[RequestOutput] = []
        finished: list[Request] = []
        for s, tokens, logprobs, error, exhausted in self._sample(logits, sampled):
            req = s.request
            kept = 0
            if req.request_id in failures:
                continue
            try:
                if error is not None:
                    raise error
                for token_id, lp in zip(tokens, logprobs, strict=True):
                    self._append_token(req, token_id, lp)
                    kept += 1
                    if req.finished:
                        break
                if exhausted and not req.finished:  # no token may follow
                    req.finish("stop")
                    req.release_text(self._held_text(req))
            except Exception as exc:
                failures[req.request_id] = exc
                continue
            if s.spec_token_ids:
                # The step keeps the KV of the last known token and of the drafts that were
                # accepted and emitted; the scheduler releases the rest.
                s.num_new_tokens = kept
            if req.finished:
                finished.append(req)
            output = req.take_output()
            if output is not None:
                outputs.append(output)
        if failures:
            out.scheduled = [s for s in out.scheduled if s.request.request_id not in failures]
        self.scheduler.on_step_computed(out)
        self.scheduler.remove_finished(finished)
        for req in finished:
            del self.requests[req.request_id]
            self._texts.pop(req.request_id, None)
            self._finished[req.finish_reason or "stop"] += 1
        for request_id, exc in failures.items():
            outputs.append(self._fail_request(self.requests[request_id], exc))
        if len(failures) == num_scheduled:
            self._check_engine(failures)
        return outputs

    def _execute(
        self, batch: list[ScheduledRequest], failures: dict[str, Exception]
    ) -> tuple[torch.Tensor, list[ScheduledRequest], PromptRows]:
        """Run the batch; if that raises, run its requests one at a time, so the request that
        causes the error fails alone (recorded in `failures`) and the others still advance.
        Rerunning is safe: a request's new KV entries are simply written again. A lost
        tensor-parallel rank is no request's fault: it escapes, failing the engine. The
        logits: the sampled rows, then the prompt rows."""
        fresh = self.kv.take_fresh_blocks()
        loads = self.lora_slots.pending_loads()
        try:
            step, sampled, prompt_rows = self.step_builder.build(batch, fresh, loads)
            logits = self.executor.execute(step)
            self.lora_slots.loaded(loads)
            return logits, sampled, prompt_rows
        except WorkerFailedError:
            raise
        except Exception as exc:
            if len(batch) == 1:
                failures[batch[0].request.request_id] = exc
                return torch.empty(0), [], PromptRows()
            log.warning(
                "a step failed; running its requests one at a time",
                extra={"requests": len(batch), "error": repr(exc)},
            )
        parts: list[torch.Tensor] = []
        prompt_parts: list[torch.Tensor] = []
        sampled, prompt_rows = [], PromptRows()
        for s in batch:
            try:
                # The blocks first used in this step are zeroed once, before any is written.
                step, rows, prompts = self.step_builder.build([s], fresh, loads)
                fresh = range(0)
                logits = self.executor.execute(step)
                self.lora_slots.loaded(loads)
            except WorkerFailedError:
                raise
            except Exception as exc:
                failures[s.request.request_id] = exc
                continue
            parts.append(logits[: len(logits) - len(prompts)])
            prompt_parts.append(logits[len(logits) - len(prompts) :])
            sampled += rows
            prompt_rows.extend(prompts)
        logits = torch.cat(parts + prompt_parts) if parts else torch.empty(0)
        return logits, sampled, prompt_rows

    def _sample(
        self, logits: torch.Tensor, sampled: list[ScheduledRequest]
    ) -> list[tuple[ScheduledRequest, list[int], list[Any], Exception | None, bool]]:
        """New tokens (and their logprobs) per sampled request: one from a plain row, or the
        verified drafts and one more from a request's draft rows; or the exception that
        sampling raised for that request alone. Last, whether its masks left no token after
        the ones returned."""
        plain: list[int] = []  # logits rows of requests without drafts
        drafted: list[tuple[ScheduledRequest, int]] = []  # (request, its first row)
        row = 0
        for s in sampled:
            if s.spec_token_ids:
                drafted.append((s, row))
            else:
                plain.append(row)
            row += 1 + len(s.spec_token_ids)
        results: dict[int, tuple[list[int], list[Any], Exception | None, bool]] = {}
        plain_requests = [s for s in sampled if not s.spec_token_ids]
        if plain_requests:
            plain_logits = logits if not drafted else logits[plain]
            rows = [self._sampling_row(s.request) for s in plain_requests]
            result = sample(plain_logits, rows, self.generator)
            for i, (s, token_id, lp) in enumerate(
                zip(plain_requests, result.token_ids, result.logprobs, strict=True)
            ):
                exhausted = i in result.exhausted
                tokens = [] if exhausted else [token_id]
                results[id(s)] = (tokens, [lp][: len(tokens)], result.errors.get(i), exhausted)
        for s, first in drafted:
            drafts = s.spec_token_ids
            try:
                verified = verify(
                    logits[first : first + 1 + len(drafts)],
                    self._sampling_row(s.request),
                    drafts,
                    self.generator,
                )
            except Exception as exc:
                results[id(s)] = ([], [], exc, False)
                continue
            self._spec_drafts += 1
            self._spec_draft_tokens += len(drafts)
            self._spec_accepted_tokens += verified.num_accepted
            results[id(s)] = (verified.token_ids, verified.logprobs, None, verified.exhausted)
        return [(s, *results[id(s)]) for s in sampled]

    def _sampling_row(self, req: Request) -> SamplingRow:
        return SamplingRow(
            req.params,
            req.prompt_token_ids,
            req.output_token_ids,
            req.stop_token_ids,
            req.generator,
            self._token_counts(req) if req.params.has_penalties else None,
            req.grammar,
        )

    def _fail_request(self, req: Request, exc: Exception) -> RequestOutput:
        log.error(
            "request failed in the engine",
            extra={"request_id": req.request_id},
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        del self.requests[req.request_id]
        self._texts.pop(req.request_id, None)
        self.scheduler.abort(req)  # frees its blocks
        req.finish("error")
        self._finished["error"] += 1
        out = req.take_output()
        assert out is not None  # a finished request always has one
        out.error = f"generation failed for this request: {type(exc).__name__}: {exc}"
        return out

    def _check_engine(self, failures: dict[str, Exception]) -> None:
        """Every request of the step failed: the requests' fault, or the engine's? Run one
        token of a known-good synthetic request through the model and the sampler. (Counting
        failed steps instead would let a client that found a failing request take the engine
        down by sending it a few times.)"""
        if not self.kv.allocate(_PROBE_ID, 1):
            return  # no free block to probe with; the next step tells
        probe = Request(_PROBE_ID, None, [0], _PROBE_PARAMS, frozenset())
        try:
            step, _, _ = self.step_builder.build(
                [ScheduledRequest(probe, 1, True)], self.kv.take_fresh_blocks()
            )
            logits = self.executor.execute(step)
            row = SamplingRow(_PROBE_PARAMS, probe.prompt_token_ids, [], frozenset(), None)
            errors = sample(logits, [row], self.generator).errors
            if errors:
                raise errors[0]
        except Exception as exc:
            last = next(reversed(failures.values()))
            raise EngineFaultError(
                f"every request of a step failed (the last: {type(last).__name__}: {last}), "
                f"and so did a probe request: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.kv.free(_PROBE_ID)

    def _token_counts(self, req: Request) -> TokenCounts:
        if req.token_counts is None:
            req.token_counts = TokenCounts(
                self.model_config.vocab_size,
                req.prompt_token_ids,
                req.output_token_ids,
                self.sample_device,
            )
        return req.token_counts

    def _append_token(self, req: Request, token_id: int, lp: object) -> None:
        """Add one generated token: its logprobs, its text, and whether it ends the request.
        Costs the same whatever the length of the output so far."""
        now = time.monotonic()
        req.append_token(token_id)
        if req.grammar is not None:
            req.grammar.accept(token_id)
        self._generation_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            self._prompt_tokens += req.num_prompt_tokens
        req.metrics.last_token_time = now
        if lp is not None and req.logprobs is not None:
            token_lp, entries = lp  # type: ignore[misc]
            req.logprobs.append(entries)
            req.cumulative_logprob += token_lp

        p = req.params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if token_id in req.eos_token_ids:
                req.finish("stop")
            elif token_id in req.user_stop_token_ids:
                req.finish("stop", token_id)
        # The token that stopped it is not part of its text, as in vLLM (unless asked for).
        hidden = req.finished and not p.include_stop_str_in_output
        if req.grammar is not None and req.grammar.finished and not req.finished:
            req.finish("stop")  # the constraint is complete: only the end may follow
        text = self._texts.get(req.request_id)
        released, matched = "", False
        if text is not None:
            released = "" if hidden else text.detokenizer.add(token_id)
            if text.stops is not None:
                check = n_out >= p.min_tokens and not req.finished
                released, stop = text.stops.add(released, check)
                if stop is not None:
                    req.finish("stop", stop)
                    matched = True
        if not req.finished and (
            (p.max_tokens is not None and n_out >= p.max_tokens)
            or req.num_tokens >= self.max_model_len
        ):
            req.finish("length")
        if req.finished and not matched:
            released += self._held_text(req)
        req.release_text(released)

    def _held_text(self, req: Request) -> str:
        """A finished request's text still held back for stop strings, and a trailing
        partial character (as a full decode renders it)."""
        text = self._texts.get(req.request_id)
        if text is None:
            return ""
        held = text.stops.flush() if text.stops is not None else ""
        return held + text.detokenizer.finish()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_kv_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            finished=dict(self._finished),
            spec_decode_num_drafts=self._spec_drafts,
            spec_decode_num_draft_tokens=self._spec_draft_tokens,
            spec_decode_num_accepted_tokens=self._spec_accepted_tokens,
            attention=dict(self.executor.attention),
            max_loras=self.lora_slots.max_loras,
            lora_running=adapter_names(self.scheduler.running),
            lora_waiting=adapter_names(self.scheduler.waiting),
        )
