"""Hugging Face datasets as data sources (`hf:NAME_OR_PATH[:SPLIT]`), built here with the real
`datasets` library and read back through the same code as a hub dataset."""

import pytest

from regen.cli import main
from regen.config import TaskConfig
from regen.data import load_pairs, load_prompts
from regen.data.hf import parse_spec
from regen.errors import DataError
from tests.conftest import read_jsonl

datasets = pytest.importorskip("datasets")


def _builtin_pairs(split, task=None):
    return load_pairs(f"builtin:arithmetic:{split}", task or TaskConfig(), "data")


def _as_dataset(pairs, names=("prompt", "chosen", "rejected")):
    return datasets.Dataset.from_dict({
        names[0]: [p.prompt for p in pairs], names[1]: [p.chosen for p in pairs], names[2]: [p.rejected for p in pairs],
        "answer": [p.meta["answer"] for p in pairs],
    })


def test_parse_spec():
    assert parse_spec("hf:org/name") == ("org/name", "train")
    assert parse_spec("hf:org/name:test") == ("org/name", "test")
    assert parse_spec("hf:/data/x:validation") == ("/data/x", "validation")
    assert parse_spec("hf:./a:b/c") == ("./a:b/c", "train")  # a ':' inside a path is not a split


def test_dpo_from_a_saved_dataset_equals_the_builtin_pairs(base_model, tmp_path):
    """The same pairs through `hf:` (renamed columns, a DatasetDict on disk) train exactly
    like the built-in ones: same metrics at every step."""
    folder = tmp_path / "prefs"
    names = ("question", "good", "bad")
    task = TaskConfig(digits=1, test_size=20)  # 80 + 20 pairs: DPO scores them all under the reference first
    datasets.DatasetDict({"train": _as_dataset(_builtin_pairs("train", task), names),
                          "test": _as_dataset(_builtin_pairs("test", task), names)}).save_to_disk(str(folder))
    common = ["train", f"model.path={base_model}", "algorithm.name=dpo", "train.steps=6", "optim.lr=1e-3",
              "train.global_minibatch_size=16", "log.progress=none", "log.tensorboard=false", "eval.num_prompts=16"]
    assert main([*common, f"run.dir={tmp_path / 'builtin'}", "task.digits=1", "task.test_size=20"]) == 0
    assert main([*common, f"run.dir={tmp_path / 'hf'}", f"data.train=hf:{folder}:train",
                 f"data.eval=hf:{folder}:test",
                 "data.columns={prompt: question, chosen: good, rejected: bad}"]) == 0
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in rows]  # noqa: E731
    a = strip(read_jsonl(tmp_path / "builtin" / "metrics.jsonl"))
    b = strip(read_jsonl(tmp_path / "hf" / "metrics.jsonl"))
    assert len(a) >= 6 and a == b


def test_parquet_folder_with_splits_and_extra_fields_as_meta(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    _as_dataset(_builtin_pairs("train")[:10]).to_parquet(str(folder / "train.parquet"))
    _as_dataset(_builtin_pairs("test")[:4]).to_parquet(str(folder / "test.parquet"))
    pairs = load_pairs(f"hf:{folder}:test", TaskConfig(), "data.eval")
    expected = _builtin_pairs("test")[:4]
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [(p.prompt, p.chosen, p.rejected) for p in expected]
    prompts = load_prompts(f"hf:{folder}", TaskConfig(), "data.train")  # split defaults to train
    assert len(prompts) == 10 and prompts[0].meta["answer"] == _builtin_pairs("train")[0].chosen


def test_clear_errors(tmp_path):
    folder = tmp_path / "d"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"prompt": ["1+1=", "2+2="], "chosen": ["2", "4"], "rejected": [["3"], ["5"]]})}).save_to_disk(str(folder))
    with pytest.raises(DataError, match=r"data.train: dataset .* has no split 'dev' \(it has: train\)"):
        load_pairs(f"hf:{folder}:dev", TaskConfig(), "data.train")
    with pytest.raises(DataError, match=r"row 0: 'rejected' is a list, not a string"):
        load_pairs(f"hf:{folder}", TaskConfig(), "data.train")
    with pytest.raises(DataError, match=r"no column 'answer_b' \(for rejected\).*columns: prompt, chosen, rejected"):
        load_pairs(f"hf:{folder}", TaskConfig(), "data.train", columns={"rejected": "answer_b"})
    with pytest.raises(DataError, match="dataset folder '/no/such/folder' not found"):
        load_pairs("hf:/no/such/folder", TaskConfig(), "data.train")
