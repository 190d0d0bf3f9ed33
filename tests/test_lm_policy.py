import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from regen.config import ModelConfig, TaskConfig
from regen.errors import UserError
from regen.policies.lm import LMPolicy, load_model_and_tokenizer, sample_token
from regen.tasks.arithmetic import build_model

PROMPTS = ["7+5=", "13+58=", "0+0=", "99+1="]  # different lengths -> left padding


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m")
    model, tok = build_model(seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture()
def policy(saved):
    model, tok = load_model_and_tokenizer(ModelConfig(path=str(saved)), TaskConfig(), seed=0)
    p = LMPolicy(model, tok, torch.device("cpu"))
    p.model.eval()
    return p


def test_tokenizer_round_trips_without_spaces(saved):
    tok = AutoTokenizer.from_pretrained(saved)
    ids = tok("12+34=")["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "12+34="


def test_greedy_kv_cached_sampling_matches_transformers_generate(policy):
    gen = torch.Generator().manual_seed(0)
    ro = policy.sample(PROMPTS, 1, 1.0, 1.0, 6, gen, greedy=True)
    tok = policy.tokenizer
    enc = tok(PROMPTS, padding=True, padding_side="left", return_tensors="pt")
    ref = policy.model.generate(
        **enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )[:, enc["input_ids"].shape[1]:]
    for row in range(len(PROMPTS)):
        n = int(ro.response_mask[row].sum())
        assert ro.response_ids[row, :n].tolist() == ref[row, :n].tolist()


def test_logprobs_do_not_depend_on_left_padding(policy):
    gen = torch.Generator().manual_seed(1)
    batch = policy.sample(PROMPTS, 2, 1.0, 1.0, 5, gen)
    logp, _ = policy.token_logprobs(batch, temperature=1.0)
    for row in (0, 5):  # a short and a long prompt
        alone = batch.select(torch.tensor([row]))
        pad = int((alone.attention_mask[0, : alone.prompt_width] == 0).sum())
        alone.input_ids, alone.attention_mask = alone.input_ids[:, pad:], alone.attention_mask[:, pad:]
        alone.prompt_width -= pad
        lp, _ = policy.token_logprobs(alone, temperature=1.0)
        m = batch.response_mask[row].bool()
        torch.testing.assert_close(lp[0][m], logp[row][m], atol=1e-5, rtol=1e-5)


def test_masks_after_eos_and_groups(policy):
    gen = torch.Generator().manual_seed(2)
    ro = policy.sample(PROMPTS, 3, 1.5, 1.0, 6, gen)
    assert ro.input_ids.shape[0] == 12 and len(ro.completions) == 12
    eos, pad = policy.eos_id, policy.pad_id
    for row in range(12):
        toks = ro.response_ids[row].tolist()
        m = ro.response_mask[row].tolist()
        if eos in toks:
            k = toks.index(eos)
            assert m == [1.0] * (k + 1) + [0.0] * (len(toks) - k - 1)  # EOS is an action: it is trained
            assert all(t == pad for t in toks[k + 1:]) and bool(ro.finished[row])
        else:
            assert all(v == 1.0 for v in m) and not bool(ro.finished[row])
        assert "<eos>" not in ro.completions[row] and "<pad>" not in ro.completions[row]


def test_same_seed_same_samples(policy):
    a = policy.sample(PROMPTS, 2, 1.0, 1.0, 5, torch.Generator().manual_seed(9))
    b = policy.sample(PROMPTS, 2, 1.0, 1.0, 5, torch.Generator().manual_seed(9))
    assert torch.equal(a.input_ids, b.input_ids)


def test_top_p_keeps_only_the_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: the smallest prefix reaching 0.7 is {0, 1}
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    draws = sample_token(logits, 1.0, 0.7, torch.rand(4000, generator=torch.Generator().manual_seed(0)))
    assert set(draws.tolist()) == {0, 1}
    # renormalised inside the nucleus: P(0) = 0.5 / 0.8 = 0.625
    assert abs((draws == 0).float().mean().item() - 0.625) < 0.03


def test_inverse_cdf_draws_follow_the_cumulative_probabilities():
    # probs 0.5, 0.3, 0.15, 0.05 -> cdf 0.5, 0.8, 0.95, 1.0: u picks the first token whose cdf exceeds u
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(6, 1)
    u = torch.tensor([0.0, 0.49, 0.5, 0.79, 0.81, 0.96])
    assert sample_token(logits, 1.0, 1.0, u).tolist() == [0, 0, 1, 1, 2, 3]
    # nucleus 0.7 keeps {0, 1} (mass 0.8): u * 0.8 against cdf 0.5, 0.8 -> 0.6*0.8=0.48 -> 0; 0.7*0.8=0.56 -> 1
    assert sample_token(logits[:2], 1.0, 0.7, torch.tensor([0.6, 0.7])).tolist() == [0, 1]
    # a zero-probability token is never drawn, even when u lands exactly on its cdf
    zero = torch.log(torch.tensor([[0.5, 0.0, 0.5]]))
    assert sample_token(zero, 1.0, 1.0, torch.tensor([0.5])).tolist() == [2]


def test_a_slice_of_the_batch_samples_the_same_rows_with_its_uniforms(policy):
    # what torchrun data parallelism relies on: a rank samples its groups with its slice of the uniforms
    u = torch.rand(len(PROMPTS) * 2, 6, generator=torch.Generator().manual_seed(3))
    whole = policy.sample(PROMPTS, 2, 1.0, 1.0, 6, None, uniforms=u)
    for lo, hi in ((0, 2), (2, 4)):
        part = policy.sample(PROMPTS[lo:hi], 2, 1.0, 1.0, 6, None, uniforms=u[2 * lo : 2 * hi])
        assert part.completions == whole.completions[2 * lo : 2 * hi]
    assert len(set(whole.completions)) > 2  # really sampled, not greedy


def test_sampled_log_probs_are_the_ones_token_logprobs_computes(policy):
    # what rollout workers return as the behaviour policy's log-probs: the same function the
    # trainer's token_logprobs computes (softmax of logits / temperature; top-p only filters)
    batch = policy.sample(PROMPTS, 3, 1.5, 0.8, 6, torch.Generator().manual_seed(2), with_logp=True)
    ref, _ = policy.token_logprobs(batch, 1.5)
    m = batch.response_mask.bool()
    torch.testing.assert_close(batch.behaviour_logp[m], ref[m], atol=1e-5, rtol=1e-5)
    assert (batch.behaviour_logp[~m] == 0).all() and (batch.behaviour_logp[m] < 0).any()


def test_temperature_sharpens():
    logits = torch.log(torch.tensor([[0.6, 0.4]])).repeat(4000, 1)
    draws = sample_token(logits, 0.5, 1.0, torch.rand(4000, generator=torch.Generator().manual_seed(0)))
    # softmax(log p / 0.5) = p^2 / sum p^2 = 0.36 / 0.52 = 0.6923
    assert abs((draws == 0).float().mean().item() - 0.36 / 0.52) < 0.03


def test_reference_copy_only_when_asked(saved):
    model, tok = load_model_and_tokenizer(ModelConfig(path=str(saved)), TaskConfig(), 0)
    assert LMPolicy(model, tok, torch.device("cpu")).ref is None
    p = LMPolicy(model, tok, torch.device("cpu"), reference="copy")
    assert p.ref is not model and not any(q.requires_grad for q in p.ref.parameters())


def test_missing_and_invalid_model_folders(tmp_path):
    with pytest.raises(UserError, match="model.path: folder .* not found"):
        load_model_and_tokenizer(ModelConfig(path=str(tmp_path / "nope")), TaskConfig(), 0)
    with pytest.raises(UserError, match="not a model folder"):
        load_model_and_tokenizer(ModelConfig(path=str(tmp_path)), TaskConfig(), 0)
    with pytest.raises(UserError, match="unknown recipe"):
        load_model_and_tokenizer(ModelConfig(init="gpt-17"), TaskConfig(), 0)


def test_export_loads_with_auto_classes(policy, tmp_path):
    policy.save_pretrained(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    for a, b in zip(model.state_dict().values(), policy.model.state_dict().values()):
        assert torch.equal(a, b)
    assert tok.decode(tok("3+4=")["input_ids"]) == "3+4="


def test_shared_prompt_prefix_gives_the_same_logprobs_and_gradients(policy):
    # Groups of 3 completions per prompt; the shared-prefix path runs each prompt once.
    batch = policy.sample(PROMPTS, 3, 1.0, 1.0, 5, torch.Generator().manual_seed(4))
    grads = []
    for group_size in (1, 3):
        policy.model.zero_grad()
        logp, _ = policy.token_logprobs(batch, temperature=0.7, group_size=group_size)
        (logp * batch.response_mask).sum().backward()
        grads.append({k: p.grad.clone() for k, p in policy.model.named_parameters()})
        if group_size == 1:
            plain = logp.detach()
    m = batch.response_mask.bool()
    torch.testing.assert_close(logp.detach()[m], plain[m], atol=1e-5, rtol=1e-5)
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5, rtol=1e-4)


def test_shared_prefix_gradients_are_bitwise_the_same_run_after_run_at_two_threads():
    # Each prompt's KV cache is repeated across its group: the backward of that repeat must add in a
    # fixed order. Advanced indexing (x[inv]) adds with index_put_(accumulate=True), whose order varies
    # with the threads on CPU, and two identical GRPO runs drifted apart from their second step.
    from regen.tasks.calc import build_model as calc_model
    from regen.tasks.calc import prompts

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, tok = calc_model(0)
        p = LMPolicy(model.eval(), tok, torch.device("cpu"))
        items = prompts("train", 4, 500)[:8]
        batch = p.sample(p.inputs(items), 8, 1.0, 1.0, 96, torch.Generator().manual_seed(0))
        grads = []
        for _ in range(3):
            model.zero_grad()
            logp, _ = p.token_logprobs(batch, 1.0, group_size=8)
            (logp * batch.response_mask).sum().backward()
            grads.append([q.grad.clone() for q in model.parameters()])
    finally:
        torch.set_num_threads(threads)
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


def test_shared_prefix_with_single_token_responses(policy):
    batch = policy.sample(PROMPTS, 2, 1.0, 1.0, 1, torch.Generator().manual_seed(5))
    assert batch.response_ids.shape[1] == 1
    a, _ = policy.token_logprobs(batch, 1.0)
    b, _ = policy.token_logprobs(batch, 1.0, group_size=2)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_concatenated_rollouts_keep_their_logprobs(policy):
    from regen.policies.lm import concat_rollouts

    a = policy.sample(["7+5=", "0+0="], 2, 1.0, 1.0, 3, torch.Generator().manual_seed(6))
    b = policy.sample(["13+58="], 2, 1.0, 1.0, 6, torch.Generator().manual_seed(7))
    both = concat_rollouts([a, b], policy.pad_id)
    assert both.input_ids.shape[0] == 6 and both.completions == a.completions + b.completions
    lp_both, _ = policy.token_logprobs(both, 1.0, group_size=2)
    for part, rows in ((a, slice(0, 4)), (b, slice(4, 6))):
        lp, _ = policy.token_logprobs(part, 1.0)
        t = part.response_ids.shape[1]
        m = part.response_mask.bool()
        torch.testing.assert_close(lp_both[rows, :t][m], lp[m], atol=1e-5, rtol=1e-5)
        assert both.response_mask[rows, t:].sum() == 0  # padding is masked
