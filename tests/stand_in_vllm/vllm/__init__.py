"""A stand-in for vLLM with the part of its interface regen uses (`LLM`, `SamplingParams`, the
model's `load_weights` where vLLM V1 keeps it in-process, sleep / wake_up, reset_prefix_cache,
`platforms.current_platform`), backed by the transformers model on the CPU. CI has no vLLM (it
needs CUDA), so the tests put this folder first on the path to run regen/policies/lm_vllm.py for
real: sampling through it, weights pushed into it after each update, sleep and wake around the
update. It samples with its own seeded generator, as vLLM does, not with regen's uniforms.

With STAND_IN_VLLM_LOG set to a folder, each engine appends what it was asked to do to
`<pid>.log` there and writes its weights to `<pid>.pt` after each load, for the tests to read.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch

from vllm import platforms  # noqa: F401  (vllm.platforms, as in vLLM)


class SamplingParams:
    def __init__(self, n: int = 1, temperature: float = 1.0, top_p: float = 1.0, max_tokens: int = 16,
                 seed: int | None = None, stop_token_ids: list[int] | None = None, **_):
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.seed, self.stop_token_ids = seed, list(stop_token_ids or [])


class _Model:
    """vLLM's model: load_weights takes (Hugging Face name, tensor) pairs; an unknown name is an error."""

    def __init__(self, llm):
        self.llm = llm

    def load_weights(self, weights) -> set[str]:
        own = self.llm.hf.state_dict()
        names = set()
        with torch.no_grad():
            for name, tensor in weights:
                own[name].copy_(tensor)  # KeyError for a name the model does not have, as vLLM's loader
                names.add(name)
        self.llm.record(f"load {len(names)}")
        if self.llm.log:
            torch.save({k: v.clone() for k, v in own.items()}, self.llm.log / f"{os.getpid()}.pt")
        return names


class LLM:
    def __init__(self, model: str, dtype: str = "auto", gpu_memory_utilization: float = 0.9, seed: int = 0,
                 enable_prefix_caching: bool = False, enable_sleep_mode: bool = False, tensor_parallel_size: int = 1,
                 **_):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.log = Path(os.environ["STAND_IN_VLLM_LOG"]) if os.environ.get("STAND_IN_VLLM_LOG") else None
        self.hf = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tok = AutoTokenizer.from_pretrained(model)
        self.sleep_mode, self.asleep = enable_sleep_mode, False
        runner = SimpleNamespace(model_runner=SimpleNamespace(model=_Model(self)))
        core = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=runner)))
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))
        self.record(f"init tp={tensor_parallel_size} sleep_mode={enable_sleep_mode}")

    def record(self, line: str) -> None:
        if self.log:
            with open(self.log / f"{os.getpid()}.log", "a") as f:
                f.write(line + "\n")

    @torch.no_grad()
    def generate(self, prompts: list, params: list, use_tqdm: bool = True) -> list:
        if self.asleep:
            raise RuntimeError("generate while asleep")
        self.record(f"generate {len(prompts)}")
        out = []
        for prompt, p in zip(prompts, params, strict=True):
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else self.tok(prompt)["input_ids"]
            gen = torch.Generator().manual_seed(p.seed or 0)
            stops = {self.tok.eos_token_id, *p.stop_token_ids}
            completions = []
            for _ in range(p.n):
                seq, new = torch.tensor([ids]), []
                for _ in range(p.max_tokens):
                    logits = self.hf(seq).logits[0, -1].float()
                    if p.temperature == 0:
                        tok = int(logits.argmax())
                    else:
                        probs = torch.softmax(logits / p.temperature, -1)
                        tok = int(torch.multinomial(probs, 1, generator=gen))
                    new.append(tok)
                    seq = torch.cat([seq, torch.tensor([[tok]])], 1)
                    if tok in stops:
                        break
                completions.append(SimpleNamespace(token_ids=new, text=self.tok.decode(new, skip_special_tokens=True)))
            out.append(SimpleNamespace(prompt_token_ids=list(ids), outputs=completions))
        return out

    def sleep(self, level: int = 1) -> None:
        assert self.sleep_mode, "sleep() needs enable_sleep_mode=True"
        self.asleep = True
        self.record(f"sleep {level}")

    def wake_up(self) -> None:
        self.asleep = False
        self.record("wake")

    def reset_prefix_cache(self) -> None:
        self.record("reset")
