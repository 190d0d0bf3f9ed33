"""Multi-task runs (config `tasks:`): draws in proportion to the weights, the learning-progress
rule of dynamic weights against hand-computed values, rewards routed to each task's terms,
per-task metrics / evaluation / samples, exact resume, and the config errors."""

import json
import math

import pytest

from regen.cli import main
from regen.config import TaskMixConfig
from regen.data import PromptItem
from regen.data.tasks import TaskMix, TaskWeights, progress_weights, round_robin, task_metrics
from regen.rewards import Sample
from regen.rewards.tasks import TaskReward
from tests.conftest import read_jsonl, same_run

# ---------------------------------------------------------------- draws and weights


def test_round_robin_counts_stay_within_one_of_the_weights_at_every_prefix():
    weights = [5.0, 3.0, 2.0]  # shares 0.5, 0.3, 0.2
    credit, counts = [0.0, 0.0, 0.0], [0, 0, 0]
    for n in range(1, 201):
        (j,), credit = round_robin(credit, weights, 1)
        counts[j] += 1
        assert all(abs(c - n * w / 10) < 1 for c, w in zip(counts, weights)), (n, counts)
    assert counts == [100, 60, 40]
    # by hand: credits (.5 .3 .2) take 0 -> (-.5 .3 .2); (0 .6 .4) take 1 -> (0 -.4 .4); (.5 -.1 .6) take 2
    # -> (.5 -.1 -.4); (1 .2 -.2) take 0 -> (0 .2 -.2); (.5 .5 0): a tie, the first -> 0
    assert round_robin([0.0] * 3, weights, 5)[0] == [0, 1, 2, 0, 0]


def test_task_mix_takes_each_streams_own_order_and_resumes_it():
    sizes = [3, 5]
    mix = TaskMix(sizes, TaskWeights(["a", "b"], [1.0, 1.0], TaskMixConfig()), seed=4)
    first = mix.take(4)
    assert sum(i < 3 for i in first) == 2  # equal weights: two of four from each stream
    saved = mix.state()
    after = [mix.take(4) for _ in range(3)]
    again = TaskMix(sizes, TaskWeights(["a", "b"], [1.0, 1.0], TaskMixConfig()), seed=4)
    again.load_state(json.loads(json.dumps(saved)))  # through JSON, as in a checkpoint
    assert [again.take(4) for _ in range(3)] == after
    a_draws = [i for i in first + sum(after, []) if i < 3]
    assert sorted(a_draws[:3]) == [0, 1, 2]  # stream a: each of its prompts once per epoch


def test_progress_weights_match_the_formula_by_hand():
    # base 1 : 3 -> prior .25 / .75; LP = |.6 - .5| = .1 and |.2 - .4| = .2 -> .1/.3, .2/.3; floor .4
    got = progress_weights([1.0, 3.0], [0.6, 0.2], [0.5, 0.4], floor=0.4)
    assert got == pytest.approx([0.4 * 0.25 + 0.6 * (1 / 3), 0.4 * 0.75 + 0.6 * (2 / 3)], abs=1e-12)
    assert progress_weights([1.0, 3.0], [0.5, None], [0.5, None], floor=0.4) == [0.25, 0.75]  # no progress yet


def test_dynamic_weights_follow_the_ema_rule():
    w = TaskWeights(["a", "b"], [1.0, 1.0], TaskMixConfig(weights="dynamic", fast_rate=0.5, slow_rate=0.25, floor=0.2))
    w.observe({"a": 0.0, "b": 0.5})  # first values start both EMAs: no progress
    assert w.current() == [0.5, 0.5]
    w.observe({"a": 1.0, "b": 0.5})  # a: fast .5, slow .25 -> LP .25; b: LP 0
    assert w.current() == pytest.approx([0.2 * 0.5 + 0.8, 0.2 * 0.5], abs=1e-12)
    w.observe({"a": math.nan})  # a task without a score this step keeps its EMAs
    assert w.current() == pytest.approx([0.9, 0.1], abs=1e-12)
    w.observe({"b": 0.0})  # b drops: fast .25, slow .375 -> LP .125 (forgetting counts too)
    assert w.current() == pytest.approx([0.1 + 0.8 * 0.25 / 0.375, 0.1 + 0.8 * 0.125 / 0.375], abs=1e-12)
    static = TaskWeights(["a", "b"], [1.0, 3.0], TaskMixConfig())
    static.observe({"a": 0.0})
    static.observe({"a": 1.0})
    assert static.current() == [0.25, 0.75]


def test_task_metrics_split_a_step_by_task():
    items = [PromptItem("p", {"task": t}) for t in ("a", "b", "a")]
    rewards = [1.0, 0.0, math.nan, 0.5, 1.0, 1.0]  # group size 2
    metrics, means = task_metrics(["a", "b", "c"], items, rewards)
    assert means["a"] == pytest.approx(0.75) and means["b"] == 0.5 and math.isnan(means["c"])
    assert metrics["task/a/share"] == pytest.approx(2 / 3) and metrics["task/c/share"] == 0.0


# ---------------------------------------------------------------- rewards


def _ones(samples):
    return [1.0] * len(samples)


def _length(samples):
    return [float(len(s.completion)) for s in samples]


def test_task_reward_scores_each_sample_with_its_tasks_terms():
    from regen.rewards.base import CombinedReward

    r = TaskReward({"a": CombinedReward([("ones", _ones, 2.0, {})]), "b": CombinedReward([("len", _length, 1.0, {})])})
    samples = [Sample("p", "xyz", {"task": "b"}), Sample("p", "x", {"task": "a"}), Sample("p", "xy", {"task": "b"})]
    total, parts = r(samples)
    assert total == [3.0, 2.0, 2.0]
    assert parts["b/len"][0] == 3.0 and math.isnan(parts["b/len"][1]) and parts["a/ones"][1] == 1.0
    assert math.isnan(parts["a/ones"][0])
    with pytest.raises(RuntimeError, match="meta\\['task'\\]='c'"):
        r([Sample("p", "x", {"task": "c"})])


# ---------------------------------------------------------------- whole runs


QUICK = "tests.reward_fixtures:quick_exact"


def _tasks(weights: str = "static", eval_: bool = True) -> list[str]:
    ev = ", eval: builtin:arithmetic:test" if eval_ else ""
    return [
        "tasks={one: {train: builtin:arithmetic:train" + ev + ", task: {digits: 1, test_size: 20}, weight: 3, "
        "reward: [{name: exact_match}]}, two: {train: builtin:arithmetic:train" + ev + ", "
        "reward: [{name: exact_match}, {name: " + QUICK + ", weight: 0.5}]}}",
        f"task_mix.weights={weights}", "task_mix.fast_rate=0.5", "task_mix.slow_rate=0.1",
    ]


def _args(base, run, *extra) -> list[str]:
    return ["train", f"model.path={base}", f"run.dir={run}", "rollout.global_batch_size=16", "rollout.group_size=4",
            "rollout.max_new_tokens=4", "log.progress=none", "log.tensorboard=false", "optim.lr=1e-3",
            "eval.num_prompts=8", "eval.samples_per_prompt=2", *extra]


def test_a_multi_task_run_logs_each_task_and_draws_by_its_weight(base_model, tmp_path):
    run = tmp_path / "mt"
    assert main(_args(base_model, run, "train.steps=4", "eval.every=2", *_tasks())) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    steps = [r for r in rows if "task/one/share" in r]
    assert len(steps) == 4 and all(r["task/one/share"] == 0.75 and r["task/two/share"] == 0.25 for r in steps)
    assert all(r["task/one/weight"] == 0.75 for r in steps)
    assert all(f"reward/two/{QUICK}" in r and "reward/one/exact_match" in r for r in steps)
    evals = [r for r in rows if "eval/one/reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:  # eval/* is the mean over the tasks of what each has
        assert r["eval/reward"] == pytest.approx((r["eval/one/reward"] + r["eval/two/reward"]) / 2)
    kept = read_jsonl(run / "samples" / "step_00000004.jsonl")
    assert {r["task"] for r in kept} == {"one", "two"}
    assert all(len(r["prompt"]) <= 4 for r in kept if r["task"] == "one")  # one digit: "a+b="


def test_dynamic_weights_follow_their_rule_in_a_run_and_resume_exactly(base_model, tmp_path):
    common = ("checkpoint.every=3", *_tasks("dynamic", eval_=False))
    ref, split = tmp_path / "ref", tmp_path / "split"
    assert main(_args(base_model, ref, "train.steps=6", *common)) == 0
    rows = [r for r in read_jsonl(ref / "metrics.jsonl") if "task/one/weight" in r]
    fast: dict = {}
    slow: dict = {}
    for r in rows:  # the rule, by hand, on the logged rewards: p = .2 prior + .8 LP / sum LP
        for t in ("one", "two"):
            x = r[f"task/{t}/reward"]
            if x is not None and math.isfinite(x):  # NaN (no prompt of t this step) is logged as null
                fast[t] = x if t not in fast else fast[t] + 0.5 * (x - fast[t])
                slow[t] = x if t not in slow else slow[t] + 0.1 * (x - slow[t])
        lp = {t: abs(fast[t] - slow[t]) if t in fast else 0.0 for t in ("one", "two")}
        prior = {"one": 0.75, "two": 0.25}
        want = prior if sum(lp.values()) == 0 else {t: 0.2 * prior[t] + 0.8 * lp[t] / sum(lp.values()) for t in lp}
        assert r["task/one/weight"] == pytest.approx(want["one"], abs=1e-9)
    assert any(r["task/one/weight"] != 0.75 for r in rows)  # progress was measured: the weights moved
    assert main(_args(base_model, split, "train.steps=3", *common)) == 0
    assert main(_args(base_model, split, "train.steps=6", *common)) == 0
    same_run(ref, split)


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize("extra, message", [
    (["data.train=builtin:arithmetic:train"], "data.train is read only without tasks"),
    (["reward=[{name: exact_match}]"], "reward is read only without tasks"),
    (["tasks={a/b: {train: x.jsonl, reward: [{name: exact_match}]}}"], "tasks.a/b: a task name"),
    (["tasks={}"], "give at least one task stream"),
    (["tasks={a: {train: builtin:arithmetic:train, reward: []}}"], "tasks.a.reward"),
    (["tasks={a: {train: builtin:arithmetic:train, reward: [{name: exact_matc}]}}"],
     "tasks.a.reward.0.name: unknown reward 'exact_matc'"),
    (["tasks={a: {train: builtin:arithmetic:train, reward: [{name: exact_match}]}}", "eval.metrics=[bleu4]"],
     "eval.metrics with tasks"),
    (["tasks={a: {train: builtin:arithmetic:train, reward: [{name: exact_match}]}}", "task_mix.slow_rate=0.5"],
     "task_mix.slow_rate=0.5 must be below"),
    (["task_mix.weights=dynamic"], "task_mix.weights is read only with tasks"),
])
def test_bad_multi_task_configs_name_the_field(base_model, tmp_path, capsys, extra, message):
    tasks = [] if any(e.startswith("tasks=") for e in extra) or extra == ["task_mix.weights=dynamic"] else \
        ["tasks={a: {train: builtin:arithmetic:train, reward: [{name: exact_match}]}}"]
    assert main(_args(base_model, tmp_path / "bad", "train.steps=1", *tasks, *extra)) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_a_row_whose_own_task_field_disagrees_is_refused(base_model, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "task": "other"}) + "\n")
    assert main(_args(base_model, tmp_path / "bad", "train.steps=1", "rollout.global_batch_size=4",
                      f"tasks={{a: {{train: {data}, reward: [{{name: exact_match}}]}}}}")) != 0
    err = capsys.readouterr().err
    assert "tasks.a.train: row 1 has a field 'task'='other'" in err


def test_a_flow_multi_task_run_keeps_each_tasks_images_apart(flow_base, tmp_path):
    """The same books for a flow model: per-task metrics, and each task's held-out images under
    samples/step_N/NAME/ with their rows tagged, neither task's overwriting the other's."""
    run = tmp_path / "flow"
    tasks = ("tasks={bright: {train: builtin:shapes:train, eval: builtin:shapes:test, weight: 1, "
             "reward: [{name: brightness, args: {target: 0.6}}]}, dark: {train: builtin:shapes:train, "
             "eval: builtin:shapes:test, weight: 1, reward: [{name: brightness, args: {target: 0.1}}]}}")
    assert main(["train", f"model.path={flow_base}", "algorithm.name=nft", f"run.dir={run}", "train.steps=2",
                 "eval.every=2", "eval.num_prompts=2", "eval.samples_per_prompt=1", "rollout.global_batch_size=8",
                 "rollout.group_size=4", "flow.steps=3", "flow.eval_steps=3", "log.progress=none",
                 "log.tensorboard=false", "run.threads=2", tasks]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert all(r["task/bright/share"] == 0.5 for r in rows if "task/bright/share" in r)
    last = [r for r in rows if "eval/bright/brightness" in r][-1]
    assert last["eval/bright/brightness"] != last["eval/dark/brightness"]  # each task scored with its own target
    assert "eval/adherence_accuracy" in last  # both tasks' prompts are shapes: their mean
    kept = read_jsonl(run / "samples" / "step_00000002.jsonl")
    assert sorted(r["task"] for r in kept) == ["bright", "bright", "dark", "dark"]
    assert all((run / r["image"]).is_file() and f"/{r['task']}/" in r["image"] for r in kept)
