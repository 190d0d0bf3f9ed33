"""A joint run (enhancer LM feeding a painter flow model) data parallel over 2 processes: under
torchrun and as a Ray trainer group, both models train the weights one process trains with the
same global batch (DDP, gloo)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from regen.cli import main
from tests.conftest import folder_weights, read_jsonl
from tests.test_joint import joint_args

pytestmark = pytest.mark.extended  # multi-process: the CI's second tier (pyproject.toml markers)

ROOT = Path(__file__).resolve().parents[1]
STEPS = "train.steps=3"  # 2 user prompts a step: one per rank, each with its 2 rewrites x 2 images
# the painter judged against its rewrite: every image is scored twice, the two sets split over the ranks
OWN = ("reward=[{name: adherence}]", "models.painter.reward_against=rewrite")


@pytest.fixture(scope="module", autouse=True)
def private_ray():
    """The Ray group test starts a private Ray sized for 2 trainers: shut it down even when the test
    fails, or later modules would join it and find too few CPUs for their actors."""
    yield
    if "ray" in sys.modules:
        sys.modules["ray"].shutdown()


@pytest.fixture(scope="module")
def one_process(enhancer_base, flow_base, tmp_path_factory):
    run = tmp_path_factory.mktemp("joint_single") / "run"
    assert main([*joint_args(enhancer_base, flow_base, run, STEPS, *OWN), "distributed.mode=single"]) == 0
    return run


def same_training(run, ref, enhancer_base, flow_base):
    rows, want = read_jsonl(run / "metrics.jsonl"), read_jsonl(ref / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the same rewrites and images (rank r sampled its prompt's rows with the batch's randomness)
    # (to the float noise of DDP's reduction in the weights, which the adherence classifier's scores show)
    assert [r["reward/mean"] for r in rows] == pytest.approx([r["reward/mean"] for r in want], rel=1e-3)
    assert [r["enhancer/rewrite_words"] for r in rows] == [r["enhancer/rewrite_words"] for r in want]
    assert [r["painter/reward_own"] for r in rows] == pytest.approx([r["painter/reward_own"] for r in want], rel=1e-3)
    for key in ("painter/loss", "enhancer/grad_norm", "painter/grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in want], rel=1e-4, abs=1e-6), key
    # both models' weights: as close as float reduction order allows, against how far training moved them.
    # Adam divides each step by the gradient's own scale, so the reduction-order noise grows over the steps:
    # 4e-4 of `moved` for the enhancer on one 2-core machine, 1.1e-3 on another; an update that missed a
    # rank's rows would differ by the order of `moved` (and the grad norms above, at rel 1e-4, catch a
    # wrong scale, to which Adam's weights are blind).
    for model, base in (("enhancer", enhancer_base), ("painter", flow_base)):
        start, got, ref_w = (folder_weights(f) for f in (Path(base), run / "export" / model, ref / "export" / model))
        assert ref_w.keys() == got.keys() == start.keys() and ref_w, model
        moved = sum(((ref_w[k] - start[k]).double() ** 2).sum() for k in ref_w) ** 0.5
        diff = sum(((got[k] - ref_w[k]).double() ** 2).sum() for k in ref_w) ** 0.5
        assert moved > 1e-4 and diff < 1e-2 * moved, (model, float(diff), float(moved))


def test_a_joint_run_on_two_torchrun_processes_trains_what_one_process_trains(enhancer_base, flow_base, one_process,
                                                                               tmp_path):
    run = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "regen",
           *joint_args(enhancer_base, flow_base, run, STEPS, *OWN, "run.threads=1"), "distributed.mode=torchrun"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    same_training(run, one_process, enhancer_base, flow_base)


def test_a_joint_run_in_a_ray_trainer_group_trains_what_one_process_trains(enhancer_base, flow_base, one_process,
                                                                            tmp_path):
    pytest.importorskip("ray")
    run = tmp_path / "group"
    assert main([*joint_args(enhancer_base, flow_base, run, STEPS, *OWN, "run.threads=1"), "distributed.mode=ray",
                 "distributed.trainer_workers=2", "distributed.ray_address=null"]) == 0
    same_training(run, one_process, enhancer_base, flow_base)
