"""Multi-turn episodes: the model's turns and an environment's observations in one token sequence.

A batch of episodes is sampled the way one turn is (regen/policies/lm.py), continuing one KV
cache: each turn is generated token by token for the rows still in their turn; when every row
has ended its turn (a stop token, rollout.max_new_tokens, or the episode's token budget) the
environments answer and all observations are appended in one forward call. The prefix is never
encoded again. Rows that wait (their turn ended, their episode is over) are holes in the cache:
attention-masked, positions not advanced, their logits kept from their last real token, so each
row samples exactly what it would alone.

The batch the update sees has the holes removed: prompt, then turn, observation, turn, ...
right-padded. response_mask is 1 on the model's own tokens only, so observation tokens are
outside the policy loss, the KL, the entropy bonus and PPO's value targets (they are all
averaged over that mask); the model still attends to them. Log-probs recomputed on this batch
equal the sampler's (the holes' attention weight is exactly zero).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from regen.errors import UserError
from regen.policies.lm import _cache_arg, _cache_of, sample_token
from regen.policies.lm_rollout import LMRollout
from regen.policies.vlm import VisionPrompt, image_args
from regen.policies.vlm_packed import model_positions


@dataclass
class Episode:
    """One row's episode, for rewards (Sample.meta["episode"]), metrics and transcripts."""

    turns: list[str] = field(default_factory=list)  # the model's turns (stop tokens removed)
    observations: list[str] = field(default_factory=list)  # the text appended after each turn ("" if none)
    reward: float = 0.0  # per-turn rewards + episode_reward
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    tool_time: dict = field(default_factory=dict)  # tool name -> [calls, seconds]
    truncated: bool = False  # stopped by env.max_turns or env.max_tokens, not by the environment
    obs_tokens: int = 0

    def as_dict(self) -> dict:
        return {**self.__dict__, "tool_time": {k: list(v) for k, v in self.tool_time.items()}}

    def transcript(self) -> str:
        parts = []
        for i, turn in enumerate(self.turns):
            parts.append(f"[model] {turn}")
            if i < len(self.observations) and self.observations[i]:
                parts.append(f"[env] {self.observations[i]}")
        return "\n".join(parts) + ("\n[truncated]" if self.truncated else "")


class ObservationText:
    """Observations as the text appended to the sequence. Text is used as it is; messages are
    rendered by the chat template (the text the template writes after the model's turn), or,
    without one, each message's "text" (or content) in order."""

    def __init__(self, tokenizer, chat: bool, stop_ids: list[int]):
        self.chat, self.tok = chat, tokenizer
        self.stop_texts = [tokenizer.decode([i]) for i in stop_ids]
        if chat:  # what the template writes after an assistant turn's content (e.g. "<|im_end|>\n")
            base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "@A@"}]
            self.base = tokenizer.apply_chat_template(base, tokenize=False)
            self.turn_end = self.base[self.base.rindex("@A@") + 3:]
            self.base_msgs = base

    def __call__(self, obs, turn_ids_end_with_stop: bool) -> str:
        if obs is None:
            return ""
        if isinstance(obs, str):
            return obs
        if not self.chat:
            return "".join(str(m.get("text", m.get("content", ""))) for m in obs)
        msgs = [{k: v for k, v in m.items() if k != "text"} for m in obs]
        full = self.tok.apply_chat_template(self.base_msgs + msgs, tokenize=False, add_generation_prompt=True)
        if not full.startswith(self.base):
            raise UserError("env: the chat template rewrites earlier turns when an observation is added, so the "
                            "observation's text cannot be appended; give observations as text")
        head = self.turn_end
        if turn_ids_end_with_stop:  # the model already wrote its end-of-turn token
            for s in self.stop_texts:
                if s and head.startswith(s):
                    head = head[len(s):]
                    break
        return head + full[len(self.base):]


class EpisodeSampler:
    """Samples episodes where LMPolicy samples single completions (same arguments); its
    `inputs` are the prompt rows themselves (environments start from the row)."""

    def __init__(self, policy, new_env, max_turns: int, max_tokens: int, chat: bool, reencode: bool = False):
        self.policy, self.new_env, self.max_turns, self.max_tokens = policy, new_env, max_turns, max_tokens
        # reencode: drop the KV cache after each turn and encode the whole sequence again, as an agent
        # loop that calls a text-in/text-out generator per turn does; for bench/episode_kv.py only
        self.reencode = reencode
        self.render = ObservationText(policy.tokenizer, chat, policy.stop_ids)
        self.chat = chat

    @property
    def device(self):
        return self.policy.device

    @property
    def tools(self) -> list[dict] | None:
        """The environment's tool specs (what a chat template shows the model), or None."""
        return getattr(self.new_env(), "tools", None)

    def inputs(self, items) -> list:
        self.policy.inputs(items)  # the same checks (no images for a text model)
        return list(items)

    def width(self, max_new_tokens: int) -> int:
        """Uniforms per row: one per model token the episode can write."""
        return self.max_turns * max_new_tokens

    def first_prompt(self, env, row, seed: int) -> str:
        first = env.reset(row, seed)
        if first is None:
            return row.prompt
        if isinstance(first, str):
            return first
        if self.chat:
            tools = getattr(env, "tools", None)
            return self.policy.tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True,
                                                            **({"tools": tools} if tools else {}))
        return "".join(m["content"] for m in first)

    @torch.no_grad()
    def sample(self, rows: list, n: int, temperature: float, top_p: float, max_new_tokens: int,
               generator: torch.Generator | None, greedy: bool = False, uniforms: torch.Tensor | None = None,
               with_logp: bool = False, seeds: torch.Tensor | None = None) -> LMRollout:
        p, dev = self.policy, self.policy.device
        model, B, T = p.model, len(rows) * n, max_new_tokens
        if uniforms is None and not greedy:
            uniforms = torch.rand(B, self.width(T), generator=generator, device=generator.device)
        if seeds is None:
            seeds = torch.randint(0, 2**31 - 1, (B,), generator=generator, device=generator.device)
        seeds = seeds.tolist()
        envs = [self.new_env() for _ in range(B)]
        firsts = [self.first_prompt(envs[i], rows[i // n], seeds[i]) for i in range(B)]
        for g in range(len(rows)):
            if len(set(firsts[g * n:(g + 1) * n])) > 1:
                raise UserError(f"env: reset() gave different first prompts to the {n} episodes of one group "
                                f"(prompt row '{rows[g].prompt[:40]}'); a group's episodes must start alike")
        was_training = model.training
        model.eval()
        # a vision-language model: the row's image(s) go with the first prompt; observations are text
        firsts_in = firsts[::n] if p.processor is None else \
            [VisionPrompt(f, r.image) for f, r in zip(firsts[::n], rows)]
        enc, vision = p.encode(firsts_in)
        stops = torch.tensor(p.stop_ids, device=dev)
        prompt_mask = enc["attention_mask"]
        cache_arg = _cache_arg(model)
        p_pos = enc.get("position_ids")  # M-RoPE (B, 3, P), else the plain text positions
        if p_pos is None:
            p_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        rope = p_pos.dim() == 3
        if rope and self.reencode:
            raise UserError("episode re-encoding (bench/episode_kv.py) is for text models")
        out = model(input_ids=enc["input_ids"], attention_mask=prompt_mask, position_ids=model_positions(p_pos),
                    use_cache=True, **image_args(model, enc["input_ids"], vision))
        past, logits = _cache_of(out), p.ban(out.logits[:, -1]).repeat_interleave(n, 0)
        past.batch_repeat_interleave(n)
        prompt_ids, mask = enc["input_ids"].repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
        P = prompt_ids.shape[1]
        seq = prompt_ids  # every token fed so far (holes included): what reencode encodes again
        # (B, 1) position of each row's next real token: the prompt's largest + 1 (on every M-RoPE axis)
        next_pos = (p_pos.flatten(1).amax(1) + 1).repeat_interleave(n, 0)[:, None]
        resp = [[] for _ in range(B)]  # the compacted response region: (token, is_model, logp)
        unfed = [[] for _ in range(B)]  # tokens in resp the cache has not seen yet
        eps = [Episode() for _ in range(B)]
        active = [True] * B
        finished = [False] * B

        def feed(ids: torch.Tensor, real: torch.Tensor, whole: bool = False):
            """One forward of (B, W) tokens; real marks the tokens that are there (else holes). whole:
            without the cache, over every token so far (the same positions and mask)."""
            nonlocal mask, next_pos, past, logits, seq
            mask = torch.cat([mask, real.long()], 1)
            if self.reencode:
                seq = torch.cat([seq, ids], 1)
            if whole:
                o = model(input_ids=seq, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                          use_cache=True)
            else:
                pos = (next_pos + real.long().cumsum(1) - 1).clamp(min=0)
                o = model(input_ids=ids, attention_mask=mask, position_ids=pos[None].expand(3, -1, -1) if rope else pos,
                          use_cache=True, **{cache_arg: past})
            past, new = _cache_of(o), p.ban(o.logits[:, -1])
            logits = torch.where(real[:, -1:], new, logits)  # a waiting row keeps its last real token's logits
            next_pos = next_pos + real.long().sum(1, keepdim=True)

        for k in range(self.max_turns):
            in_turn = torch.tensor(active, device=dev)
            turn = [[] for _ in range(B)]
            for t in range(T):
                if greedy:
                    tok = logits.argmax(-1)
                else:
                    tok = sample_token(logits, temperature, top_p, uniforms[:, k * T + t].to(dev))
                tok = torch.where(in_turn, tok, torch.full_like(tok, p.pad_id))
                lp = F.log_softmax(logits.float() / temperature, -1).gather(-1, tok[:, None]).squeeze(-1) \
                    if with_logp else torch.zeros(B, device=dev)
                ends = torch.isin(tok, stops)
                toks, lps, now = tok.tolist(), lp.tolist(), in_turn.tolist()
                for i in range(B):
                    if now[i]:
                        turn[i].append(toks[i])
                        resp[i].append((toks[i], True, lps[i]))
                        if len(resp[i]) >= self.max_tokens:
                            ends[i] = True
                going = in_turn & ~ends & (t + 1 < T)
                if not bool(going.any()):
                    for i in range(B):
                        if now[i]:
                            unfed[i].append(toks[i])
                    break
                feed(tok[:, None], in_turn[:, None])
                in_turn = going
            self._answer(envs, eps, resp, unfed, turn, active, finished, k, stops)
            if not any(active):
                break
            width = max(len(u) for u in unfed)
            if width == 0:
                continue
            ids = torch.full((B, width), p.pad_id, dtype=torch.long, device=dev)
            real = torch.zeros((B, width), dtype=torch.bool, device=dev)
            for i, u in enumerate(unfed):  # left-padded: each row's last column is its latest token
                if u and active[i]:
                    ids[i, width - len(u):] = torch.tensor(u, device=dev)
                    real[i, width - len(u):] = True
                unfed[i] = []
            if bool(real.any()):
                feed(ids, real, whole=self.reencode)
        for i in range(B):
            reward = envs[i].episode_reward()
            eps[i].reward += float(reward) if reward is not None else 0.0
        model.train(was_training)
        ro = self._rollout(prompt_ids, mask[:, :P], resp, eps, finished, with_logp)
        ro.vision = None if vision is None else vision.repeat(n)
        ro.rope = p_pos.repeat_interleave(n, 0) if rope else None
        return ro

    def _answer(self, envs, eps, resp, unfed, turn, active, finished, k, stops) -> None:
        """Each row that wrote a turn hands it to its environment; the observations join resp."""
        stop_set = set(stops.tolist())
        for i in range(len(envs)):
            if not active[i]:
                continue
            ids = turn[i]
            ended = bool(ids) and ids[-1] in stop_set
            text = self.policy.tokenizer.decode([t for t in ids if t not in stop_set], skip_special_tokens=True)
            eps[i].turns.append(text)
            if len(resp[i]) >= self.max_tokens and not ended:  # out of tokens mid-turn
                eps[i].truncated, active[i] = True, False
                continue
            step = envs[i].step(text)
            eps[i].reward += float(step.reward or 0.0)
            eps[i].tool_calls += int(step.info.get("tool_calls", 0))
            eps[i].tool_errors += int(step.info.get("tool_errors", 0))
            eps[i].tool_seconds += float(step.info.get("tool_seconds", 0.0))
            for name, (calls, secs) in step.info.get("tool_time", {}).items():
                c, t = eps[i].tool_time.get(name, (0, 0.0))
                eps[i].tool_time[name] = [c + int(calls), t + float(secs)]
            if step.done:
                finished[i], active[i] = True, False
                continue
            if k + 1 == self.max_turns:
                eps[i].truncated, active[i] = True, False
                continue
            obs = self.render(step.observation, ended)
            obs_ids = self.policy.tokenizer(obs, add_special_tokens=False)["input_ids"] if obs else []
            if len(resp[i]) + len(obs_ids) >= self.max_tokens:  # no room left to answer the observation
                eps[i].truncated, active[i] = True, False
                continue
            eps[i].observations.append(obs)
            eps[i].obs_tokens += len(obs_ids)
            resp[i] += [(t, False, 0.0) for t in obs_ids]
            unfed[i] += obs_ids

    def _rollout(self, prompt_ids, prompt_mask, resp, eps, finished, with_logp) -> LMRollout:
        p, dev = self.policy, self.policy.device
        B, L = len(resp), max(1, max(len(r) for r in resp))
        ids = torch.full((B, L), p.pad_id, dtype=torch.long)
        att = torch.zeros((B, L), dtype=torch.long)
        rmask = torch.zeros((B, L))
        logp = torch.zeros((B, L))
        for i, r in enumerate(resp):
            if r:
                toks, is_model, lps = zip(*r)
                ids[i, :len(r)] = torch.tensor(toks)
                att[i, :len(r)] = 1
                rmask[i, :len(r)] = torch.tensor(is_model, dtype=torch.float)
                logp[i, :len(r)] = torch.tensor(lps)
        return LMRollout(
            input_ids=torch.cat([prompt_ids, ids.to(dev)], 1), attention_mask=torch.cat([prompt_mask, att.to(dev)], 1),
            response_mask=rmask.to(dev), finished=torch.tensor(finished, device=dev), prompt_width=prompt_ids.shape[1],
            completions=[e.turns[-1] if e.turns else "" for e in eps],
            behaviour_logp=(logp * rmask).to(dev) if with_logp else None,
            episodes=[e.as_dict() for e in eps])


def sliding_window(model) -> int | None:
    """The language model's sliding-window width where some layer attends through one, else None."""
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if window is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window if types is None or "sliding_attention" in types else None


def episode_engine(cfg, policy):
    """env: the multi-turn sampler in front of the policy (None: one completion per sample)."""
    if cfg.env is None:
        return None
    if cfg.rollout.engine == "vllm":
        raise UserError("env with rollout.engine=vllm: multi-turn episodes are sampled by regen's own loop; use "
                        "rollout.engine=hf")
    window = sliding_window(policy.model)
    if window is not None:
        raise UserError(f"env with a {policy.model.config.model_type} model, whose attention uses a sliding window "
                        f"({window} tokens): the episode sampler's waiting rows leave holes in the KV cache, which the "
                        "window would count as tokens; multi-turn episodes need full attention")
    from regen.envs import make_env

    return EpisodeSampler(policy, make_env(cfg.env), cfg.env.max_turns, cfg.env.max_tokens, cfg.data.chat_template)


def episode_metrics(batch: LMRollout) -> dict[str, float]:
    """Turns, tool calls and errors per episode, the observations' share of the tokens after the
    prompt, the truncation rate and the mean seconds per tool call (all tools, and each by name)."""
    eps, n = batch.episodes, len(batch.episodes)
    calls = sum(e["tool_calls"] for e in eps)
    total = float(batch.lengths.sum().clamp(min=1))
    per_tool: dict[str, list] = {}
    for e in eps:
        for name, (c, t) in e.get("tool_time", {}).items():
            acc = per_tool.setdefault(name, [0, 0.0])
            acc[0], acc[1] = acc[0] + c, acc[1] + t
    return {**{f"episode/tool_seconds/{k}": t / max(c, 1) for k, (c, t) in sorted(per_tool.items())},
            "episode/turns": sum(len(e["turns"]) for e in eps) / n,
            "episode/tool_calls": calls / n, "episode/tool_errors": sum(e["tool_errors"] for e in eps) / n,
            "episode/obs_token_frac": sum(e["obs_tokens"] for e in eps) / total,
            "episode/truncated_frac": sum(e["truncated"] for e in eps) / n,
            "episode/env_reward": sum(e["reward"] for e in eps) / n,
            "episode/tool_seconds": sum(e["tool_seconds"] for e in eps) / max(calls, 1)}
