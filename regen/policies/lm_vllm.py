"""`rollout.engine: vllm`: language-model sampling by vLLM, in the trainer's process (colocated) or
on each Ray rollout actor (`distributed.mode: ray`), imported only when asked for. CI has no vLLM:
its tests run this file against a stand-in with vLLM's interface (tests/stand_in_vllm/); the real
engine is exercised by bench/gpu_throughput.py on a GPU.

vLLM draws its own random numbers, so the rows are not the ones regen's own sampler would
draw from the step's uniforms: each request gets a seed taken from them instead (runs stay
reproducible for a fixed vLLM version). The log-probs that enter the loss are recomputed by
the trained model as always, so vLLM's numerics never reach the gradient; only which tokens
were sampled comes from vLLM. After every update the weights are loaded into vLLM's model in
place (LoRA: merged first). `rollout.vllm_memory` leaves room for training on the same GPU.
"""

from __future__ import annotations

import copy
import os

import torch

from regen.errors import UserError
from regen.policies.lm import LMRollout


class VLLMEngine:
    def __init__(self, cfg, policy):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # V1: its model in this process (MODEL_PATHS)
        try:
            import vllm
        except ImportError:
            raise UserError("rollout.engine=vllm: vLLM is not installed (pip install 'regen[vllm]' in a CUDA "
                            "environment), or use rollout.engine=hf") from None
        if not torch.cuda.is_available() and not _vllm_on_cpu():
            raise UserError("rollout.engine=vllm needs a CUDA GPU (or a CPU build of vLLM); use rollout.engine=hf "
                            "on CPU")
        source = cfg.model.path
        if source is None:
            raise UserError("rollout.engine=vllm needs model.path (a Hugging Face folder or hub id vLLM can load)")
        self.vllm, self.cfg, self.policy = vllm, cfg, policy
        self.pad_id, self.eos_id = policy.pad_id, policy.eos_id
        self.llm = vllm.LLM(model=source, dtype={"float32": "float32", "bfloat16": "bfloat16",
                                                 "float16": "float16"}[cfg.model.dtype],
                            gpu_memory_utilization=cfg.rollout.vllm_memory, seed=cfg.run.seed,
                            enable_prefix_caching=True,  # a group's n samples share their prompt
                            enable_sleep_mode=cfg.distributed.colocate,  # sleep() / wake_up() between phases
                            tensor_parallel_size=cfg.rollout.vllm_tensor_parallel)
        self.asleep = False
        self.load_weights(policy, 0)

    def sample(self, prompts: list[str], n: int, temperature: float, top_p: float, max_new_tokens: int,
               generator=None, greedy: bool = False, uniforms: torch.Tensor | None = None) -> LMRollout:
        seeds = [0] * len(prompts) if uniforms is None else \
            (uniforms[::n, 0].double() * 2**31).long().tolist()  # one seed per group from its uniforms
        stops = self.policy.stop_ids  # EOS, the end-of-turn token(s), rollout.stop_tokens
        params = [self.vllm.SamplingParams(n=n, temperature=0.0 if greedy else temperature, top_p=top_p,
                                           max_tokens=max_new_tokens, seed=s, stop_token_ids=stops) for s in seeds]
        if not self.policy.add_special_tokens:  # chat-rendered prompts: token ids, so no second BOS is added
            tok = self.policy.tokenizer
            prompts = [{"prompt_token_ids": tok(p, add_special_tokens=False)["input_ids"]} for p in prompts]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        prompt_ids = [list(o.prompt_token_ids) for o in outs for _ in range(n)]
        responses = [list(c.token_ids) for o in outs for c in o.outputs]
        return build_rollout(prompt_ids, responses, [c.text for o in outs for c in o.outputs], self.pad_id,
                             stops, self.policy.device)

    def sleep(self) -> None:
        """distributed.colocate, for the update: vLLM's sleep level 1 drops the KV cache and moves
        the weights to CPU memory (level 2 would drop them, but a step whose sync is skipped must
        still find them), so the update gets the GPU memory `rollout.vllm_memory` reserved."""
        self.llm.sleep(level=1)
        self.asleep = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def load_weights(self, policy, step: int) -> dict[str, float]:
        """Copy the trained weights into vLLM's model (the in-process path TRL's colocate mode uses)."""
        model = copy.deepcopy(policy.model).merge_and_unload() if policy.is_lora else policy.model
        push_weights(self.llm, model.state_dict().items())
        self.llm.reset_prefix_cache()  # cached prompt states were computed with the old weights
        return {}

    def load_tensors(self, state: dict) -> None:
        """Some of the model's tensors, by their Hugging Face names (a sync bucket on a rollout
        actor): vLLM's loader maps them onto its fused layers, so a bucket need not hold a whole
        layer. The caller resets the prefix cache once the last bucket is in."""
        push_weights(self.llm, state.items())


def _vllm_on_cpu() -> bool:
    """vLLM built for the CPU (its platform says so); a CUDA build without a GPU is refused before it starts."""
    import importlib

    try:
        return bool(importlib.import_module("vllm.platforms").current_platform.is_cpu())
    except (ImportError, AttributeError):
        return False


# Where vLLM keeps its model in this process, by engine generation (vLLM moves it between
# releases): V0, V0's worker wrapper, and V1 with its engine core in-process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0, which VLLMEngine sets unless the environment already does).
MODEL_PATHS = ("llm_engine.model_executor.driver_worker.model_runner.model",
               "llm_engine.model_executor.driver_worker.worker.model_runner.model",
               "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model")


def push_weights(llm, weights) -> str:
    """Load (name, tensor) pairs into vLLM's model through its own `load_weights` (which maps
    Hugging Face names onto its fused layers); returns how it got there. Where no known path holds
    the model (a vLLM that runs its workers in other processes) the tensors go to every worker
    through `LLM.collective_rpc`, which pickles them: slower, but still correct."""
    for path in MODEL_PATHS:
        target = llm
        for part in path.split("."):
            target = getattr(target, part, None)
            if target is None:
                break
        if target is not None:
            target.load_weights(weights)
            return path
    if hasattr(llm, "collective_rpc"):
        llm.collective_rpc(_load_in_worker, args=(list(weights),))
        return "collective_rpc"
    raise UserError("rollout.engine=vllm: this vLLM version exposes neither its model in-process ("
                    + ", ".join(MODEL_PATHS) + ") nor LLM.collective_rpc; pin a vLLM that does, or use the hf engine")


def _load_in_worker(worker, weights) -> None:
    worker.model_runner.model.load_weights(weights)


def build_rollout(prompt_ids: list[list[int]], responses: list[list[int]], texts: list[str], pad_id: int,
                  eos_ids: int | list[int], device) -> LMRollout:
    """An LMRollout from token lists: prompts left-padded, responses right-padded, the mask
    covering each response up to and including its first EOS (or other stop token)."""
    stops = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
    P = max(len(p) for p in prompt_ids)
    T = max(1, max(len(r) for r in responses))
    B = len(responses)
    ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    att = torch.zeros(B, P + T, dtype=torch.long)
    resp_mask = torch.zeros(B, T)
    finished = torch.zeros(B, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, responses, strict=True)):
        ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        att[i, P - len(p) : P] = 1
        first = next((j for j, t in enumerate(r) if t in stops), None)
        if first is not None:
            r, finished[i] = r[: first + 1], True
        if r:
            ids[i, P : P + len(r)] = torch.tensor(r, dtype=torch.long)
            att[i, P : P + len(r)] = 1
            resp_mask[i, : len(r)] = 1.0
    return LMRollout(ids.to(device), att.to(device), resp_mask.to(device), finished.to(device), P, texts)
