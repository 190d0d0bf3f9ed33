"""Chat-template prompts (data.chat_template): each held-out or training row becomes the text an
instruct model expects, rendered by its tokenizer's own template with add_generation_prompt, so
the model writes the assistant turn.

A row is either {"prompt": "..."} (one user turn) or {"messages": [{"role": ..., "content": ...},
...]} ending in a user turn; data.system_prompt puts a system turn first where a row has none.
The rendered text becomes the prompt the policy samples from (tokenised without adding special
tokens again: the template wrote them), and the row's messages stay in Sample.meta["messages"]
for rewards that want the conversation (a reward model with its own template).
"""

from __future__ import annotations

from regen.data import PromptItem
from regen.errors import DataError, UserError


def messages_of(row_prompt: str | None, meta: dict, where: str, i: int) -> list[dict]:
    msgs = meta.get("messages")
    if msgs is None:
        if not isinstance(row_prompt, str):
            raise DataError(f"{where}: row {i + 1} has neither 'prompt' (text) nor 'messages'")
        return [{"role": "user", "content": row_prompt}]
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
        raise DataError(f"{where}: row {i + 1}: 'messages' must be a non-empty list of {{role, content}} strings")
    if msgs[-1]["role"] != "user":
        raise DataError(f"{where}: row {i + 1}: the last message is '{msgs[-1]['role']}'; it must be the user turn "
                        "the model answers")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def with_image(msgs: list[dict], image_token: str) -> list[dict]:
    """A vision-language prompt's conversation as processors' templates expect it: the last user
    turn's content as [{"type": "image"}, {"type": "text", ...}], unless its text already places
    the image token itself."""
    last = msgs[-1]
    if image_token in last["content"]:
        return msgs
    return [*msgs[:-1], {"role": last["role"], "content": [{"type": "image"}, {"type": "text", "text": last["content"]}]}]


def render(items: list[PromptItem], tokenizer, system_prompt: str | None, where: str) -> list[PromptItem]:
    """Each item's prompt rendered with the tokenizer's (or a vision-language model's processor's)
    chat template and add_generation_prompt; an item's image stays with it."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("data.chat_template: the model's tokenizer has no chat template (tokenizer_config.json "
                        "'chat_template', or a vision-language processor's chat_template.jinja); use an instruct "
                        "model's folder, or data.chat_template: false")
    out = []
    for i, it in enumerate(items):
        msgs = messages_of(it.prompt, it.meta, where, i)
        if system_prompt is not None and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": system_prompt}, *msgs]
        shown = with_image(msgs, tokenizer.image_token) if it.image is not None and is_processor(tokenizer) else msgs
        try:
            text = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001  (a Jinja error names what the template expected)
            raise DataError(f"{where}: row {i + 1}: the chat template failed ({type(e).__name__}: {e})") from None
        out.append(PromptItem(text, {**it.meta, "messages": msgs}, it.image))
    return out


def is_processor(obj) -> bool:
    """A vision-language model's processor (a tokenizer with an image processor), not a plain tokenizer."""
    return hasattr(obj, "image_processor") and hasattr(obj, "tokenizer")
