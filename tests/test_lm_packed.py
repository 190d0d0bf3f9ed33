"""Packed groups (regen/policies/lm_packed.py): each group's prompt and its responses in one row,
one forward, the same log-probs and gradients as a plain padded forward of every row, for each
family it accepts; refused (the shared-prefix path runs) where it would not be exact."""

import dataclasses

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from regen.policies.lm import LMPolicy
from regen.policies.lm_packed import packable
from regen.tasks.arithmetic import build_tokenizer

PROMPTS = ["7+5=", "13+58=", "0+0=", "99+1="]  # different lengths: left padding inside the packed rows


def tiny(family: str, tok, **extra):
    common = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **common, **extra))
    cls, cfg = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "llama": (LlamaForCausalLM, LlamaConfig)}[family]
    return cls(cfg(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, **common, **extra))


def policy_of(model, tok) -> LMPolicy:
    model.config._attn_implementation = "sdpa"
    return LMPolicy(model.eval(), tok, torch.device("cpu"))


def logprobs_and_grads(p: LMPolicy, batch, group_size: int):
    p.model.zero_grad()
    logp, _ = p.token_logprobs(batch, 0.7, group_size=group_size)
    (logp * batch.response_mask * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
    return logp.detach(), [q.grad.clone() for q in p.model.parameters()]


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "llama"])
def test_packed_groups_give_the_plain_forwards_logprobs_and_gradients_in_one_call(family):
    tok = build_tokenizer()
    p = policy_of(tiny(family, tok), tok)
    batch = p.sample(PROMPTS, 3, 1.0, 1.0, 6, torch.Generator().manual_seed(4))
    lengths = batch.lengths.tolist()
    assert len(set(lengths)) > 1 and min(lengths) >= 1  # responses of different lengths
    assert packable(p.model, batch, 3)
    calls = []
    p.model.register_forward_pre_hook(lambda *_: calls.append(1))
    packed, packed_grads = logprobs_and_grads(p, batch, 3)
    assert len(calls) == 1  # the shared-prefix path makes two (prompts, then responses on their cache)
    plain, plain_grads = logprobs_and_grads(p, batch, 1)
    m = batch.response_mask.bool()
    assert plain[m].abs().min() > 0
    torch.testing.assert_close(packed[m], plain[m], atol=1e-5, rtol=1e-5)
    for a, b in zip(packed_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_single_token_responses_pack():
    tok = build_tokenizer()
    p = policy_of(tiny("gpt2", tok), tok)
    batch = p.sample(PROMPTS, 2, 1.0, 1.0, 1, torch.Generator().manual_seed(5))
    assert packable(p.model, batch, 2)
    torch.testing.assert_close(p.token_logprobs(batch, 1.0, group_size=2)[0], p.token_logprobs(batch, 1.0)[0],
                               atol=1e-5, rtol=1e-5)


def test_not_packed_where_it_would_not_be_exact():
    tok = build_tokenizer()
    p = policy_of(tiny("gpt2", tok), tok)
    batch = p.sample(PROMPTS, 2, 1.0, 1.0, 4, torch.Generator().manual_seed(6))
    assert packable(p.model, batch, 2)
    assert not packable(p.model, batch, 1)
    assert not packable(p.model, dataclasses.replace(batch, episodes=[{}] * len(batch)), 2)  # multi-turn holes
    p.model.config._attn_implementation = "eager"  # would add a boolean mask to the scores
    assert not packable(p.model, batch, 2)
    q = policy_of(tiny("qwen2", tok, use_sliding_window=True, sliding_window=4), tok)
    batch = q.sample(PROMPTS, 2, 1.0, 1.0, 4, torch.Generator().manual_seed(6))
    assert not packable(q.model, batch, 2)  # a window shorter than the packed row
    q.model.config.sliding_window = 64
    assert packable(q.model, batch, 2)


def test_long_responses_in_big_groups_are_not_packed():
    # every pair of a packed row is computed: with 16 responses of 40 tokens after a 6-token prompt
    # that is 5x the attention a causal pass needs, beyond what one call fewer saves at width 64
    tok = build_tokenizer()
    p = policy_of(tiny("gpt2", tok), tok)
    batch = p.sample(PROMPTS[:1], 16, 1.0, 1.0, 40, torch.Generator().manual_seed(7))
    long = dataclasses.replace(batch, attention_mask=torch.ones_like(batch.attention_mask))
    assert not packable(p.model, long, 16)
