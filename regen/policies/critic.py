"""PPO's critic: a separate value model, a transformers token-classification model with one
output per position (the backbone of a causal LM plus a linear value head).

A separate model rather than a head on the policy: the two are trained with their own
optimizers and learning rates, and the policy's checkpoint and export stay a plain causal
LM. Its checkpoint form is a Hugging Face folder, like the policy's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import torch

from regen.algorithms.gae import value_loss
from regen.algorithms.losses import batch_denominators
from regen.errors import UserError
from regen.policies.lm import LMRollout
from regen.policies.vlm import VISION_PARTS, image_args, is_vlm_folder
from regen.policies.vlm_packed import model_positions
from regen.runtime.dist import Dist


class Critic:
    def __init__(self, model, device: torch.device):
        self.model = model.to(device).eval()  # dropout off, as for the policy
        self.device = device
        # torchrun (regen/runtime/dist.py): forwards go through the DDP wrapper when there is one
        self.forward_model, self.dist = self.model, Dist()

    @classmethod
    def load(cls, cfg, device: torch.device, folder: Path | None = None) -> Critic:
        """From a checkpoint's critic folder, critic.path, or the policy's starting model."""
        from transformers import AutoModelForTokenClassification

        dtype = getattr(torch, cfg.model.dtype)
        source = str(folder) if folder is not None else cfg.critic.path
        if source is not None and (is_vlm_folder(Path(source).expanduser()) or
                                   (Path(source).expanduser() / VALUE_HEAD).is_file()):
            return cls(VisionValueModel.load(str(Path(source).expanduser()), dtype, cfg.model.freeze_vision), device)
        if source is None:  # the policy's starting weights: copy its backbone under a new value head
            from regen.policies.lm import load_model_and_tokenizer

            lm, _ = load_model_and_tokenizer(cfg.model, cfg.task, cfg.run.seed)
            if hasattr(lm.config, "vision_config"):  # a VLM: its image-reading backbone under a value head
                return cls(VisionValueModel.of(lm, cfg.model.freeze_vision), device)
            conf = copy.deepcopy(lm.config)
            conf.num_labels = 1
            model = AutoModelForTokenClassification.from_config(conf).to(dtype)
            missing, unexpected = model.base_model.load_state_dict(lm.base_model.state_dict(), strict=False)
            if missing:
                raise UserError(f"critic: cannot copy the policy's backbone into a value model (missing {missing[:3]})")
            return cls(model, device)
        p = Path(source).expanduser()
        if not (p / "config.json").is_file():
            raise UserError(f"critic.path: '{source}' is not a model folder (no config.json in it)")
        try:
            model = AutoModelForTokenClassification.from_pretrained(str(p), num_labels=1, dtype=dtype)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"critic.path: cannot load '{source}' as a value model: {first}") from None
        return cls(model, device)

    def values(self, batch: LMRollout) -> torch.Tensor:
        """V (B, T) of the state before each response token: read at the position whose logits
        predict that token, so V_t scores (prompt, response[:t])."""
        out = self.forward_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=model_positions(batch.position_ids),
                                 **image_args(self.model, batch.input_ids, batch.vision))
        return out.logits[:, batch.prompt_width - 1 : -1, 0].float()

    @torch.no_grad()
    def values_in_chunks(self, batch: LMRollout, chunk: int) -> torch.Tensor:
        """V (B, T) of the whole batch; under torchrun each rank computes its share of the rows."""
        d = self.dist
        rows = d.my_rows(torch.arange(len(batch.completions)))
        return d.gather_rows(torch.cat([self.values(batch.select(i)) for i in rows.split(max(chunk // d.world, 1))]))

    def train_minibatch(
        self, opt, batch: LMRollout, idx: torch.Tensor, micro: int, old_values: torch.Tensor,
        returns: torch.Tensor, mask: torch.Tensor, clip: float | None, agg: str, norm: float, grad_clip: float,
    ) -> dict[str, float]:
        """One optimizer step on the minibatch `idx`, accumulated over micro-batches (same
        denominators as the whole minibatch, so the loss is exactly the minibatch's); under
        torchrun each rank takes its share of the rows, as the policy's update does."""
        d = self.dist
        denoms = batch_denominators(mask[idx])
        opt.zero_grad(set_to_none=True)
        out: dict[str, float] = {}
        for part in d.my_rows(idx).split(micro):
            v = self.values(batch.select(part))
            loss, m = value_loss(v, old_values[part], returns[part], mask[part], clip, agg, norm, denoms)
            if not d.all_true(bool(torch.isfinite(loss))):
                opt.zero_grad(set_to_none=True)
                return {"critic/nonfinite_skipped": 1.0}
            (loss * d.loss_scale).backward()
            w = len(part) / len(idx)
            for k, val in m.items():
                out[f"critic/{k}"] = out.get(f"critic/{k}", 0.0) + (1.0 if k == "value_loss" else w) * float(val)
        out = d.sum_floats(out)
        params = [p for g in opt.param_groups for p in g["params"]]  # FSDP2: the sharded ones
        norm_ = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        norm_ = norm_.full_tensor() if hasattr(norm_, "full_tensor") else norm_
        if not torch.isfinite(norm_):
            opt.zero_grad(set_to_none=True)
            return {"critic/nonfinite_skipped": 1.0}
        opt.step()
        out["critic/grad_norm"] = float(norm_)
        return out

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        """state_dict: the gathered weights of a sharded (FSDP2) critic."""
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)


VALUE_HEAD = "value_head.safetensors"


class VisionValueModel(torch.nn.Module):
    """A vision-language model's critic: its multimodal backbone (vision tower, projector, language
    model: what the policy reads the images with) and a linear value head on the last hidden state.
    transformers has no token-classification class for VLMs, so the folder is the backbone's own
    save_pretrained (AutoModel loads it) and the head beside it in value_head.safetensors."""

    def __init__(self, backbone, freeze_vision: bool | None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.get_text_config().hidden_size
        self.head = torch.nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        torch.nn.init.normal_(self.head.weight, std=0.02)
        torch.nn.init.zeros_(self.head.bias)
        if freeze_vision is None or freeze_vision:  # as the policy's (model.freeze_vision)
            for n, p in self.backbone.named_parameters():
                if any(part in n for part in VISION_PARTS):
                    p.requires_grad_(False)

    @classmethod
    def of(cls, vlm, freeze_vision: bool | None) -> VisionValueModel:
        """Around a loaded ...ForConditionalGeneration: its `.model` (the backbone without the LM head)."""
        return cls(vlm.model, freeze_vision)

    @classmethod
    def load(cls, folder: str, dtype, freeze_vision: bool | None) -> VisionValueModel:
        from safetensors.torch import load_file
        from transformers import AutoModel, AutoModelForImageTextToText

        head = Path(folder) / VALUE_HEAD
        try:
            if head.is_file():  # a critic folder of ours: the backbone and the head
                model = cls(AutoModel.from_pretrained(folder, dtype=dtype), freeze_vision)
                model.head.load_state_dict(load_file(str(head)))
                return model
            return cls.of(AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype), freeze_vision)
        except (OSError, ValueError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"critic: cannot load the vision-language value model '{folder}': {first}") from None

    @property
    def config(self):  # the backbone's (what image_args reads: its family and image token)
        return self.backbone.config

    def forward(self, **kwargs):
        hidden = self.backbone(**kwargs).last_hidden_state
        return SimpleNamespace(logits=self.head(hidden))

    def save_pretrained(self, folder, safe_serialization: bool = True, state_dict: dict | None = None) -> None:
        from safetensors.torch import save_file

        state_dict = state_dict if state_dict is not None else self.state_dict()
        self.backbone.save_pretrained(folder, safe_serialization=safe_serialization,
                                      state_dict={k[len("backbone."):]: v for k, v in state_dict.items()
                                                  if k.startswith("backbone.")})
        save_file({k[len("head."):]: v.contiguous() for k, v in state_dict.items() if k.startswith("head.")},
                  str(Path(folder) / VALUE_HEAD))
