"""The forwards an LM update does not pay for, and that skipping them changes nothing:

- the first (single) on-policy pass has no separate old-policy forward: its ratio is taken
  against its own detached log-probs, which are the old policy's (TRL does the same);
- with kl_coef 0 there is no reference model and no reference forward;
- the update's loss and gradient are then those computed with an explicit old-policy forward.
"""

import torch

from regen.config import RLConfig, load_config
from regen.data import load_prompts
from regen.modalities.lm import LMModality
from regen.runtime.dist import Dist


def modality(base_model, *extra: str) -> LMModality:
    cfg = load_config(RLConfig, None, [f"model.path={base_model}", "rollout.global_batch_size=16",
                                       "rollout.group_size=4", "train.global_minibatch_size=16",
                                       "rollout.max_new_tokens=6", *extra])
    return LMModality(cfg, torch.device("cpu"), Dist())


def rollout(m: LMModality):
    items = load_prompts("builtin:arithmetic:train", m.cfg.task, "data.train")[:4]
    return m.concat([m.sample(m.inputs(items), 4, m.plan(torch.Generator().manual_seed(0), 1))])


def forwards(model) -> list:
    calls: list = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_single_on_policy_pass_without_kl_runs_no_forward_before_the_update(base_model):
    m = modality(base_model, "algorithm.kl_coef=0.0")
    batch = rollout(m)
    assert m.policy.ref is None  # no reference model is loaded at all
    calls = forwards(m.policy.model)
    fixed = m.fixed_terms(batch)
    assert fixed == {"old_logp": None, "ref_logp": None} and calls == []


def test_kl_in_the_loss_pays_the_reference_forward_only(base_model):
    m = modality(base_model, "algorithm.kl_coef=0.04", "algorithm.kl_estimator=k3")
    batch = rollout(m)
    policy_calls, ref_calls = forwards(m.policy.model), forwards(m.policy.ref)
    fixed = m.fixed_terms(batch)
    assert fixed["old_logp"] is None and fixed["ref_logp"] is not None
    assert policy_calls == [] and len(ref_calls) >= 1


def test_a_second_epoch_needs_the_old_policy_forward(base_model):
    m = modality(base_model, "algorithm.kl_coef=0.0", "train.ppo_epochs=2")
    calls = forwards(m.policy.model)
    fixed = m.fixed_terms(rollout(m))
    assert fixed["old_logp"] is not None and len(calls) >= 1


def test_the_update_without_the_old_forward_has_the_loss_and_gradient_of_the_one_with_it(base_model):
    for name in ("grpo", "gspo"):
        m = modality(base_model, f"algorithm.name={name}", "algorithm.kl_coef=0.0")
        batch = rollout(m)
        rewards = torch.arange(16, dtype=torch.float32) % 3  # uneven within each group
        fixed = m.fixed_terms(batch)
        explicit = {**fixed, "old_logp": m.policy.token_logprobs(batch, m.cfg.rollout.temperature)[0].detach()}
        results = []
        for terms in (fixed, explicit):
            adv = m.advantages(rewards, batch, terms)
            mini = m.minibatch(batch, torch.arange(16), adv, terms, torch.Generator().manual_seed(0))
            m.policy.model.zero_grad()
            loss, _ = m.micro_loss(mini, torch.arange(16))
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in m.policy.model.parameters()]))
        (skip_loss, skip_grads), (full_loss, full_grads) = results
        assert full_loss.abs() > 0 and any(g.abs().sum() > 0 for g in full_grads)
        torch.testing.assert_close(skip_loss, full_loss, atol=1e-6, rtol=1e-5)
        for a, b in zip(skip_grads, full_grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
