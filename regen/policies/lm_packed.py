"""A group's prompt and its n responses packed into one sequence, one forward for the whole batch.

The update (and the reference / old-policy scoring) needs, for every completion, the logits that
predict its tokens. Run plainly, each of the B = G x n rows repeats its group's prompt and is
padded to the longest response. regen/policies/lm.py's shared-prefix path runs each prompt once
but needs two forward calls (the prompts, then the responses on their KV cache). Packed, each
group is one row:

    [ prompt (left-padded to the batch's width P) | response 1 | response 2 | ... | response n ]

with an attention mask that lets the prompt attend causally to itself and each response to the
prompt and causally to its own earlier tokens, never to another response; every token keeps the
position it had in its own row, so the model computes exactly the same function (to rounding):
each prompt is run once, no response is padded to another's length, and it is one forward call.
Only the positions that predict a response token get the LM head (`logits_to_keep`).

Also here, the other keyword-level savings of a forward call that lm.py uses: the LM head only
on the last positions (last_logits), inference mode for sampling (inference_mode_for).

It is used where that is exact and cheaper (packable): text-only batches (no images, no multi-turn
episodes), model families whose positions come only from position_ids and whose mask is only the
attention mask (the families below), attention through SDPA, no sliding window shorter than the
packed row, and when the attention the packed row computes and throws away (it computes every
pair of the row) is small beside the matmul work. Otherwise the shared-prefix path runs.
"""

from __future__ import annotations

import functools
import inspect

import torch

from regen.policies.lm_rollout import LMRollout
from regen.policies.vlm_packed import base_model

# Decoder-only families whose forward reads the attention mask only to build the causal mask (a 4D
# mask passes through unchanged) and takes explicit position ids; tested in tests/test_lm_packed.py.
FAMILIES = frozenset({"gpt2", "qwen2", "qwen3", "llama"})

# Extra attention work the packed row may cost, as a fraction of the matmul work it does (the
# per-call saving of one forward instead of two is worth about that on CPU at small sizes).
MAX_WASTE = 0.1


def _config(model):
    return base_model(model).config


def takes_masks(model, context: int) -> bool:
    """Whether the model computes exactly what it would from a 2D padding mask when handed a 4D
    boolean mask instead (one of FAMILIES, SDPA attention, no sliding window shorter than
    `context` positions, which a custom mask would override)."""
    c = _config(model)
    if c.model_type not in FAMILIES or getattr(c, "_attn_implementation", None) != "sdpa":
        return False
    window = getattr(c, "sliding_window", None)
    return not (window and getattr(c, "use_sliding_window", True) and window < context)


def prompt_mask_4d(prompt_mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, P, P) boolean causal mask of left-padded prompts: what the model builds from the 2D
    mask, except that a padding query attends to itself (its output is never used; an empty row
    would make SDPA return NaN there, and NaN keys and values reach no real token only if masked)."""
    P = prompt_mask.shape[1]
    causal = torch.ones(P, P, dtype=torch.bool, device=prompt_mask.device).tril()
    eye = torch.eye(P, dtype=torch.bool, device=prompt_mask.device)
    return ((causal[None] & prompt_mask.bool()[:, None, :]) | eye[None])[:, None]


def packable(model, batch: LMRollout, n: int) -> bool:
    """Whether packed_group_logits is exact for this model and batch, and worth it."""
    if batch.vision is not None or batch.episodes is not None or batch.rope is not None or n < 2:
        return False
    B, P = batch.input_ids.shape[0], batch.prompt_width
    if B % n:
        return False
    inputs = (batch.lengths.long() - 1).clamp(min=0).view(-1, n).sum(1)
    S = P + int(inputs.max())
    if not takes_masks(model, S):
        return False
    c = _config(model)
    # attention pairs computed (every pair of each packed row) against those a plain causal pass needs
    L = batch.lengths.long().view(-1, n)
    needed = (P * P + (L * (P + L)).sum(1)).sum()
    waste = max(0, len(inputs) * S * S - int(needed))
    width = c.hidden_size  # GPT-2 configs map it to n_embd
    matmul_per_position = 24 * width * width  # a transformer block's 12 d^2 parameters, 2 FLOPs each
    attention_per_pair = 4 * width
    return attention_per_pair * waste <= MAX_WASTE * matmul_per_position * len(inputs) * S


def packed_group_logits(model, batch: LMRollout, n: int) -> torch.Tensor:
    """Logits (B, T, V) predicting each response token (zeros past a row's length), from one forward
    of the packed groups (module docstring)."""
    P, (B, T) = batch.prompt_width, batch.response_ids.shape
    G, dev = B // n, batch.input_ids.device
    lengths = batch.lengths.long()
    inputs = (lengths - 1).clamp(min=0)  # a response's last token predicts nothing: not an input
    per_group = inputs.view(G, n)
    offset = (per_group.cumsum(1) - per_group).flatten()  # where each response starts after the prompt
    S = P + int(per_group.sum(1).max())
    pos_all = batch.position_ids

    ids = batch.input_ids.new_zeros(G, S)
    pos = pos_all.new_zeros(G, S)
    seg = torch.full((G, S), -2, dtype=torch.long, device=dev)  # -2 padding, -1 prompt, i response i
    first = torch.arange(G, device=dev) * n  # each group's first row carries its prompt
    ids[:, :P], pos[:, :P] = batch.input_ids[first, :P], pos_all[first, :P]
    seg[:, :P] = torch.where(batch.attention_mask[first, :P] > 0, -1, -2)
    t = torch.arange(T, device=dev)
    valid = t[None, :] < inputs[:, None]  # (B, T) response tokens that are inputs
    dest = (torch.arange(B, device=dev) // n * S)[:, None] + P + offset[:, None] + t[None, :]
    at = dest[valid]
    ids.view(-1)[at] = batch.input_ids[:, P:][valid]
    pos.view(-1)[at] = pos_all[:, P:][valid]
    seg.view(-1)[at] = (torch.arange(B, device=dev) % n)[:, None].expand(B, T)[valid]

    col = torch.arange(S, device=dev)
    causal = col[None, :] <= col[:, None]
    qs, ks = seg[:, :, None], seg[:, None, :]
    allowed = causal & (ks >= -1) & ((ks == -1) | (ks == qs))
    allowed |= torch.eye(S, dtype=torch.bool, device=dev)  # a padding query sees itself: no empty softmax row
    K = S - P + 1  # column P-1 (the prompt's last token) predicts every response's first token
    logits = model(input_ids=ids, attention_mask=allowed[:, None], position_ids=pos, logits_to_keep=K).logits
    # kept column 0 predicts token 0; response b's token t >= 1 is predicted from its input t-1
    keep = torch.where(t[None, :] == 0, 0, offset[:, None] + t[None, :])
    real = t[None, :] < lengths[:, None]
    index = (torch.arange(B, device=dev) // n * K)[:, None] + torch.where(real, keep, 0)
    # index_select, not advanced indexing: its backward adds in a fixed order (see _shared_prefix_logits)
    out = logits.reshape(G * K, -1).index_select(0, index.flatten()).view(B, T, -1)
    return torch.where(real[..., None], out, out.new_zeros(()))


def inference_mode_for(model):
    """torch.inference_mode, except for an FSDP2-sharded model: its hooks update their own buffers
    in place later, outside inference mode, which inference tensors do not allow."""
    from torch.distributed.fsdp import FSDPModule

    return torch.no_grad if isinstance(model, FSDPModule) else torch.inference_mode


def last_logits(model, k: int) -> dict:
    """Ask for the logits of the last k positions only, where the model takes `logits_to_keep`
    (transformers' causal LMs): the LM head over a prompt's other positions is work thrown away,
    and for a real vocabulary it is a large share of it (Qwen2.5-0.5B: 136M of its 494M
    parameters are the head). The kept positions' logits are the same numbers."""
    return {"logits_to_keep": k} if "logits_to_keep" in forward_params(type(base_model(model))) else {}


@functools.cache
def forward_params(cls) -> frozenset:
    return frozenset(inspect.signature(cls.forward).parameters)
