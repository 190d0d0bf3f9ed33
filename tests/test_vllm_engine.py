"""rollout.engine=vllm without vLLM (never installed in CI): a clear error; and the conversion of
vLLM's token lists into a rollout, checked against regen's own sampler's rollout."""

import torch

from regen.cli import main
from regen.config import ModelConfig, TaskConfig
from regen.policies.lm import LMPolicy, load_model_and_tokenizer
from regen.policies.lm_vllm import build_rollout


def test_vllm_engine_missing_is_a_clear_error(base_model, tmp_path, capsys):
    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path / 'r'}", "rollout.engine=vllm",
                 "log.progress=none"]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine=vllm" in err and ("not installed" in err or "CUDA" in err)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_token_lists_become_the_rollout_regens_sampler_builds(base_model):
    model, tok = load_model_and_tokenizer(ModelConfig(path=str(base_model)), TaskConfig(), 0)
    policy = LMPolicy(model, tok, torch.device("cpu"))
    prompts = ["7+5=", "13+58=", "0+0="]
    ro = policy.sample(prompts, 2, 1.0, 1.0, 3, torch.Generator().manual_seed(0))
    # what vLLM hands back: unpadded prompt ids, and generated ids (EOS included when it stopped)
    prompt_ids = [tok(p)["input_ids"] for p in prompts for _ in range(2)]
    responses = [ro.response_ids[i][ro.response_mask[i].bool()].tolist() for i in range(6)]
    assert any(ro.finished) and not all(ro.finished)  # both kinds of rows are checked
    built = build_rollout(prompt_ids, responses, ro.completions, policy.pad_id, policy.eos_id, policy.device)
    T = built.response_ids.shape[1]
    assert built.prompt_width == ro.prompt_width
    assert torch.equal(built.input_ids, ro.input_ids[:, : ro.prompt_width + T])
    assert torch.equal(built.attention_mask, ro.attention_mask[:, : ro.prompt_width + T])
    assert torch.equal(built.response_mask, ro.response_mask[:, :T]) and ro.response_mask[:, T:].sum() == 0
    assert torch.equal(built.finished, ro.finished)
    # and the trained model scores the built rollout exactly as its own
    lp_built, _ = policy.token_logprobs(built, 1.0)
    lp_own, _ = policy.token_logprobs(ro, 1.0)
    m = built.response_mask.bool()
    torch.testing.assert_close(lp_built[m], lp_own[:, :T][m])


class Target:
    """A stand-in for vLLM's model: records what load_weights got."""

    def __init__(self):
        self.got = None

    def load_weights(self, weights):
        self.got = dict(weights)


def nest(path: str, leaf):
    """An object with `leaf` at the dotted `path` (each level a plain namespace)."""
    from types import SimpleNamespace

    obj = leaf
    for part in reversed(path.split(".")):
        obj = SimpleNamespace(**{part: obj})
    return obj


def test_the_weights_reach_vllms_model_wherever_its_version_keeps_it():
    import pytest

    from regen.errors import UserError
    from regen.policies.lm_vllm import MODEL_PATHS, push_weights

    weights = {"w": torch.ones(2), "b": torch.zeros(1)}
    for path in MODEL_PATHS:  # each engine generation's place, alone
        target = Target()
        assert push_weights(nest(path, target), iter(weights.items())) == path
        assert target.got.keys() == weights.keys() and torch.equal(target.got["w"], weights["w"])

    class Remote:  # workers in other processes: the tensors go through collective_rpc to each worker's model
        def __init__(self):
            self.worker = nest("model_runner.model", Target())

        def collective_rpc(self, fn, args=()):
            return [fn(self.worker, *args)]

    llm = Remote()
    assert push_weights(llm, iter(weights.items())) == "collective_rpc"
    assert llm.worker.model_runner.model.got.keys() == weights.keys()
    with pytest.raises(UserError, match="neither its model in-process"):
        push_weights(object(), iter(weights.items()))


SMALL = ["rollout.global_batch_size=16", "rollout.group_size=4", "rollout.max_new_tokens=4", "train.steps=3",
         "data.eval=null", "log.progress=none", "log.tensorboard=false", "run.threads=1", "optim.lr=1e-3"]


def test_vllm_in_the_trainers_process_sleeps_for_each_update_and_takes_its_weights(base_model, tmp_path,
                                                                                  stand_in_vllm):
    """regen/policies/lm_vllm.py run for real against tests/stand_in_vllm (vLLM's interface on the CPU):
    colocated, the engine samples each step, sleeps for the update, wakes and takes the new weights."""
    from tests.conftest import export_weights, vllm_engines

    run = tmp_path / "r"
    assert main(["train", f"model.path={base_model}", f"run.dir={run}", "rollout.engine=vllm",
                 "distributed.colocate=true", *SMALL]) == 0
    [(calls, weights)] = vllm_engines(stand_in_vllm).values()
    n = len(weights)
    step = ["generate 4", "sleep 1", "wake", f"load {n}", "reset"]  # 4 prompts x group 4, then the update
    assert calls == ["init tp=1 sleep_mode=True", f"load {n}", "reset", *step * 3]
    final = {k.split(":", 1)[1]: v for k, v in export_weights(run).items()}
    assert final and all(torch.equal(weights[k], v) for k, v in final.items())  # it samples with the trained weights


def test_vllm_placements_that_cannot_work_are_refused_by_name(base_model, tmp_path, capsys):
    base = ["train", f"model.path={base_model}", "rollout.engine=vllm", "log.progress=none", "distributed.mode=ray"]
    cases = [(["distributed.max_staleness=1"], "max_staleness=1"),
             (["rollout.vllm_tensor_parallel=2"], "rollout_resources.num_gpus is 0"),
             (["distributed.trainer_workers=2"], "on the ranks of a Ray trainer group")]
    for i, (extra, words) in enumerate(cases):
        run = tmp_path / f"r{i}"
        assert main([*base, *extra, f"run.dir={run}"]) == 2
        err = capsys.readouterr().err
        assert "rollout.engine=vllm" in err or "rollout.vllm_tensor_parallel" in err
        assert words in err, err
        assert not (run / "checkpoints").exists()
