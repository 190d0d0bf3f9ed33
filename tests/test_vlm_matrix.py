"""The supported-models table of docs/vision-language.md, held to the tests: every family x method
cell marked `yes` runs here (a 2-step job on the family's tiny model) or names the test that covers
it, and every `no` cell is refused before any work by an error naming the family and the piece."""

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from regen.cli import main
from regen.tasks import tiny_vlms
from tests import test_vlm_families
from tests.conftest import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
VISION_NAMES = ("vision_tower.", "visual.", "vision_model.")  # the families' vision-side weight names
REWARD = "reward=[{name: 'tests.reward_fixtures:answer_words'}]"  # varies between an untrained model's samples
COMMON = ["data.eval=null", "log.progress=none", "log.tensorboard=false",
          "run.threads=2", "train.steps=2"]
RL = ["rollout.global_batch_size=8", "rollout.group_size=4", "rollout.max_new_tokens=3", "optim.lr=1e-3", REWARD]
# the columns a 2-step job here stands behind, and its arguments
JOBS = {
    "grpo": RL,
    "dapo": [*RL, "algorithm.clip_high=0.28", "algorithm.dynamic_sampling=true"],
    "gspo": [*RL, "algorithm.name=gspo"],
    "rloo": [*RL, "algorithm.advantage=rloo"],
    "reinforce_pp": [*RL, "algorithm.advantage=reinforce_pp"],
    "ppo": [*RL, "algorithm.name=ppo", "rollout.group_size=1"],
    "lora": [*RL, "model.lora={r: 4, alpha: 8}"],
    "dpo": ["algorithm.name=dpo", "train.global_minibatch_size=8", "optim.lr=1e-3"],
    "episodes": [*RL, "env={name: 'tests.test_vlm_families:WordEcho', max_turns: 2, max_tokens: 16}"],
}
# the columns other tests stand behind, each parametrized over the families it covers
ELSEWHERE = {
    "sample": test_vlm_families.test_rescoring_gives_the_samplers_logprobs_also_across_concatenated_batches,
    "export": test_vlm_families.test_export_loads_in_plain_transformers_with_the_same_logits,
    "sft": test_vlm_families.test_sft_runs_with_prompt_rows_and_with_the_chat_template,
    "torchrun": test_vlm_families.test_torchrun_two_processes_train_the_same_model_as_one,
    "ray": test_vlm_families.test_ray_rollout_actors_sample_what_one_process_does,
}
# `no` cells: the arguments that ask for the piece, and what the refusal must say
REFUSED = {
    "vllm": (["rollout.engine=vllm", *RL], "does not pass images to vLLM"),
    "episodes": ([JOBS["episodes"][-1], *RL], "sliding window"),
}


def table() -> dict[tuple[str, str], str]:
    """{(model_type, column): 'yes' | 'no'} from the docs' supported-models table."""
    lines = (ROOT / "docs" / "vision-language.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| family (`model_type`)"))
    head = [c.strip() for c in lines[start].strip("|").split("|")]
    cells = {}
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        row = [c.strip() for c in ln.strip("|").split("|")]
        family = re.search(r"\(`(\w+)`\)", row[0]).group(1)
        cells.update({(family, col): val for col, val in zip(head[1:], row[1:])})
    return cells


def families_of(test) -> set[str]:
    """The families a test function is parametrized over (its `family` parameter)."""
    marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize" and m.args[0] == "family"]
    return {v.values[0] if hasattr(v, "values") else v for v in marks[0].args[1]} if marks else set()


def test_the_table_matches_the_tests_and_the_refusals():
    cells = table()
    assert {f for f, _ in cells} == set(tiny_vlms.FAMILIES)  # one row per family the tests build
    for (family, col), val in cells.items():
        assert val in ("yes", "no"), (family, col, val)
        if val == "no":
            assert col in REFUSED, f"{family} x {col} is 'no' but no refusal is tested for it"
        elif col in JOBS:
            assert (family, col) in [tuple(p.values) for p in CELLS], f"{family} x {col}: no job runs it"
        else:
            assert family in families_of(ELSEWHERE[col]), f"{family} x {col}: {ELSEWHERE[col].__name__} skips it"


CELLS = [pytest.param(f, c, id=f"{f}-{c}") for (f, c), v in sorted(table().items()) if v == "yes" and c in JOBS]


def weights_of(folder) -> dict:
    return load_file(str(Path(folder) / "model.safetensors"))


@pytest.mark.parametrize("family,column", CELLS)
def test_each_supported_cell_trains_two_steps(family, column, family_dirs, vqa_rows, tmp_path):
    base, run = family_dirs[family], tmp_path / "run"
    assert main(["train", f"model.path={base}", f"run.dir={run}", f"data.train={vqa_rows}", *COMMON,
                 *JOBS[column]]) == 0
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    before, after = weights_of(base), weights_of(run / "export")  # LoRA: merged into the export
    vision = [k for k in before if any(p in k for p in VISION_NAMES)]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)  # frozen by default
    assert any(not torch.equal(before[k], after[k]) for k in before if k not in vision)  # the language side moved


@pytest.mark.parametrize("family,column", [pytest.param(f, c, id=f"{f}-{c}") for (f, c), v in sorted(table().items())
                                           if v == "no"])
def test_each_unsupported_cell_is_refused_naming_the_family(family, column, family_dirs, vqa_rows, tmp_path, capsys):
    args, says = REFUSED[column]
    assert main(["train", f"model.path={family_dirs[family]}", f"run.dir={tmp_path / 'run'}", f"data.train={vqa_rows}",
                 *COMMON, *args]) == 2
    err = capsys.readouterr().err
    assert family in err and says in err, err
    assert not (tmp_path / "run").exists()  # refused before the run directory
