"""data.chat_template: prompts rendered by the tokenizer's own Jinja template, tokenised exactly as
apply_chat_template does, completions ended by the end-of-turn token, and the reward reading the
assistant turn only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from regen.cli import main
from regen.config import RLConfig, load_config
from regen.data import PromptItem
from regen.data.chat import render
from regen.errors import DataError, UserError
from regen.policies.lm import LMPolicy, configure_prompts, stop_ids

# Qwen / ChatML style: <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The arithmetic GPT-2 with two added special tokens, a ChatML template and <|im_end|> as
    an end-of-turn id in its generation_config, saved as a normal model folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from regen.tasks.arithmetic import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=32, n_layer=1, n_head=2,
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    tok.chat_template = CHATML
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    folder = tmp_path_factory.mktemp("chat") / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _policy(folder: Path, *settings: str) -> LMPolicy:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = load_config(RLConfig, None, [f"model.path={folder}", "data.chat_template=true", *settings])
    policy = LMPolicy(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                      torch.device("cpu"))
    configure_prompts(policy, cfg)
    return policy


def test_prompts_are_tokenised_exactly_as_apply_chat_template(chat_model):
    policy = _policy(chat_model)
    tok = policy.tokenizer
    rows = [PromptItem("12+30=", {"answer": "42"}),
            PromptItem(None, {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "7+8="}]})]
    items = render(rows, tok, None, "data.train")
    ro = policy.sample([it.prompt for it in items], 1, 1.0, 1.0, 3, torch.Generator().manual_seed(0))
    for i, it in enumerate(items):
        want = tok.apply_chat_template(it.meta["messages"], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        got = ro.input_ids[i, : ro.prompt_width][ro.attention_mask[i, : ro.prompt_width].bool()].tolist()
        assert got == list(want)
    assert items[0].meta["messages"] == [{"role": "user", "content": "12+30="}] and items[0].meta["answer"] == "42"


def test_a_system_prompt_goes_first_unless_the_row_has_one(chat_model):
    policy = _policy(chat_model)
    rows = [PromptItem("1+1=", {}), PromptItem(None, {"messages": [{"role": "system", "content": "own"},
                                                                     {"role": "user", "content": "2+2="}]})]
    a, b = render(rows, policy.tokenizer, "you add", "data.eval")
    assert a.prompt.startswith("<|im_start|>system\nyou add<|im_end|>\n<|im_start|>user\n1+1=")
    assert a.prompt.endswith("<|im_start|>assistant\n")
    assert b.prompt.startswith("<|im_start|>system\nown<|im_end|>") and "you add" not in b.prompt


@pytest.mark.parametrize("meta,message", [
    ({"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]},
     "row 1: the last message is 'assistant'"),
    ({"messages": "1+1="}, "row 1: 'messages' must be a non-empty list"),
    ({}, "row 1 has neither 'prompt' (text) nor 'messages'"),
])
def test_malformed_conversations_are_refused_by_row(chat_model, meta, message):
    policy = _policy(chat_model)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        render([PromptItem(None, meta)], policy.tokenizer, None, "data.train")


def test_completions_end_at_the_end_of_turn_token(chat_model):
    policy = _policy(chat_model)
    tok = policy.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_ids(policy.model, tok) == sorted({tok.eos_token_id, im_end})  # from generation_config
    prompt = render([PromptItem("12+30=", {})], tok, None, "x")[0].prompt
    greedy = policy.sample([prompt], 1, 1.0, 1.0, 6, torch.Generator(), greedy=True)
    first = greedy.input_ids[0, greedy.prompt_width].item()
    assert first not in policy.stop_ids
    # the first token the model writes made a stop token (rollout.stop_tokens): nothing is kept of it
    stopped = _policy(chat_model, f"rollout.stop_tokens=['{tok.convert_ids_to_tokens(first)}']")
    ro = stopped.sample([prompt], 1, 1.0, 1.0, 6, torch.Generator(), greedy=True)
    assert ro.finished.tolist() == [True] and ro.completions == [""] and ro.response_mask[0].sum() == 1
    with pytest.raises(UserError, match="'<|im_x|>' is not one token"):
        _policy(chat_model, "rollout.stop_tokens=['<|im_x|>']")


def test_a_tokenizer_without_a_template_is_one_clear_error(base_model, tmp_path, capsys):
    rc = main(["train", f"model.path={base_model}", f"run.dir={tmp_path / 'r'}", "data.chat_template=true"])
    assert rc == 2 and "the model's tokenizer has no chat template" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_sft_refuses_the_chat_template():
    from regen.config import SFTConfig
    from regen.errors import ConfigError

    with pytest.raises(ConfigError, match="chat templates are for `regen train`"):
        load_config(SFTConfig, None, ["model.init=arith-char-gpt2", "data.chat_template=true"])


def test_a_template_that_renders_the_plain_prompt_gives_the_plain_run(base_model, tmp_path):
    """The arithmetic model with a template that writes the user's text and nothing else: RL on
    'messages' rows samples, scores and trains exactly as on plain 'prompt' rows."""
    folder = tmp_path / "m"
    shutil.copytree(base_model, folder)
    cfg_path = folder / "tokenizer_config.json"
    conf = json.loads(cfg_path.read_text())
    conf["chat_template"] = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    cfg_path.write_text(json.dumps(conf))
    pairs = list(zip(range(10, 26), range(40, 56)))
    chat, plain = tmp_path / "chat.jsonl", tmp_path / "plain.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
                            + "\n" for a, b in pairs))
    plain.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in pairs))
    common = [f"model.path={folder}", "eval.num_prompts=16", "train.steps=2", "rollout.global_batch_size=8",
              "rollout.group_size=4", "log.progress=none", "log.tensorboard=false", "checkpoint.every=0"]
    for name, data, extra in (("chat", chat, ["data.chat_template=true"]), ("plain", plain, [])):
        assert main(["train", *common, f"run.dir={tmp_path / name}", f"data.train={data}", f"data.eval={data}",
                     *extra]) == 0

    def rows(name):
        return [json.loads(x) for x in (tmp_path / name / "samples" / "step_00000002.jsonl").read_text().splitlines()]

    assert rows("chat") == rows("plain")  # the reward saw the same assistant turns
    from tests.conftest import export_weights

    a, b = export_weights(tmp_path / "chat"), export_weights(tmp_path / "plain")
    assert all(torch.equal(a[k], b[k]) for k in a)
