import json

import pytest
import torch

from regen.errors import UserError
from regen.runtime import checkpoint as ckpt


def _opt():
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    return lin, opt


def _save(run_dir, step, opt, keep_last=2):
    def save_model(folder):
        folder.mkdir()
        (folder / "weights.bin").write_bytes(bytes(range(64)))

    return ckpt.save_checkpoint(run_dir, step, save_model, opt, {"sampler": torch.tensor([1, 2, 3])},
                                {"data": {"epoch": 0, "cursor": step}}, keep_last)


def test_layout_manifest_and_round_trip(tmp_path):
    lin, opt = _opt()
    folder = _save(tmp_path, 5, opt)
    assert folder.name == "step_00000005"
    manifest = json.loads((folder / "manifest.json").read_text())["sha256"]
    assert set(manifest) == {"model/weights.bin", "optimizer.safetensors", "optimizer.json", "rng.safetensors",
                             "state.json"}
    loaded = ckpt.load_checkpoint(folder)
    assert loaded["state"] == {"step": 5, "data": {"epoch": 0, "cursor": 5}}
    assert torch.equal(loaded["rng"]["sampler"], torch.tensor([1, 2, 3]))
    # the optimizer state restores into a fresh optimizer with identical tensors
    _, fresh = _opt()
    fresh.load_state_dict(loaded["optimizer"].load())
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(v, fresh.state_dict()["state"][0][k])
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_no_pickle_files(tmp_path):
    _, opt = _opt()
    folder = _save(tmp_path, 1, opt)
    assert not [p for p in folder.rglob("*") if p.suffix in (".pt", ".pkl", ".pth")]


def test_flipped_byte_is_detected_and_previous_used(tmp_path):
    _, opt = _opt()
    _save(tmp_path, 1, opt)
    newest = _save(tmp_path, 2, opt)
    target = newest / "optimizer.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(UserError, match="optimizer.safetensors' does not match its checksum"):
        ckpt.verify(newest)
    folder, warnings = ckpt.latest_valid(tmp_path)
    assert folder.name == "step_00000001" and "step_00000002" in warnings[0]


def test_interrupted_write_is_invisible(tmp_path):
    _, opt = _opt()
    _save(tmp_path, 1, opt)
    (tmp_path / "checkpoints" / ".tmp-step_00000002").mkdir()  # a write that died midway
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert ckpt.latest_valid(tmp_path)[0].name == "step_00000001"


def test_retention_keeps_last_n(tmp_path):
    _, opt = _opt()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, opt, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def test_missing_manifest_or_file(tmp_path):
    _, opt = _opt()
    folder = _save(tmp_path, 1, opt)
    (folder / "rng.safetensors").unlink()
    with pytest.raises(UserError, match="'rng.safetensors' is missing"):
        ckpt.verify(folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(UserError, match="no manifest.json"):
        ckpt.verify(folder)
    with pytest.raises(UserError, match="no valid checkpoint"):
        ckpt.load_latest(tmp_path, warn=lambda m: None)


def test_a_streamed_safetensors_file_reads_back_as_safetensors_wrote_it(tmp_path):
    """The FSDP2 optimizer gather streams its tensors one at a time (regen/runtime/safetensors_stream.py):
    safetensors' own reader must give back every tensor exactly, whatever its dtype and shape."""
    from safetensors.torch import load_file, save_file

    from regen.runtime.safetensors_stream import StreamWriter

    g = torch.Generator().manual_seed(0)
    tensors = {"0.exp_avg": torch.randn(7, 3, generator=g), "0.step": torch.tensor(5.0),
               "1.exp_avg_sq": torch.randn(5, generator=g).to(torch.bfloat16), "1.ids": torch.arange(6).view(2, 3),
               "2.mask": torch.tensor([True, False, True]), "3.half": torch.randn(2, 2, generator=g).half(),
               "4.empty": torch.zeros(0, 4), "5.strided": torch.randn(4, 6, generator=g).t()}
    w = StreamWriter(tmp_path / "s.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    back = load_file(str(tmp_path / "s.safetensors"))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"))
    ref = load_file(str(tmp_path / "ref.safetensors"))
    assert all(torch.equal(ref[k], back[k]) for k in tensors)


def test_a_streamed_write_refuses_a_tensor_other_than_declared_and_an_unfinished_file(tmp_path):
    from regen.runtime.safetensors_stream import StreamWriter

    w = StreamWriter(tmp_path / "s.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (3,))])
    with pytest.raises(ValueError, match=r"tensor 0 written as \('a', torch.float32, \(3,\)\), declared as"):
        w.write("a", torch.zeros(3))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="1 of 2 declared tensors written"):
        w.close()
