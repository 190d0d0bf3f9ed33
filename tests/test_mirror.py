"""S3 checkpoint mirror against a real moto S3 server on loopback (no network beyond 127.0.0.1)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

from regen.errors import ConfigError, UserError
from regen.runtime import checkpoint as ckpt

pytest.importorskip("boto3")
pytest.importorskip("moto")

from regen.runtime.mirror import S3Mirror  # noqa: E402
from tests.conftest import read_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto server exited: {log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.time() > deadline:
                    pytest.fail("moto server did not start within 30 s")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3(endpoint, monkeypatch):
    """Fake credentials from the environment only; a fresh bucket for each test."""
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.bucket = f"regen-test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=client.bucket)
    return client


@pytest.fixture
def make_mirror(s3, endpoint):
    made = []

    def make(prefix="runs/exp1", keep_last=3):
        events = []
        m = S3Mirror(f"s3://{s3.bucket}/{prefix}", endpoint_url=endpoint, keep_last=keep_last,
                     on_event=lambda kind, message, **data: events.append((kind, message, data)))
        m.events = events
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def _save(run_dir, step):
    torch.manual_seed(step)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()

    def save_model(folder):
        folder.mkdir()
        (folder / "weights.bin").write_bytes(bytes([step]) * 300)
        (folder / "config.json").write_text(f'{{"step": {step}}}')

    return ckpt.save_checkpoint(run_dir, step, save_model, opt, {"sampler": torch.tensor([step])},
                                {"data": {"cursor": step}}, keep_last=100)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _keys(s3):
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def test_upload_two_and_download_latest_is_identical(make_mirror, tmp_path):
    m = make_mirror()
    local = [_save(tmp_path / "run", step) for step in (10, 20)]
    for folder in local:
        m.submit(folder)
    m.wait(timeout=60)
    assert m.list_complete() == ["step_00000010", "step_00000020"]
    assert [e[0] for e in m.events] == ["mirror_uploaded", "mirror_uploaded"]
    got = m.download_latest(tmp_path / "restore")
    assert got == tmp_path / "restore" / "step_00000020"
    ckpt.verify(got)
    assert _files(got) == _files(local[1])
    assert sorted(p.name for p in (tmp_path / "restore").iterdir()) == ["step_00000020"]  # no .tmp left


def test_upload_cut_off_midway_keeps_previous_checkpoint(make_mirror, s3, tmp_path, monkeypatch):
    m = make_mirror()
    first = _save(tmp_path / "run", 1)
    assert m.submit(first).result(timeout=60) is None
    second = _save(tmp_path / "run", 2)
    real_put, calls = m._put, []

    def dropping_put(path, key, digest):
        calls.append(key)
        if len(calls) > 2:
            raise ConnectionError("connection reset by peer")
        real_put(path, key, digest)

    monkeypatch.setattr(m, "_put", dropping_put)
    fut = m.submit(second)
    assert isinstance(fut.exception(timeout=60), ConnectionError)
    kinds = [e[0] for e in m.events]
    assert kinds == ["mirror_uploaded", "mirror_failed"] and "step_00000002" in m.events[-1][1]
    # two files of the new checkpoint reached the bucket, but no manifest: it is not complete
    assert len([k for k in _keys(s3) if "/step_00000002/" in k]) == 2
    assert m.list_complete() == ["step_00000001"]
    got = m.download_latest(tmp_path / "restore")
    assert got.name == "step_00000001"
    ckpt.verify(got)
    assert _files(got) == _files(first)



def test_bytes_that_differ_in_the_bucket_fail_verification(make_mirror, s3, tmp_path, monkeypatch):
    m = make_mirror()
    folder = _save(tmp_path / "run", 3)

    def mangling_put(path, key, digest):  # the server stores other bytes than were sent
        body = b"mangled" if key.endswith("rng.safetensors") else path.read_bytes()
        s3.put_object(Bucket=s3.bucket, Key=key, Body=body, Metadata={"sha256": digest})

    monkeypatch.setattr(m, "_put", mangling_put)
    with pytest.raises(UserError, match="rng.safetensors"):
        m.submit(folder).result(timeout=60)
    assert [e[0] for e in m.events] == ["mirror_failed"]
    assert m.list_complete() == [] and not [k for k in _keys(s3) if k.endswith("manifest.json")]


def test_reupload_of_same_step_is_incomplete_until_done(make_mirror, tmp_path, monkeypatch):
    m = make_mirror()
    m.submit(_save(tmp_path / "a", 5)).result(timeout=60)
    newer = _save(tmp_path / "b", 5)  # the same step saved again (e.g. after a resume)

    def failing_put(path, key, digest):
        raise ConnectionError("dropped")

    monkeypatch.setattr(m, "_put", failing_put)
    assert isinstance(m.submit(newer).exception(timeout=60), ConnectionError)
    # the old manifest went first, so a half-replaced step_00000005 never counts as complete
    assert m.list_complete() == []

def test_retention_keeps_newest_complete(make_mirror, s3, tmp_path):
    m = make_mirror(prefix="", keep_last=2)
    for step in (1, 2, 3, 4):
        m.submit(_save(tmp_path / "run", step))
    m.wait(timeout=60)
    assert not [e for e in m.events if e[0] != "mirror_uploaded"]
    names = {k.split("/")[1] for k in _keys(s3)}
    assert names == {"step_00000003", "step_00000004"}
    assert m.list_complete() == ["step_00000003", "step_00000004"]
    # leftovers: an old incomplete one goes, a newer incomplete one (maybe still arriving) stays
    s3.put_object(Bucket=s3.bucket, Key="checkpoints/step_00000002/state.json", Body=b"{}")
    s3.put_object(Bucket=s3.bucket, Key="checkpoints/step_00000009/state.json", Body=b"{}")
    m._retain()
    assert {k.split("/")[1] for k in _keys(s3)} == {"step_00000003", "step_00000004", "step_00000009"}
    # keep_last=1 still never deletes the newest complete checkpoint
    m1 = make_mirror(prefix="", keep_last=1)
    m1._retain()
    assert m1.list_complete() == ["step_00000004"]
    assert len([k for k in _keys(s3) if "/step_00000004/" in k]) == 7  # 6 files + manifest


def test_corrupt_newest_is_skipped(make_mirror, s3, tmp_path):
    m = make_mirror()
    local = [_save(tmp_path / "run", step) for step in (1, 2)]
    for folder in local:
        m.submit(folder)
    m.wait(timeout=60)
    s3.put_object(Bucket=s3.bucket, Key="runs/exp1/checkpoints/step_00000002/optimizer.safetensors",
                  Body=b"garbage")
    got = m.download_latest(tmp_path / "restore")
    assert got.name == "step_00000001" and _files(got) == _files(local[0])
    corrupt = [e for e in m.events if e[0] == "mirror_corrupt"]
    assert len(corrupt) == 1 and corrupt[0][2]["name"] == "step_00000002"
    assert "optimizer.safetensors" in corrupt[0][1]
    assert sorted(p.name for p in (tmp_path / "restore").iterdir()) == ["step_00000001"]
    with pytest.raises(UserError, match="step_00000002"):
        m.download("step_00000002", tmp_path / "again")
    assert not list((tmp_path / "again").iterdir())  # the partial download was removed


def test_empty_bucket_and_incomplete_name(make_mirror, tmp_path):
    m = make_mirror()
    assert m.list_complete() == [] and m.download_latest(tmp_path) is None
    with pytest.raises(UserError, match="step_00000007"):
        m.download("step_00000007", tmp_path)
    with pytest.raises(UserError, match="not a checkpoint name"):
        m.download("../etc", tmp_path)


@pytest.mark.parametrize("url", ["s3:/bucket/x", "http://bucket/x", "s3://", "s3://Bad_Bucket/x", "bucket"])
def test_bad_url_is_a_config_error(url):
    with pytest.raises(ConfigError, match=f"'{url}'"):
        S3Mirror(url)


def test_missing_boto3_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # makes `import boto3` raise ImportError
    with pytest.raises(ConfigError, match=r"pip install 'regen\[s3\]'"):
        S3Mirror("s3://bucket/prefix")


def test_importing_the_module_does_not_import_boto3():
    code = "import sys, regen.runtime.mirror; assert 'boto3' not in sys.modules and 'botocore' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.extended  # three runs resumed from a local S3 per modality (17 s): second CI tier, keeps scripts/test.sh short
def test_training_run_resumes_exactly_from_the_bucket(job, s3, endpoint, tmp_path):
    from regen.cli import main
    from tests.conftest import same_run

    mirror = [f"mirror.url=s3://{s3.bucket}/runs/{job.kind}", f"mirror.endpoint_url={endpoint}"]
    straight, lost = tmp_path / "straight", tmp_path / "lost"
    assert main(job.args(straight, "train.steps=6", "checkpoint.every=2")) == 0
    assert main(job.args(lost, "train.steps=4", "checkpoint.every=2", *mirror)) == 0
    prefix = f"runs/{job.kind}/"
    ckpts = {k.split("/")[3] for k in _keys(s3) if k.startswith(prefix + "checkpoints/")}
    assert ckpts == {"step_00000002", "step_00000004"}
    shutil.rmtree(lost)  # the machine is gone; only the bucket remains
    assert main(job.args(lost, "train.steps=6", "checkpoint.every=2", *mirror)) == 0
    assert [r["step"] for r in read_jsonl(lost / "metrics.jsonl")] == [5, 6]  # continued after step 4
    rows = read_jsonl(straight / "metrics.jsonl")
    (straight / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    same_run(straight, lost)  # the same weights and steps 5-6 as a run never interrupted
    for f in (lost / "export").rglob("*"):  # the export is in the bucket too, byte for byte
        if f.is_file():
            key = f"{prefix}export/{f.relative_to(lost / 'export')}"
            assert s3.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == f.read_bytes(), key
    manifest = json.loads(s3.get_object(Bucket=s3.bucket, Key=prefix + "export/manifest.json")["Body"].read())
    assert manifest["sha256"]


def test_unreachable_bucket_is_one_clear_error(base_model, s3, endpoint, tmp_path, capsys):
    from regen.cli import main

    assert main(["train", f"model.path={base_model}", f"run.dir={tmp_path}", "log.progress=none",
                 "mirror.url=s3://no-such-bucket-here/x", f"mirror.endpoint_url={endpoint}"]) == 2
    assert "mirror.url: cannot list 's3://no-such-bucket-here/x'" in capsys.readouterr().err


@pytest.mark.extended  # two runs per trainer against a local S3: second CI tier
@pytest.mark.parametrize("kind", ["sft", "flow_sft", "dpo", "rm"])
def test_an_offline_run_resumes_exactly_from_the_bucket(kind, base_model, s3, endpoint, tmp_path):
    """regen sft (language and flow models), DPO and regen rm mirror their checkpoints and export like RL runs,
    and a run whose directory is gone continues from the bucket to the weights of a run never interrupted."""
    from regen.cli import main
    from tests.test_offline_books import STEPS, args, weights_of

    mirror = [f"mirror.url=s3://{s3.bucket}/runs/{kind}", f"mirror.endpoint_url={endpoint}"]
    straight, lost = tmp_path / "straight", tmp_path / "lost"
    straight.mkdir(), lost.mkdir()
    common = ["checkpoint.every=2", "optim.lr=1e-3"]
    assert main(args(kind, base_model, straight / "run", f"{STEPS[kind]}=6", *common)) == 0
    assert main(args(kind, base_model, lost / "run", f"{STEPS[kind]}=4", *common, *mirror)) == 0
    prefix = f"runs/{kind}/"
    assert {k.split("/")[3] for k in _keys(s3) if k.startswith(prefix + "checkpoints/")} == {
        "step_00000002", "step_00000004"}
    assert any(k.startswith(prefix + "export/") for k in _keys(s3))
    shutil.rmtree(lost / "run")  # the machine is gone; only the bucket remains
    assert main(args(kind, base_model, lost / "run", f"{STEPS[kind]}=6", *common, *mirror)) == 0
    assert [r["step"] for r in read_jsonl(lost / "run" / "metrics.jsonl") if "loss" in r] == [5, 6]
    assert weights_of(lost / "run" / "export") == weights_of(straight / "run" / "export")
