"""Language-model policy over any transformers causal LM (or vision-language model, see vlm.py):
sample, score log-probs, export (loading: lm_load.py).

Sampling is a plain KV-cached loop over `model.forward` rather than `generate()`: the loop
needs only temperature / top-p / EOS handling, and skipping generate's per-token machinery
is most of the speed on small models. The log-probs that enter the loss are always
recomputed by `token_logprobs` (same code path for old, new and reference), so a fully
on-policy first update has a ratio of exactly 1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F

from regen.data.vision_inputs import VisionInputs
from regen.errors import DataError, UserError
from regen.policies.lm_load import (  # noqa: F401  (re-exported: regen.policies.lm is where callers import from)
    apply_lora,
    load_model_and_tokenizer,
    max_positions,
    resolve_device,
)
from regen.policies.lm_packed import (
    forward_params,
    inference_mode_for,
    last_logits,
    packable,
    packed_group_logits,
    prompt_mask_4d,
    takes_masks,
)
from regen.policies.lm_rollout import LMRollout, concat_rollouts  # noqa: F401  (re-exported)
from regen.policies.vlm import VisionPrompt, encode, image_args, image_token_ids, is_processor
from regen.policies.vlm_packed import base_model, is_packed, model_positions, rope_positions


def stop_ids(model, tokenizer, extra: list[str] = ()) -> list[int]:
    """Token ids that end a completion: the tokenizer's EOS, the model's generation_config EOS
    id(s), and `extra` token strings (rollout.stop_tokens), each of which must be one token."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen if isinstance(gen, (list, tuple)) else [gen] if gen is not None else [])
    for text in extra:
        tid = tokenizer.convert_tokens_to_ids(text)
        if tid is None or tid == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(tid) != text:
            pieces = tokenizer(text, add_special_tokens=False)["input_ids"]
            tid = pieces[0] if len(pieces) == 1 else None
        if tid is None:
            raise UserError(f"rollout.stop_tokens: '{text}' is not one token of this tokenizer")
        ids.add(int(tid))
    return sorted(i for i in ids if i is not None)


def configure_prompts(policy, cfg) -> None:
    """data.chat_template and rollout.stop_tokens on a policy built from `cfg`."""
    policy.stop_ids = stop_ids(policy.model, policy.tokenizer, cfg.rollout.stop_tokens)
    policy.add_special_tokens = not getattr(cfg.data, "chat_template", False)


class LMPolicy:
    """The trained model, its tokenizer, and an optional frozen reference copy for the KL term."""

    def __init__(self, model, tokenizer, device: torch.device, reference=None):
        """`reference`: None (no KL term), "copy" (a frozen copy of the starting weights), or a
        model to freeze (e.g. the original weights when resuming). No copy is made for None.
        `tokenizer`: a vision-language model's processor makes this an image-reading policy."""
        self.model = model.to(device)
        self.processor = tokenizer if is_processor(tokenizer) else None
        tokenizer = tokenizer.tokenizer if self.processor is not None else tokenizer
        self.tokenizer = tokenizer
        # image placeholder tokens are never sampled nor scored (see regen/policies/vlm.py)
        self.banned = torch.tensor(image_token_ids(self.processor, getattr(model, "config", None)), dtype=torch.long,
                                   device=device)
        self.device = device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        # a completion ends at any of these: EOS, the model's generation_config EOS ids (an instruct
        # model's end-of-turn token, e.g. <|im_end|>), and rollout.stop_tokens (set_stops)
        self.stop_ids = stop_ids(model, tokenizer)
        # prompts rendered by a chat template already hold their special tokens (BOS...)
        self.add_special_tokens = True
        if isinstance(reference, str) and reference == "copy":
            reference = copy.deepcopy(self.model)
        self.ref = None if reference is None else reference.to(device).eval().requires_grad_(False)
        # Data parallel (regen/runtime/dist.py): the update's forward goes through the DDP wrapper
        # when there is one; under FSDP2 every rank must run the same number of forwards, so a
        # rank whose rows are done keeps stepping until `all_done` says every rank's are.
        self.forward_model = self.model
        self.all_done = lambda done: bool(done.all())

    # ---------------------------------------------------------------- sampling

    def inputs(self, items) -> list:
        """What `sample` takes for these prompt items: their text, and for a VLM their images."""
        if self.processor is None:
            if any(getattr(it, "image", None) is not None for it in items):
                raise DataError("the prompt rows carry an 'image' but model.path is a text-only model (no "
                                "vision_config): use a vision-language model, or drop the images")
            return [it.prompt for it in items]
        missing = [i for i, it in enumerate(items) if it.image is None]
        if missing and not getattr(self.processor, "reads_no_image", False):  # Qwen-VL: images optional
            raise DataError(f"the model reads images but prompt '{items[missing[0]].prompt[:60]}' has no 'image' "
                            f"({len(missing)} of {len(items)} prompts here)")
        return [VisionPrompt(it.prompt, it.image) for it in items]

    def encode(self, prompts: list) -> tuple[dict, VisionInputs | None]:
        """(input_ids / attention_mask left-padded, and position_ids (B, 3, P) for an M-RoPE model;
        image inputs per row: None for text) on the device."""
        if self.processor is not None:
            text, vision = encode(self.processor, prompts, self.add_special_tokens, self.device)
            if is_packed(self.model):
                text["position_ids"] = rope_positions(self.model, text["input_ids"], text["attention_mask"],
                                                      vision.kwargs())
            return text, vision
        enc = self.tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt",
                             add_special_tokens=self.add_special_tokens)
        return {k: enc[k].to(self.device) for k in ("input_ids", "attention_mask")}, None

    def ban(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, self.banned, float("-inf")) if len(self.banned) else logits

    @torch.no_grad()
    def sample(
        self,
        prompts: list,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        generator: torch.Generator,
        greedy: bool = False,
        uniforms: torch.Tensor | None = None,
        with_logp: bool = False,
    ) -> LMRollout:
        """Sample n completions per prompt (consecutive rows form a group); prompts as `inputs` makes them.

        The randomness is one uniform per (row, token position), drawn up front: `uniforms`
        (B, max_new_tokens), or drawn from `generator`. A row's tokens then depend only on its
        own uniforms, so a process sampling a slice of a batch with the matching slice of the
        batch's uniforms draws exactly the rows the whole batch would (torchrun data parallel).
        with_logp: also keep each sampled token's log-prob under softmax(logits / temperature)
        (the behaviour policy's, as token_logprobs defines it: no top-p renormalisation)."""
        model = self.model
        was_training = model.training
        model.eval()
        enc, vision = self.encode(prompts)
        stops = torch.tensor(self.stop_ids, device=self.device)
        prompt_mask = enc["attention_mask"]
        cache_arg = _cache_arg(model)
        # Each prompt (and its image) is encoded once and its KV cache repeated n times: the group shares it.
        p_pos = enc.get("position_ids")  # M-RoPE (B, 3, P), else the plain text positions
        if p_pos is None:
            p_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        # text through one of lm_packed's families: 4D masks handed in, not rebuilt from 2D at every token
        four = vision is None and enc.get("position_ids") is None and \
            takes_masks(model, prompt_mask.shape[1] + max_new_tokens)
        # the model's calls run in inference mode (no autograd bookkeeping: ~5% of a small model's
        # sampling time); what leaves them is computed on outside it, so nothing returned is an
        # inference tensor (those could not be saved for the update's backward)
        quiet = inference_mode_for(model)
        with quiet():
            out = model(input_ids=enc["input_ids"], attention_mask=prompt_mask_4d(prompt_mask) if four else prompt_mask,
                        position_ids=model_positions(p_pos), use_cache=True,
                        **image_args(model, enc["input_ids"], vision), **last_logits(model, 1))
            past = _cache_of(out)
            past.batch_repeat_interleave(n)
        logits = self.ban(out.logits[:, -1]).repeat_interleave(n, 0)
        prompt_ids = enc["input_ids"].repeat_interleave(n, 0)
        mask = prompt_mask.repeat_interleave(n, 0)
        B, P = prompt_ids.shape
        # a response continues at the prompt's largest position + 1 (on every M-RoPE axis)
        next_pos = (p_pos.flatten(1).amax(1) + 1).repeat_interleave(n, 0)[:, None]
        rope = p_pos.dim() == 3
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        if uniforms is None and not greedy:
            uniforms = torch.rand(B, max_new_tokens, generator=generator, device=generator.device)
        tokens, logps = [], []
        if four:  # (B, 1, 1, P + max_new_tokens): each decoding step's query sees a prefix of it
            keys = torch.cat([mask.bool(), mask.new_ones(B, max_new_tokens, dtype=torch.bool)], 1)[:, None, None]
        for t in range(max_new_tokens):
            tok = logits.argmax(-1) if greedy else sample_token(logits, temperature, top_p, uniforms[:, t].to(self.device))
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            tokens.append(tok)
            if with_logp:
                logps.append(F.log_softmax(logits.float() / temperature, -1).gather(-1, tok[:, None]).squeeze(-1))
            done = done | torch.isin(tok, stops)
            if t + 1 == max_new_tokens or self.all_done(done):
                break
            mask = None if four else torch.cat([mask, mask.new_ones(B, 1)], 1)
            with quiet():
                out = model(
                    input_ids=tok[:, None], attention_mask=keys[..., : P + t + 1] if four else mask, use_cache=True,
                    **{cache_arg: past},
                    position_ids=next_pos[None].expand(3, -1, -1) if rope else next_pos,
                )
            past, logits = _cache_of(out), self.ban(out.logits[:, -1])
            next_pos = next_pos + 1
        model.train(was_training)
        response = torch.stack(tokens, 1)  # (B, T)
        is_eos = torch.isin(response, stops)
        # valid = every token up to and including the first EOS (or other stop token)
        before_eos = (is_eos.cumsum(1) - is_eos.long()) == 0
        response_mask = before_eos.float()
        finished = is_eos.any(1)
        body = torch.where(before_eos & ~is_eos, response, torch.full_like(response, self.pad_id))
        completions = self.tokenizer.batch_decode(body.tolist(), skip_special_tokens=True)
        return LMRollout(
            input_ids=torch.cat([prompt_ids, response], 1),
            attention_mask=torch.cat([prompt_mask.repeat_interleave(n, 0), before_eos.long()], 1),
            response_mask=response_mask,
            finished=finished,
            prompt_width=P,
            completions=completions,
            behaviour_logp=torch.stack(logps, 1) * response_mask if with_logp else None,
            vision=None if vision is None else vision.repeat(n),
            rope=p_pos.repeat_interleave(n, 0) if rope else None,
        )

    # ---------------------------------------------------------------- scoring

    def token_logprobs(
        self,
        batch: LMRollout,
        temperature: float,
        use_ref: bool = False,
        with_entropy: bool = False,
        group_size: int = 1,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (B, T) of the sampled response tokens under logits / temperature (the
        distribution they were sampled from), and optionally the per-token entropy (B, T).

        With group_size > 1, rows come in groups of consecutive samples of one prompt, and the
        prompt is run through the model once per group instead of once per sample: its KV
        cache (with its gradient path) is repeated across the group and only the responses
        are computed per sample. Same numbers as the plain forward, (n-1)/n less prompt work.
        """
        if use_ref and self.ref is None and self.is_lora:
            with self.model.disable_adapter():  # LoRA: the reference is the base, adapter off
                return self._logprobs(self.model, batch, temperature, with_entropy, group_size, entropy_grad)
        return self._logprobs(self.ref if use_ref else self.model, batch, temperature, with_entropy, group_size,
                              entropy_grad)

    def _logprobs(self, model, batch, temperature, with_entropy, group_size, entropy_grad):
        model = self.forward_model if model is self.model else model
        if group_size > 1 and packable(model, batch, group_size):
            logits = packed_group_logits(model, batch, group_size)  # one forward, each prompt once, no padding
        elif group_size > 1:
            logits = _shared_prefix_logits(model, batch, group_size)
        else:
            T = batch.input_ids.shape[1] - batch.prompt_width
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=model_positions(batch.position_ids),
                        **image_args(model, batch.input_ids, batch.vision), **last_logits(model, T + 1))
            logits = out.logits[:, -(T + 1) : -1]  # position t predicts token t+1
        logp_all = F.log_softmax(self.ban(logits.float()) / temperature, -1)
        logp = logp_all.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        entropy = None
        if with_entropy:  # with its gradient only when an entropy bonus needs it
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    # ---------------------------------------------------------------- export

    @property
    def is_lora(self) -> bool:
        return hasattr(self.model, "disable_adapter") and hasattr(self.model, "merge_and_unload")

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        """Checkpoint form: a Hugging Face folder (for LoRA: the adapter only, peft's format).
        state_dict: the gathered weights of a sharded (FSDP2) model."""
        folder.mkdir(parents=True, exist_ok=True)
        if state_dict is not None:  # gathered copies no longer share storage: drop tied names (lm_head = wte)
            kept = {n for n, _ in self.model.named_parameters()}
            tied = {n for n, _ in self.model.named_parameters(remove_duplicate=False)} - kept
            state_dict = {k: v for k, v in state_dict.items() if k not in tied}
        self.model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)
        (self.processor or self.tokenizer).save_pretrained(folder)

    def export(self, folder: Path, state_dict: dict | None = None) -> None:
        """A folder AutoModelForCausalLM / AutoTokenizer load as they are (LoRA merged in)."""
        if not self.is_lora:
            return self.save_pretrained(folder, state_dict)
        folder.mkdir(parents=True, exist_ok=True)
        merged = copy.deepcopy(self.model).merge_and_unload()
        merged.save_pretrained(folder, safe_serialization=True)
        (self.processor or self.tokenizer).save_pretrained(folder)


def _shared_prefix_logits(model, batch: LMRollout, n: int) -> torch.Tensor:
    """Logits (B, T, V) predicting each response token, with two savings over one padded
    forward of (B, P+T) tokens, both exact:

    - each group's prompt runs once and its KV cache (gradient path included) is indexed out
      to the group's rows, instead of running B copies of it;
    - rows are split into at most two buckets by response length, so a few long responses
      do not make every short one pay for their padding. Positions past a row's length get
      zero logits; they are masked out of every loss.
    """
    P, (B, T) = batch.prompt_width, batch.response_ids.shape
    pos = batch.position_ids
    group = torch.arange(B, device=batch.input_ids.device) // n
    lengths = batch.lengths.long().clamp(min=1)  # through the last token (a multi-turn episode's too)
    cache_arg = _cache_arg(model)
    pieces = []
    for rows in _length_buckets(lengths):
        L = int(lengths[rows].max())
        uniq, inv = torch.unique(group[rows], return_inverse=True)
        rep = rows[torch.empty_like(uniq).scatter_(0, inv, torch.arange(len(rows), device=rows.device))]
        # the prompt, and its image through the vision tower, once per group
        out = model(input_ids=batch.input_ids[rep, :P], attention_mask=batch.attention_mask[rep, :P],
                    position_ids=model_positions(pos[rep][..., :P]), use_cache=L > 1,
                    **image_args(model, batch.input_ids[rep, :P], batch.vision, rep), **last_logits(model, 1))
        # index_select, not logits[inv] / Cache.batch_select_indices: the backward of advanced indexing
        # with repeated indices (index_put_ with accumulate) adds in a thread-dependent order on CPU, so two
        # identical runs at 2 threads drifted apart in the 8th digit; index_select's backward does not
        logits = out.logits[:, -1:].index_select(0, inv)  # predicts response token 0
        if L > 1:
            cache = _cache_of(out)
            _select_cache_rows(cache, inv)  # one cache row per sample, sharing its prompt's keys/values
            rest = model(input_ids=batch.input_ids[rows, P : P + L - 1],
                         attention_mask=batch.attention_mask[rows, : P + L - 1],
                         position_ids=model_positions(pos[rows][..., P : P + L - 1]), use_cache=True,
                         **{cache_arg: cache}).logits
            logits = torch.cat([logits, rest], 1)
        pieces.append((rows, logits))
    full = pieces[0][1].new_zeros(B, T, pieces[0][1].shape[-1])
    for rows, logits in pieces:
        full = full.index_put((rows[:, None], torch.arange(logits.shape[1], device=rows.device)), logits)
    return full


# What one extra forward pass costs, in token positions: per-call overhead dominates small
# batches (measured ~0.8 ms per call vs ~8 us per token position for the built-in model on
# 2 CPU cores), so a second bucket must save more than that to be worth its two calls.
CALL_COST_TOKENS = 100


def _length_buckets(lengths: torch.Tensor) -> list[torch.Tensor]:
    """Row indices in one bucket, or two split by response length when the token positions
    saved outweigh the two extra forward calls."""
    order = lengths.argsort()
    srt = lengths[order].tolist()
    B, longest = len(srt), srt[-1]
    best_k, best = B, B * longest
    for k in range(1, B):
        if srt[k] != srt[k - 1]:
            cost = k * srt[k - 1] + (B - k) * longest + 2 * CALL_COST_TOKENS
            if cost < best:
                best_k, best = k, cost
    if best_k == B:
        return [torch.arange(B, device=lengths.device)]
    return [order[:best_k], order[best_k:]]


def _cache_arg(model) -> str:
    """transformers 5.x names the KV cache argument `cache`; 4.x named it `past_key_values`."""
    return "cache" if "cache" in forward_params(type(base_model(model))) else "past_key_values"


def _select_cache_rows(cache, rows: torch.Tensor) -> None:
    """Keep the cache's batch rows `rows` (repeats allowed), each layer's keys and values by
    index_select (see _shared_prefix_logits); a cache without per-layer tensors selects its own way."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(getattr(la, "keys", None), torch.Tensor) for la in layers):
        cache.batch_select_indices(rows)
        return
    for la in layers:
        la.keys, la.values = la.keys.index_select(0, rows), la.values.index_select(0, rows)


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), restricted to the top-p nucleus,
    by inverse-CDF sampling with the row's uniform u in [0, 1): the first token whose cumulative
    probability exceeds u times the total."""
    probs = F.softmax(logits.float() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    cdf = probs.cumsum(-1)
    # right=True skips zero-probability tokens (their cdf equals their predecessor's)
    tok = torch.searchsorted(cdf, (u.float() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    tok = tok.clamp(max=probs.shape[-1] - 1)
    # u * total rounding up to the total could land past the last token with mass: take the top one
    return torch.where(probs.gather(-1, tok[:, None]).squeeze(-1) > 0, tok, probs.argmax(-1))
