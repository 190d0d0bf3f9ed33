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


CONVERSATION = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]


def test_sft_trains_on_every_assistant_turn_and_nothing_else(chat_model):
    """ChatML written out by hand: the labels spell the two assistant turns with their end-of-turn marks, the
    ids the whole conversation."""
    from transformers import AutoTokenizer

    from regen.data import Demo
    from regen.data.chat import render_demos
    from regen.offline.sft import IGNORE, encode_demos

    tok = AutoTokenizer.from_pretrained(chat_model)
    demos = render_demos([Demo(None, None, {"messages": CONVERSATION}), Demo("5+5=", "10")], tok, "sum", "data.train")
    ids, mask, labels, _ = encode_demos(demos, tok, 128)
    for i, (text, trained) in enumerate([
        ("<|im_start|>system\nsum<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
         "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n", "2<|im_end|>\n7<|im_end|>\n"),
        ("<|im_start|>system\nsum<|im_end|>\n<|im_start|>user\n5+5=<|im_end|>\n<|im_start|>assistant\n10<|im_end|>\n",
         "10<|im_end|>\n")]):
        n = int(mask[i].sum())
        assert ids[i, :n].tolist() == tok(text, add_special_tokens=False)["input_ids"]  # (letters are <unk> here)
        assert labels[i][labels[i] != IGNORE].tolist() == tok(trained, add_special_tokens=False)["input_ids"]
        assert (labels[i, :n][labels[i, :n] != IGNORE] == ids[i, :n][labels[i, :n] != IGNORE]).all()
    assert demos[1].prompt.endswith("<|im_start|>assistant\n") and demos[1].completion == "10<|im_end|>\n"


def test_dpo_pairs_answer_the_conversation_as_the_assistants_turn(chat_model):
    from transformers import AutoTokenizer

    from regen.data import PrefPair
    from regen.data.chat import render_pairs
    from regen.offline.dpo import _encode
    from regen.offline.sft import IGNORE

    tok = AutoTokenizer.from_pretrained(chat_model)
    [p] = render_pairs([PrefPair(None, "7", "8", {"messages": CONVERSATION[:3]})], tok, None, "data.train")
    assert p.prompt == ("<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n"
                        "3+4=<|im_end|>\n<|im_start|>assistant\n")
    assert (p.chosen, p.rejected) == ("7<|im_end|>\n", "8<|im_end|>\n")
    ids, mask, labels, _ = _encode([p], tok, 128, "chosen", "cpu", chat=True)
    assert ids[0].tolist() == tok(p.prompt + p.chosen, add_special_tokens=False)["input_ids"]  # no EOS added
    assert labels[0][labels[0] != IGNORE].tolist() == tok(p.chosen, add_special_tokens=False)["input_ids"]
    # without data.chat_template a row's own 'messages' column is only metadata: prompt + chosen + EOS as written
    plain = PrefPair("1+1=", "2", "3", {"messages": CONVERSATION})
    ids, mask, labels, _ = _encode([plain], tok, 128, "chosen", "cpu")
    assert labels[0][labels[0] != IGNORE].tolist() == tok("2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_a_template_that_rewrites_earlier_turns_is_refused_by_row(chat_model):
    from transformers import AutoTokenizer

    from regen.data import Demo
    from regen.data.chat import render_demos

    tok = AutoTokenizer.from_pretrained(chat_model)
    tok.chat_template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] if loop.last or m['role'] != "
                                       "'assistant' else '...' }}")  # as templates that drop earlier reasoning
    with pytest.raises(DataError, match="data.train: row 2: the chat template does not write the conversation turn"):
        render_demos([Demo("1+1=", "2"), Demo(None, None, {"messages": CONVERSATION})], tok, None, "data.train")
    with pytest.raises(DataError, match="row 1: the last message is 'user'"):
        render_demos([Demo(None, None, {"messages": CONVERSATION[:1]})], tok, None, "data.train")


def test_chat_sft_and_dpo_run_end_to_end(chat_model, tmp_path):
    """`regen sft` on conversations learns the assistant's answers; DPO on pairs whose prompt is a conversation
    prefers the chosen answers; both through the model's own template."""
    from safetensors.torch import load_file

    demos, pairs = tmp_path / "demos.jsonl", tmp_path / "pairs.jsonl"
    sums = [(a, b) for a in range(10, 20) for b in range(20, 24)]
    demos.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="},
                                                      {"role": "assistant", "content": str(a + b)}]}) + "\n"
                             for a, b in sums))
    # a preference the tiny model can learn in a few steps: always "1" over "0"
    pairs.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="}], "chosen": "1",
                                         "rejected": "0", "answer": "1"}) + "\n" for a, b in sums))
    quiet = ["log.progress=none", "log.tensorboard=false", "data.chat_template=true", "data.system_prompt=add"]
    assert main(["sft", f"model.path={chat_model}", f"run.dir={tmp_path / 'sft'}", f"data.train={demos}",
                 "data.eval=null", "sft.steps=30", "sft.global_batch_size=8", "optim.lr=3e-3", *quiet]) == 0
    loss = [r["loss"] for r in map(json.loads, (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]
    assert loss[-1] < 0.5 * loss[0]
    assert main(["train", "algorithm.name=dpo", f"model.path={tmp_path / 'sft' / 'export'}",
                 f"run.dir={tmp_path / 'dpo'}", f"data.train={pairs}", f"data.eval={pairs}", "eval.num_prompts=8",
                 "train.steps=20", "train.global_minibatch_size=8", "optim.lr=3e-3", *quiet]) == 0
    rows = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    margins = [r["rewards/margin"] for r in rows if "rewards/margin" in r]
    assert margins[0] == pytest.approx(0.0, abs=1e-6) and margins[-1] > 0.1  # the chosen answers pulled ahead
    acc = [r["eval/preference_accuracy"] for r in rows if "eval/preference_accuracy" in r]
    assert acc[-1] == 1.0
    assert load_file(str(tmp_path / "dpo" / "export" / "model.safetensors"))


def test_chat_keys_a_trainer_does_not_read_are_refused(tmp_path, capsys):
    assert main(["sft", "model.init=arith-char-gpt2", f"run.dir={tmp_path / 'a'}", "data.system_prompt=hi"]) == 2
    assert "data.system_prompt is read only with data.chat_template=true" in capsys.readouterr().err
    assert main(["sft", "model.init=shapes-unet", "data.train=builtin:shapes:train", f"run.dir={tmp_path / 'b'}",
                 "data.chat_template=true"]) == 2
    assert "data.chat_template is not read by `regen sft` of a flow model" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


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
