"""Multi-turn episodes (env:): the tool environment's parsing and failures, the episode sampler's
KV continuation against a full re-encode, observation tokens outside every loss term, the limits."""

from __future__ import annotations

import time

import pytest
import torch

from regen.algorithms.losses import POLICY_LOSSES
from regen.envs import Environment, Step
from regen.envs.tools import ToolEnv, call_tool, parse_hermes, tool_spec
from regen.policies.lm import LMPolicy
from regen.policies.lm_episodes import EpisodeSampler, ObservationText
from regen.tasks import calc as calc_task


def hang(seconds: float) -> str:
    """Sleeps (a tool that hangs)."""
    time.sleep(seconds)
    return "woke"


def boom(x: int) -> str:
    raise RuntimeError(f"no {x}")


class Echo(Environment):
    """Answers every turn with an observation whose length depends on the turn (so rows of one
    batch get observations of different lengths at each turn), ends after `turns` turns."""

    def __init__(self, turns: int = 3, never_done: bool = False):
        self.turns, self.never_done, self.k = turns, never_done, 0

    def reset(self, row, seed):
        self.seed = seed
        return None

    def step(self, turn):
        self.k += 1
        if self.k >= self.turns and not self.never_done:
            return Step(None, reward=1.0, done=True)
        return Step("=" + "7" * (1 + (len(turn) + self.seed) % 5), reward=0.5)

    def episode_reward(self):
        return 10.0


@pytest.fixture(scope="module")
def policy():
    model, tok = calc_task.build_model(0)
    p = LMPolicy(model, tok, torch.device("cpu"))
    p.model.eval()
    return p


def items(k=3):
    return calc_task.prompts("test", 4, 500)[:k]


def test_hermes_calls_are_parsed_and_bad_ones_named():
    text = 'ok <tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>' \
           '<tool_call>{"name":"f","arguments":"{\\"x\\": 1}"}</tool_call>'
    assert parse_hermes(text) == [("calc", {"expression": "2*3"}), ("f", {"x": 1})]
    assert parse_hermes("no call here") == []
    for bad, words in (('<tool_call>{"name": "calc", </tool_call>', "not valid JSON"),
                       ('<tool_call>["calc"]</tool_call>', "JSON object"),
                       ('<tool_call>{"name": "calc", "arguments": 3}</tool_call>', "must be a JSON object"),
                       ('<tool_call>{"name": "calc"', "not closed")):
        with pytest.raises(ValueError, match=words):
            parse_hermes(bad)


def test_a_functions_spec_comes_from_its_signature_and_docstring():
    spec = tool_spec(calc_task.calc)["function"]
    assert spec["name"] == "calc" and spec["description"].startswith("Evaluate an integer arithmetic")
    assert spec["parameters"] == {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": 'e.g. "1234*5678"'}}}
    assert tool_spec(boom)["function"]["parameters"]["properties"]["x"]["type"] == "integer"


def test_every_tool_failure_is_an_observation_and_a_hanging_tool_is_killed_at_its_timeout():
    env = ToolEnv({"calc": "regen.tasks.calc:calc", "hang": "tests.test_envs:hang", "boom": "tests.test_envs:boom"},
                  timeout_s=1.0)
    assert {t["function"]["name"] for t in env.tools} == {"calc", "hang", "boom"}

    def result(call: str) -> tuple[str, dict]:
        step = env.step(call)
        assert not step.done and len(step.observation) == 1
        return step.observation[0]["content"], step.info

    assert result('<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>')[0] == "408"
    t0 = time.perf_counter()
    text, info = result('<tool_call>{"name": "hang", "arguments": {"seconds": 60}}</tool_call>')
    assert time.perf_counter() - t0 < 5 and text == "error: timed out after 1 s" and info["tool_errors"] == 1
    calls, secs = info["tool_time"]["hang"]  # per-tool latency: the killed call took its timeout, not 60 s
    assert calls == 1 and 1.0 <= secs < 5 and set(info["tool_time"]) == {"hang"}
    assert result('<tool_call>{"name": "boom", "arguments": {"x": 3}}</tool_call>')[0] == "error: RuntimeError: no 3"
    assert "unknown tool 'nope'" in result('<tool_call>{"name": "nope", "arguments": {}}</tool_call>')[0]
    assert "bad arguments" in result('<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>')[0]
    assert "not valid JSON" in result("<tool_call>{calc}</tool_call>")[0]
    assert env.step("8*9=72").done  # no call: the final answer
    assert call_tool(calc_task.calc, {"expression": "2*2"}, 1.0, isolate=False) == (True, "4")


def test_observations_render_as_text_or_through_the_chat_template():
    from regen.tasks.calc import build_tokenizer

    tok = build_tokenizer()
    plain = ObservationText(tok, chat=False, stop_ids=[tok.eos_token_id])
    msgs = [{"role": "tool", "content": "42", "text": "<tool_response>42</tool_response>"}]
    assert plain(msgs, True) == "<tool_response>42</tool_response>" and plain("raw", True) == "raw"
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = ObservationText(tok, chat=True, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    # the model wrote <|im_end|> itself: the template's "\n" after it, the tool turn, the next assistant header
    assert chat(msgs, True) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert chat(msgs, False).startswith("<|im_end|>\n<|im_start|>tool")  # a turn cut short gets its end mark


def test_kv_continuation_gives_the_log_probs_of_a_full_re_encode(policy):
    """Rows get observations of different lengths at different turns, and rows wait for each
    other (holes in the cache); the compacted batch, encoded from scratch, scores the same."""
    s = EpisodeSampler(policy, lambda: Echo(3), max_turns=3, max_tokens=60, chat=False)
    ro = s.sample(s.inputs(items()), 4, 1.0, 1.0, 8, torch.Generator().manual_seed(0), with_logp=True)
    m = ro.response_mask
    assert all(len(e["turns"]) == 3 for e in ro.episodes) and len({float(x) for x in ro.lengths}) > 1
    assert float(m.sum()) < float(ro.attention_mask[:, ro.prompt_width:].sum())  # observations are there, unmasked
    for share in (1, 4):  # the plain forward, and each group's prompt once (the update's path)
        lp, _ = policy.token_logprobs(ro, 1.0, group_size=share)
        assert float(((lp.detach() - ro.behaviour_logp) * m).abs().max()) < 1e-5
    # each observation's tokens sit right after the turn they answer, masked out
    ep, row = ro.episodes[0], ro.response_ids[0].tolist()
    obs_ids = policy.tokenizer(ep["observations"][0], add_special_tokens=False)["input_ids"]
    first_turn = int(torch.nonzero(m[0] == 0)[0])
    assert row[first_turn:first_turn + len(obs_ids)] == obs_ids and m[0, first_turn:first_turn + len(obs_ids)].sum() == 0
    assert ep["reward"] == 0.5 + 0.5 + 1.0 + 10.0 and all(ro.finished.tolist())
    # the same episodes sampled by re-encoding the whole sequence at each turn (bench/episode_kv.py's baseline)
    u, seeds = torch.rand(12, 24, generator=torch.Generator().manual_seed(2)), torch.arange(12)
    kv = s.sample(s.inputs(items()), 4, 1.0, 1.0, 8, None, uniforms=u, seeds=seeds, with_logp=True)
    re = EpisodeSampler(policy, lambda: Echo(3), 3, 60, False, reencode=True).sample(
        s.inputs(items()), 4, 1.0, 1.0, 8, None, uniforms=u, seeds=seeds, with_logp=True)
    assert torch.equal(kv.input_ids, re.input_ids) and kv.episodes == re.episodes
    assert float((kv.behaviour_logp - re.behaviour_logp).abs().max()) < 1e-5


def test_a_sample_is_the_same_alone_as_in_a_batch(policy):
    s = EpisodeSampler(policy, lambda: Echo(3), max_turns=3, max_tokens=60, chat=False)
    u, seeds = torch.rand(12, 24, generator=torch.Generator().manual_seed(1)), torch.arange(12)
    whole = s.sample(s.inputs(items()), 4, 1.0, 1.0, 8, None, uniforms=u, seeds=seeds)
    part = s.sample(s.inputs(items()[1:2]), 4, 1.0, 1.0, 8, None, uniforms=u[4:8], seeds=seeds[4:8])
    assert whole.episodes[4:8] == part.episodes
    n = int(part.lengths.max())
    assert torch.equal(whole.response_ids[4:8, :n], part.response_ids[:, :n])


def test_limits_truncate_and_mark_the_episode(policy):
    s = EpisodeSampler(policy, lambda: Echo(never_done=True), max_turns=2, max_tokens=60, chat=False)
    ro = s.sample(s.inputs(items(2)), 2, 1.0, 1.0, 6, torch.Generator().manual_seed(0))
    assert all(len(e["turns"]) == 2 and e["truncated"] for e in ro.episodes) and not any(ro.finished.tolist())
    s = EpisodeSampler(policy, lambda: Echo(never_done=True), max_turns=50, max_tokens=20, chat=False)
    ro = s.sample(s.inputs(items(2)), 2, 1.0, 1.0, 6, torch.Generator().manual_seed(0))
    assert all(e["truncated"] for e in ro.episodes) and int(ro.lengths.max()) <= 20


def test_observation_tokens_get_no_gradient_and_no_kl_or_entropy(policy):
    """A hand-built 2-turn sequence: response = turn (3 tokens), observation (2), turn (2)."""
    mask = torch.tensor([[1.0, 1, 1, 0, 0, 1, 1]])
    logp = torch.tensor([[-1.0, -2, -0.5, -3, -4, -1.5, -0.7]], requires_grad=True)
    old, adv = logp.detach() + 0.1, torch.tensor([[1.0] * 7])
    ref = torch.tensor([[-1.2, -1.9, -0.4, -9.0, -9.0, -1.3, -0.9]])
    entropy = torch.tensor([[0.5, 0.6, 0.7, 5.0, 5.0, 0.8, 0.9]])
    kw = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.1, kl_estimator="k3", agg="token-mean", norm=8.0,
              dual_clip=None, entropy_coef=0.01)
    loss, _ = POLICY_LOSSES["grpo"](logp, old, adv, mask, ref_logp=ref, entropy=entropy, **kw)
    loss.backward()
    assert logp.grad[0, 3:5].abs().sum() == 0 and (logp.grad[0, mask[0] > 0] != 0).all()
    # anything at the observation positions (reference log-probs, entropy) leaves the loss unchanged
    ref2, ent2 = ref.clone(), entropy.clone()
    ref2[0, 3:5], ent2[0, 3:5] = 0.0, 0.0
    loss2, _ = POLICY_LOSSES["grpo"](logp, old, adv, mask, ref_logp=ref2, entropy=ent2, **kw)
    assert float(loss2.detach()) == float(loss.detach())
    # the hand computation: ratio exp(-0.1) clipped at 0.8? no (0.905 in [0.8, 1.2]): -mean(r * A) over 5 tokens,
    # + 0.1 * mean k3, - 0.01 * mean entropy
    r = torch.exp(torch.tensor(-0.1))
    lm = logp.detach()[0, mask[0] > 0]
    d = ref[0, mask[0] > 0] - lm
    k3 = (torch.exp(d) - d - 1).mean()
    want = -r + 0.1 * k3 - 0.01 * entropy[0, mask[0] > 0].mean()
    assert abs(float(loss.detach()) - float(want)) < 1e-6


def test_episode_metrics_average_per_episode_and_per_tool_call():
    from types import SimpleNamespace

    from regen.policies.lm_episodes import episode_metrics

    base = {"observations": [], "reward": 1.0, "truncated": False}
    eps = [{**base, "turns": ["a", "b", "c"], "tool_calls": 2, "tool_errors": 1, "tool_seconds": 0.4, "obs_tokens": 6,
            "tool_time": {"calc": [2, 0.4]}},
           {**base, "turns": ["a"], "tool_calls": 2, "tool_errors": 0, "tool_seconds": 1.2, "obs_tokens": 0,
            "tool_time": {"calc": [1, 0.2], "search": [1, 1.0]}, "truncated": True, "reward": 0.0}]
    m = episode_metrics(SimpleNamespace(episodes=eps, lengths=torch.tensor([20, 10])))
    assert m["episode/turns"] == 2.0 and m["episode/tool_calls"] == 2.0 and m["episode/tool_errors"] == 0.5
    assert m["episode/obs_token_frac"] == pytest.approx(6 / 30) and m["episode/truncated_frac"] == 0.5
    assert m["episode/tool_seconds"] == pytest.approx(1.6 / 4) and m["episode/env_reward"] == 0.5
    assert m["episode/tool_seconds/calc"] == pytest.approx(0.6 / 3) and m["episode/tool_seconds/search"] == 1.0
