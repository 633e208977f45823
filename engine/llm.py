"""Offline batch API in the manner of vLLM's `LLM`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from fleetllm.engine.config import EngineConfig, SpeculativeConfig
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.lora_adapter import LoRAAdapter
from fleetllm.engine.request import RequestOutput
from fleetllm.engine.sampling_params import RequestOutputKind, SamplingParams
from fleetllm.engine.scheduling_policy import DEFAULT_POLICY as DEFAULT_SCHEDULING_POLICY
from fleetllm.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Message = dict[str, Any]


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for `LLM.generate`, by vLLM's names: a name, an id, and its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """Split an n>1 request into n single ones; seeded children get seed+i, as vLLM does."""
    if params.n == 1:
        return [params]
    return [
        dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_fraction: float = 0.25,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int | None = None,
        scheduling_policy: str = DEFAULT_SCHEDULING_POLICY,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        device: str = "cpu",
        num_threads: int | None = None,
        adaptive_threads: bool = True,
        skip_tokenizer_init: bool = False,
        enforce_eager: bool = False,
        load_format: str = "auto",
        tensor_parallel_size: int = 1,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                max_model_len=max_model_len,
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                kv_cache_memory_fraction=kv_cache_memory_fraction,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                scheduling_policy=scheduling_policy,
                enable_prefix_caching=enable_prefix_caching,
                seed=seed,
                device=device,
                num_threads=num_threads,
                adaptive_threads=adaptive_threads,
                skip_tokenizer_init=skip_tokenizer_init,
                enforce_eager=enforce_eager,
                load_format=load_format,
                tensor_parallel_size=tensor_parallel_size,
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
                speculative_config=speculative_config,
                enable_lora=enable_lora,
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras,
            )
        )
        self._ids = itertools.count()
        self._loras: dict[LoRARequest, LoRAAdapter] = {}

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (they also stop when the LLM is collected
        or the interpreter exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("this LLM was created with skip_tokenizer_init=True")
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in the order of `prompts`.
        `lora_request`: the adapter of every prompt, or one per prompt (None: the base)."""
        prompt_list = _as_prompt_list(prompts)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [self._lora(lora_request)] * len(prompt_list)
        else:
            loras = [self._lora(r) for r in lora_request]
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompt_list)} prompts")
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts"
                )
        parents: list[list[str]] = []
        try:
            for prompt, params, lora in zip(prompt_list, params_list, loras, strict=True):
                ids = []
                # Only the end result is wanted: no output is built before it.
                final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                for child in child_params(final_only):
                    request_id = str(next(self._ids))
                    self.engine.add_request(request_id, prompt, child, lora=lora)
                    ids.append(request_id)
                parents.append(ids)
            done = self._run(sum(len(ids) for ids in parents), use_tqdm)
        except BaseException:
            for ids in parents:
                for request_id in ids:
                    self.engine.abort_request(request_id)
            raise
        return [_merge([done[i] for i in ids]) for ids in parents]

    def _lora(self, request: LoRARequest | None) -> LoRAAdapter | None:
        """The adapter's weights, read once per request object."""
        if request is None:
            return None
        if request not in self._loras:
            self._loras[request] = self.engine.load_lora(request.lora_name, request.lora_path)
        return self._loras[request]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        # The template writes its own special tokens: tokenized without adding a second BOS.
        prompts: list[Prompt] = [
            tokenizer.encode(
                tokenizer.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt),
                add_special_tokens=False,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return done


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if isinstance(prompts, Sequence):
        return list(prompts)  # type: ignore[arg-type]
    raise ValueError("prompts must be a string, a list of token ids, or a list of those")


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    first = outputs[0]
    completions = []
    for index, out in enumerate(outputs):
        completion = out.outputs[0]
        completion.index = index
        completions.append(completion)
    return dataclasses.replace(first, outputs=completions)
