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
    return _checked(msgs, "user", "it must be the user turn the model answers", where, i)


def _checked(msgs, last: str, why: str, where: str, i: int) -> list[dict]:
    """A row's 'messages' as plain {role, content} dicts, ending with a `last` turn; DataError naming the row."""
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
        raise DataError(f"{where}: row {i + 1}: 'messages' must be a non-empty list of {{role, content}} strings")
    if msgs[-1]["role"] != last:
        raise DataError(f"{where}: row {i + 1}: the last message is '{msgs[-1]['role']}'; {why}")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def with_image(msgs: list[dict], image_token: str, count: int = 1) -> list[dict]:
    """A vision-language prompt's conversation as processors' templates expect it: the last user
    turn's content as [{"type": "image"} x count, {"type": "text", ...}], unless its text already
    places the image token itself."""
    last = msgs[-1]
    if image_token in last["content"]:
        return msgs
    return [*msgs[:-1], {"role": last["role"],
                         "content": [{"type": "image"}] * count + [{"type": "text", "text": last["content"]}]}]


def _shown(msgs: list[dict], image, tokenizer, first_user: bool = False) -> list[dict]:
    """The conversation the template renders: a VLM's image(s) placed (with_image) in the last turn
    (a prompt), or in the first user turn (a demonstration, whose later turns include its answers)."""
    if image is None or not is_processor(tokenizer):
        return msgs
    u = next(k for k, m in enumerate(msgs) if m["role"] == "user") if first_user else len(msgs) - 1
    count = len(image) if isinstance(image, list) else 1
    return [*msgs[:u], *with_image(msgs[: u + 1], tokenizer.image_token, count)[-1:], *msgs[u + 1:]]


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("data.chat_template: the model's tokenizer has no chat template (tokenizer_config.json "
                        "'chat_template', or a vision-language processor's chat_template.jinja); use an instruct "
                        "model's folder, or data.chat_template: false")


def _with_system(msgs: list[dict], system_prompt: str | None) -> list[dict]:
    if system_prompt is not None and msgs[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *msgs]
    return msgs


def _template(tokenizer, msgs: list, generation: bool, where: str, i: int, tools: list | None = None) -> str:
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation,
                                             **({"tools": tools} if tools else {}))
    except Exception as e:  # noqa: BLE001  (a Jinja error names what the template expected)
        raise DataError(f"{where}: row {i + 1}: the chat template failed ({type(e).__name__}: {e})") from None


def render(items: list[PromptItem], tokenizer, system_prompt: str | None, where: str,
           tools: list | None = None) -> list[PromptItem]:
    """Each item's prompt rendered with the tokenizer's (or a vision-language model's processor's)
    chat template and add_generation_prompt; an item's image stays with it. tools: JSON-schema tool
    specs the template shows the model (an environment's, see regen/envs/tools.py)."""
    _require_template(tokenizer)
    out = []
    for i, it in enumerate(items):
        msgs = _with_system(messages_of(it.prompt, it.meta, where, i), system_prompt)
        shown = _shown(msgs, it.image, tokenizer)
        out.append(PromptItem(_template(tokenizer, shown, True, where, i, tools), {**it.meta, "messages": msgs},
                              it.image))
    return out


def _conversation(d, where: str, i: int) -> list[dict]:
    """A demonstration's turns: its 'messages' (ending in an assistant turn), or its prompt and completion as
    one user and one assistant turn."""
    msgs = d.meta.get("messages")
    if msgs is None:
        if not isinstance(d.prompt, str) or not isinstance(d.completion, str):
            raise DataError(f"{where}: row {i + 1} has neither 'prompt' and 'completion' (text) nor 'messages'")
        return [{"role": "user", "content": d.prompt}, {"role": "assistant", "content": d.completion}]
    return _checked(msgs, "assistant", "a demonstration ends with the assistant turn the model learns to write", where, i)


def render_demos(demos: list, tokenizer, system_prompt: str | None, where: str) -> list:
    """Each demonstration as the text the chat template writes for its conversation, in (text, trained)
    pieces: every assistant turn with the template's end-of-turn marks is trained on, the rest (system,
    user and tool turns, the template's headers) is context. The pieces come from rendering the
    conversation turn by turn (up to each assistant turn with add_generation_prompt, then through it);
    a template that rewrites earlier turns when a later one is added (some drop an earlier turn's
    reasoning) cannot be cut that way and is one error naming the row."""
    from regen.data import Demo

    _require_template(tokenizer)
    out = []
    for i, d in enumerate(demos):
        msgs = _with_system(_conversation(d, where, i), system_prompt)
        shown = _shown(msgs, d.image, tokenizer, first_user=True)
        pieces, done, before = [], "", ""
        for j, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = _template(tokenizer, shown[:j], True, where, i)
            through = _template(tokenizer, shown[: j + 1], False, where, i)
            if not before.startswith(done) or not through.startswith(before) or len(through) == len(before):
                raise DataError(f"{where}: row {i + 1}: the chat template does not write the conversation turn by "
                                f"turn (adding turn {j + 1} changes the text before it), so the assistant's tokens "
                                "cannot be told apart; render the rows yourself as prompt/completion with "
                                "data.chat_template: false")
            pieces += [(before[len(done):], False), (through[len(before):], True)]
            done = through
        out.append(Demo(before, done[len(before):], {**d.meta, "messages": msgs}, d.image,
                        [(t, trained) for t, trained in pieces if t]))
    return out


def render_pairs(pairs: list, tokenizer, system_prompt: str | None, where: str) -> list:
    """Preference pairs whose prompt is a conversation (its 'messages', or the prompt as one user turn): the
    prompt rendered with add_generation_prompt, each response as the text the template writes for it as the
    assistant's turn (its end-of-turn marks included)."""
    from regen.data import PrefPair

    _require_template(tokenizer)
    out = []
    for i, p in enumerate(pairs):
        msgs = _with_system(messages_of(p.prompt, p.meta, where, i), system_prompt)
        shown = _shown(msgs, p.image, tokenizer)
        before = _template(tokenizer, shown, True, where, i)
        answers = []
        for which in (p.chosen, p.rejected):
            through = _template(tokenizer, [*shown, {"role": "assistant", "content": which}], False, where, i)
            if not through.startswith(before) or len(through) == len(before):
                raise DataError(f"{where}: row {i + 1}: the chat template does not write the assistant's turn after "
                                "the prompt it renders with add_generation_prompt; render the pairs yourself with "
                                "data.chat_template: false")
            answers.append(through[len(before):])
        out.append(PrefPair(before, *answers, {**p.meta, "messages": msgs}, p.image))
    return out


def is_processor(obj) -> bool:
    """A vision-language model's processor (a tokenizer with an image processor), not a plain tokenizer."""
    return hasattr(obj, "image_processor") and hasattr(obj, "tokenizer")
