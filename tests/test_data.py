import pytest

from regen.config import TaskConfig
from regen.data import EpochSampler, load_demos, load_prompts
from regen.errors import DataError
from regen.tasks import arithmetic


def test_builtin_split_is_disjoint_and_independent_of_run_seed():
    task = TaskConfig()
    train = {p.prompt for p in load_prompts("builtin:arithmetic:train", task, "data.train")}
    test = [p.prompt for p in load_prompts("builtin:arithmetic:test", task, "data.eval")]
    assert len(test) == 500 and len(set(test)) == 500 and len(train) == 100 * 100 - 500
    assert not train & set(test)
    # the split is fixed by the task seed, so an SFT run and a later RL run agree on it
    assert test == [p.prompt for p in load_prompts("builtin:arithmetic:test", task, "data.eval")]


def test_prompt_answers_are_sums():
    for item in load_prompts("builtin:arithmetic:test", TaskConfig(), "x")[:50]:
        a, b = item.prompt.rstrip("=").split("+")
        assert item.meta["answer"] == str(int(a) + int(b))


def test_demo_noise_fraction_and_wrong_answers_are_wrong():
    demos = load_demos("builtin:arithmetic:train", TaskConfig(demo_noise=0.4), "data.train")
    wrong = [d for d in demos if d.completion != d.meta["answer"]]
    assert abs(len(wrong) / len(demos) - 0.4) < 0.02
    clean = load_demos("builtin:arithmetic:train", TaskConfig(demo_noise=0.0), "data.train")
    assert all(d.completion == d.meta["answer"] for d in clean)


def test_jsonl_prompts_keep_extra_fields(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "2+2=", "answer": "4"}\n\n{"prompt": "1+1=", "answer": "2", "id": 7}\n')
    items = load_prompts(str(f), TaskConfig(), "data.train")
    assert [i.prompt for i in items] == ["2+2=", "1+1="] and items[1].meta == {"answer": "2", "id": 7}


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a"}\n{"prompt": \n', r"p.jsonl line 2: not valid JSON"),
        ('{"prompt": "a"}\n["x"]\n', r"p.jsonl line 2: expected a JSON object"),
        ('{"prompt": "a"}\n{"text": "b"}\n', r"p.jsonl line 2: field 'prompt' missing"),
        ("\n\n", r"holds no rows"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(DataError, match=message):
        load_prompts(str(f), TaskConfig(), "data.train")


def test_missing_file_and_unknown_builtin(tmp_path):
    with pytest.raises(DataError, match="data.train: prompt file .* not found"):
        load_prompts(str(tmp_path / "nope.jsonl"), TaskConfig(), "data.train")
    with pytest.raises(DataError, match="unknown built-in data"):
        load_prompts("builtin:poetry:train", TaskConfig(), "data.train")


def test_paraphrase_splits_hold_out_phrasings_and_combinations():
    """The joint demo's user prompts: `phrasings` is every training combination in the phrasings
    training never uses; `test` the held-out combinations in those phrasings."""
    from regen.tasks import shapes
    from regen.tasks.shapes_paraphrase import SYNONYMS

    task = TaskConfig()
    keys = ("colour", "shape", "position")
    split = {s: load_prompts(f"builtin:shapes-paraphrase:{s}", task, "data.eval") for s in ("train", "test", "phrasings")}
    combos = {s: {tuple(p.meta[k] for k in keys) for p in rows} for s, rows in split.items()}
    train_c, test_c = (({tuple(m[k] for k in keys) for m in part}) for part in shapes.split("image"))
    assert combos["train"] == combos["phrasings"] == train_c and combos["test"] == test_c and not train_c & test_c

    def opening(prompt: str) -> str:  # the phrasing: the words that are no attribute or synonym
        attrs = {w for k, v in SYNONYMS.items() for w in (k, *v)}
        return " ".join("_" if w in attrs else w for w in prompt.split())

    train_phr = {opening(p.prompt) for p in split["train"]}
    for s in ("test", "phrasings"):
        assert not {opening(p.prompt) for p in split[s]} & train_phr, s
        assert not {p.prompt for p in split[s]} & {p.prompt for p in split["train"]}
    phr = split["phrasings"]
    assert len(phr) == 2 * len(train_c)
    # the first 48 (eval.num_prompts of the example) hold each combination once, in both phrasings
    first = phr[: len(train_c)]
    assert {tuple(p.meta[k] for k in keys) for p in first} == train_c
    assert len({opening(p.prompt) for p in first}) == 2
    # users write synonyms only: no attribute word the painter knows
    painter_words = set(shapes.COLOURS) | set(shapes.SHAPES) | set(shapes.POSITIONS)
    assert not {w for p in phr for w in p.prompt.split()} & painter_words
    with pytest.raises(DataError, match="builtin:shapes-paraphrase:phrasings"):
        load_prompts("builtin:shapes-paraphrase:heldout", task, "data.eval")


def test_known_synonyms_keep_their_meaning_in_the_enhancers_demonstrations():
    """task.known_synonyms: a known attribute's synonym is translated truly in every demonstration;
    the others' synonyms keep random targets (their meaning left to RL), as in the default."""
    from regen.config import SFTConfig
    from regen.tasks.shapes import parse_prompt, vocabulary
    from regen.tasks.shapes_paraphrase import SYNONYMS

    meaning = {w: k for k, v in SYNONYMS.items() for w in v}
    attribute = {value: k for k, values in vocabulary("image").items() for value in values}

    def pairs(known):  # (a synonym's meaning, the target's value of its attribute) per synonym in a prompt
        demos = load_demos("builtin:shapes-paraphrase:train", TaskConfig(demo_noise=0.5, known_synonyms=known),
                           "data.train")
        out = {k: [] for k in vocabulary("image")}
        for d in demos:
            target = parse_prompt(d.completion)  # "a red circle at the left": the painter's words
            for w in d.prompt.split():
                if w in meaning:
                    out[attribute[meaning[w]]].append((meaning[w], target[attribute[meaning[w]]]))
        return len(demos), out

    n0, none = pairs([])
    n1, some = pairs(["colour", "shape"])
    assert n0 == n1 and all(len(v) > 100 for v in some.values())
    for k in ("colour", "shape"):
        assert all(a == b for a, b in some[k]), k  # every known synonym translated truly
        assert sum(a == b for a, b in none[k]) < 0.6 * len(none[k]), k  # by default near chance
    assert sum(a == b for a, b in some["position"]) < 0.4 * len(some["position"])  # 5 values: chance is 1/5
    with pytest.raises(ValueError, match="task.known_synonyms.*data.train=builtin:arithmetic:train"):
        SFTConfig.model_validate({"model": {"init": "arithmetic"}, "data": {"train": "builtin:arithmetic:train"},
                                  "task": {"known_synonyms": ["colour"]}})
    with pytest.raises(ValueError, match="size"):
        TaskConfig(known_synonyms=["size"])


def test_known_synonyms_is_refused_by_rl_runs(capsys):
    from regen.cli import main

    assert main(["train", "--print-config", "model.init=arithmetic", "task.known_synonyms=[colour]"]) == 2
    err = capsys.readouterr().err
    assert "task.known_synonyms is not read by algorithm.name=grpo" in err and "regen sft" in err


def test_demos_need_completion(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(DataError, match="field 'completion' missing"):
        load_demos(str(f), TaskConfig(), "data.train")


def test_epoch_sampler_covers_each_item_once_per_epoch():
    s = EpochSampler(10, seed=3)
    first, second = s.take(10), s.take(10)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert first != second  # reshuffled each epoch


def test_epoch_sampler_resumes_exactly():
    a = EpochSampler(7, seed=1)
    a.take(5)
    state = a.state()
    expected = a.take(12)  # crosses an epoch boundary
    b = EpochSampler(7, seed=1)
    b.load_state(state)
    assert b.take(12) == expected


def test_test_size_too_large():
    from regen.errors import ConfigError

    with pytest.raises(ConfigError, match="leaves no training prompts"):
        arithmetic.split(1, 100)


def test_corrupt_bytes_name_the_line_and_skip_mode_counts(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n{"prompt": "c"}\n{"prompt": "trunc')
    with pytest.raises(DataError, match=r"p.jsonl line 2: not valid UTF-8"):
        load_prompts(str(f), TaskConfig(), "data.train")
    items = load_prompts(str(f), TaskConfig(), "data.train", skip_bad=True)
    assert [i.prompt for i in items] == ["a", "c"]
    assert "skipped 2 malformed line(s)" in capsys.readouterr().out
