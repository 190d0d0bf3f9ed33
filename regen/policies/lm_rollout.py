"""The rollout container of language models: a batch of sampled completions with their
masks (and, from rollout workers, the weight version and log-probs that sampled them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from regen.data.vision_inputs import VisionInputs


@dataclass
class LMRollout:
    """A batch of B = prompts x group_size sampled completions."""

    input_ids: torch.Tensor  # (B, P+T) long: prompt left-padded to width P, then response right-padded to T
    attention_mask: torch.Tensor  # (B, P+T) long: 1 on prompt tokens and on valid response tokens
    response_mask: torch.Tensor  # (B, T) float: 1 on sampled tokens up to and including EOS
    finished: torch.Tensor  # (B,) bool: the completion ended with EOS (not truncated)
    prompt_width: int  # P
    completions: list[str]  # (B,) decoded responses, EOS and padding removed
    version: torch.Tensor | None = None  # (B,) long: weight version that sampled each row (rollout workers)
    behaviour_logp: torch.Tensor | None = None  # (B, T) log-probs under the sampling weights (rollout workers)
    vision: VisionInputs | None = None  # vision-language models: each row's image inputs (pixel_values, ...)
    # multi-turn episodes (regen/policies/lm_episodes.py): per row, its turns, observations, reward and tool counts;
    # the response region then interleaves turns and observations, response_mask marking the model's tokens only
    episodes: list[dict] | None = None
    # M-RoPE models (the Qwen-VL families, regen/policies/vlm_packed.py): each prompt's 3-axis positions (B, 3, P)
    rope: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.completions)

    def row_meta(self, i: int) -> dict:
        """What a reward sees of row i beyond its prompt row's fields: its episode, if any."""
        return {} if self.episodes is None else {"episode": self.episodes[i]}

    @property
    def lengths(self) -> torch.Tensor:  # (B,) tokens after the prompt, observations included
        return self.attention_mask[:, self.prompt_width :].sum(1)

    @property
    def response_ids(self) -> torch.Tensor:  # (B, T)
        return self.input_ids[:, self.prompt_width :]

    @property
    def position_ids(self) -> torch.Tensor:
        """(B, P+T): left padding must not shift positions. M-RoPE: (B, 3, P+T), the prompt's own
        positions, then text positions shifted by the row's offset (largest prompt position + 1 -
        prompt length), as the sampler continued them."""
        pos = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)
        if self.rope is None:
            return pos
        P = self.prompt_width
        delta = self.rope.flatten(1).amax(1) + 1 - self.attention_mask[:, :P].sum(1)
        full = (pos + delta[:, None])[:, None, :].repeat(1, 3, 1)
        full[:, :, :P] = self.rope
        return full

    def select(self, idx: torch.Tensor) -> LMRollout:
        keep = idx.tolist()
        return LMRollout(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.response_mask[idx],
            self.finished[idx],
            self.prompt_width,
            [self.completions[i] for i in keep],
            None if self.version is None else self.version[idx.cpu()],
            None if self.behaviour_logp is None else self.behaviour_logp[idx.to(self.behaviour_logp.device)],
            None if self.vision is None else self.vision.select(keep),
            None if self.episodes is None else [self.episodes[i] for i in keep],
            None if self.rope is None else self.rope[idx.to(self.rope.device)],
        )

    def to(self, device) -> LMRollout:
        """The same rollout with its tensors on `device` (rollouts travel between processes on the CPU)."""
        return LMRollout(self.input_ids.to(device), self.attention_mask.to(device), self.response_mask.to(device),
                         self.finished.to(device), self.prompt_width, self.completions, self.version,
                         None if self.behaviour_logp is None else self.behaviour_logp.to(device),
                         None if self.vision is None else self.vision.to(device),
                         self.episodes, None if self.rope is None else self.rope.to(device))


def concat_rollouts(parts: list[LMRollout], pad_id: int) -> LMRollout:
    """One rollout from several: prompts left-padded to the widest, responses right-padded
    to the longest (padding masked out everywhere, so log-probs are unchanged)."""
    P = max(p.prompt_width for p in parts)
    T = max(p.response_ids.shape[1] for p in parts)
    ids, att, resp_mask = [], [], []
    for p in parts:
        t = p.response_ids.shape[1]
        left, right = P - p.prompt_width, T - t
        prompt = F.pad(p.input_ids[:, : p.prompt_width], (left, 0), value=pad_id)
        response = F.pad(p.response_ids, (0, right), value=pad_id)
        ids.append(torch.cat([prompt, response], 1))
        att.append(torch.cat([F.pad(p.attention_mask[:, : p.prompt_width], (left, 0)),
                              F.pad(p.attention_mask[:, p.prompt_width :], (0, right))], 1))
        resp_mask.append(F.pad(p.response_mask, (0, right)))
    versions = None if any(p.version is None for p in parts) else torch.cat([p.version for p in parts])
    behaviour = None if any(p.behaviour_logp is None for p in parts) else \
        torch.cat([F.pad(p.behaviour_logp, (0, T - p.behaviour_logp.shape[1])) for p in parts])
    vision = None if parts[0].vision is None else VisionInputs.cat([p.vision for p in parts])
    episodes = None if parts[0].episodes is None else [e for p in parts for e in p.episodes]
    rope = None if parts[0].rope is None else torch.cat([F.pad(p.rope, (P - p.prompt_width, 0)) for p in parts])
    return LMRollout(torch.cat(ids), torch.cat(att), torch.cat(resp_mask), torch.cat([p.finished for p in parts]),
                     P, [c for p in parts for c in p.completions], versions, behaviour, vision, episodes, rope)
