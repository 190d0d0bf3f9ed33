"""Mirror checkpoints to S3 (or any S3-compatible server: MinIO, moto, ...).

Bucket layout, one object per file of the local checkpoint folder:

    s3://bucket/prefix/checkpoints/step_00000050/model/...
                                                /optimizer.safetensors, optimizer.json, rng.safetensors, state.json
                                                /manifest.json      uploaded LAST

Completeness rule: a checkpoint in the bucket is complete if and only if its manifest.json exists.
The manifest goes up only after every file it lists has been uploaded and re-downloaded, and
its SHA-256 matched, so an upload cut off midway leaves an incomplete leftover that readers
ignore and a later retention pass deletes. Uploads run in one background thread, in order,
so training never waits on the network. boto3 is imported lazily: regen works without it.
Credentials come from boto3's standard chain (env vars, profile, instance role); this module
never takes or logs secrets.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path, PurePosixPath

from regen.errors import ConfigError, UserError
from regen.runtime.checkpoint import PREFIX, verify

_URL = re.compile(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?")
MANIFEST = "manifest.json"


def _sha256_stream(chunks) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _file_chunks(path: Path):
    with path.open("rb") as f:
        yield from iter(lambda: f.read(1 << 20), b"")


class S3Mirror:
    def __init__(self, url: str, endpoint_url: str | None = None, keep_last: int = 3, on_event=None):
        m = _URL.fullmatch(url)
        if not m:
            raise ConfigError(f"mirror: '{url}' is not an S3 url like s3://bucket/prefix")
        if keep_last < 1:
            raise ConfigError(f"mirror: keep_last must be at least 1, got {keep_last}")
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:
            raise ConfigError("mirror: S3 mirroring needs boto3: pip install 'regen[s3]'") from None
        self.url, self.bucket, self.keep_last = url, m.group(1), keep_last
        prefix = (m.group(2) or "").strip("/")
        self.root = f"{prefix}/checkpoints" if prefix else "checkpoints"
        self.on_event = on_event or (lambda kind, message, **data: None)
        self._errors = (BotoCoreError, ClientError, OSError, ValueError, UserError)
        # clients are thread-safe (sessions are not): build it here, use it from the worker too
        self._s3 = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, config=Config(retries={"max_attempts": 5, "mode": "standard"}))
        # one worker: uploads happen in submission order, so "newest uploaded" == "newest step"
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="s3-mirror")
        self._futures: list[cf.Future] = []

    def _key(self, name: str, rel: str = "") -> str:
        return f"{self.root}/{name}/{rel}" if rel else f"{self.root}/{name}/"

    # ---- upload ---------------------------------------------------------------------------------

    def submit(self, folder: Path) -> cf.Future:
        """Upload a complete local checkpoint folder in the background; failures go to on_event."""
        fut = self._pool.submit(self._upload_reporting, Path(folder))
        self._futures = [f for f in self._futures if not f.done()] + [fut]
        return fut

    def _upload_reporting(self, folder: Path) -> None:
        try:
            self._upload(folder)
        except Exception as e:  # any failure: an alert for the caller, the exception stays in the Future
            self.on_event("mirror_failed", f"mirror: uploading '{folder.name}' to {self.url} failed: "
                          f"{type(e).__name__}: {e}", name=folder.name)
            raise

    def _upload(self, folder: Path) -> None:
        t0, name = time.time(), folder.name
        manifest = json.loads((folder / MANIFEST).read_text())["sha256"]
        # a re-upload of the same step must not look complete while its files are being replaced
        self._s3.delete_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))
        for rel, digest in manifest.items():
            self._put(folder / rel, self._key(name, PurePosixPath(rel).as_posix()), digest)
        # Verify what the server stores by reading it back: moto and some S3-compatible servers do
        # not check a client-supplied SHA-256, and multipart uploads only get composite checksums.
        for rel, digest in manifest.items():
            obj = self._s3.get_object(Bucket=self.bucket, Key=self._key(name, PurePosixPath(rel).as_posix()))
            got = _sha256_stream(obj["Body"].iter_chunks(1 << 20))
            if got != digest or obj.get("Metadata", {}).get("sha256") != digest:
                raise UserError(f"mirror: '{name}/{rel}' in the bucket does not match its checksum")
        self._put(folder / MANIFEST, self._key(name, MANIFEST), _sha256_stream(_file_chunks(folder / MANIFEST)))
        size = sum((folder / rel).stat().st_size for rel in manifest)
        self.on_event("mirror_uploaded", f"mirror: uploaded '{name}' to {self.url} ({size} bytes)",
                      name=name, bytes=size, seconds=round(time.time() - t0, 3))
        self._retain()

    def submit_export(self, folder: Path) -> cf.Future:
        """Upload an exported model folder to prefix/export/ in the background, each file
        verified by reading it back; a manifest.json (sha256 of every file) goes up last."""
        return self._pool.submit(self._export_reporting, Path(folder))

    def _export_reporting(self, folder: Path) -> None:
        base = self.root.rsplit("checkpoints", 1)[0] + "export"
        try:
            digests = {}
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                rel = path.relative_to(folder).as_posix()
                digests[rel] = _sha256_stream(_file_chunks(path))
                self._put(path, f"{base}/{rel}", digests[rel])
                obj = self._s3.get_object(Bucket=self.bucket, Key=f"{base}/{rel}")
                if _sha256_stream(obj["Body"].iter_chunks(1 << 20)) != digests[rel]:
                    raise UserError(f"mirror: export file '{rel}' in the bucket does not match its checksum")
            self._s3.put_object(Bucket=self.bucket, Key=f"{base}/{MANIFEST}",
                                Body=json.dumps({"sha256": digests}, indent=1).encode())
        except Exception as e:
            self.on_event("mirror_failed", f"mirror: uploading the export to {self.url} failed: "
                          f"{type(e).__name__}: {e}", name="export")
            raise

    def _put(self, path: Path, key: str, digest: str) -> None:
        # upload_file does multipart and retries for big weight files; the digest rides along as metadata
        self._s3.upload_file(str(path), self.bucket, key, ExtraArgs={"Metadata": {"sha256": digest}})

    def _retain(self) -> None:
        """Keep the newest keep_last complete checkpoints; drop older ones and any incomplete
        leftover older than the newest complete one (a newer incomplete one may still be arriving)."""
        objects = self._objects()
        complete = sorted(n for n, keys in objects.items() if MANIFEST in keys)
        if not complete:
            return
        newest = complete[-1]
        doomed = [n for n in objects if n < newest and n not in complete[-self.keep_last:]]
        # manifests first: a deletion cut off midway leaves an incomplete leftover, never a
        # "complete" checkpoint with missing files
        self._delete([self._key(n, MANIFEST) for n in doomed if MANIFEST in objects[n]])
        self._delete([self._key(n, rel) for n in doomed for rel in objects[n] if rel != MANIFEST])

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            resp = self._s3.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            if resp.get("Errors"):
                raise UserError(f"mirror: could not delete {resp['Errors'][0].get('Key')}: "
                                f"{resp['Errors'][0].get('Message')}")

    def _objects(self) -> dict[str, set[str]]:
        """{checkpoint name: {relative paths}} of everything under prefix/checkpoints/."""
        out: dict[str, set[str]] = {}
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.root + "/"):
            for obj in page.get("Contents", []):
                name, _, rel = obj["Key"][len(self.root) + 1:].partition("/")
                if name.startswith(PREFIX) and rel:
                    out.setdefault(name, set()).add(rel)
        return out

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every submitted upload; raises TimeoutError if some are still running."""
        _, pending = cf.wait(self._futures, timeout=timeout)
        if pending:
            raise TimeoutError(f"mirror: {len(pending)} upload(s) to {self.url} still running after {timeout}s")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # ---- download -------------------------------------------------------------------------------

    def list_complete(self) -> list[str]:
        return sorted(n for n, rels in self._objects().items() if MANIFEST in rels)

    def download(self, name: str, dest_root: Path) -> Path:
        """Download checkpoint `name` into dest_root/name, verified; UserError (and nothing left
        behind) if it is incomplete, unreadable or corrupt."""
        if not re.fullmatch(re.escape(PREFIX) + r"\d+", name):
            raise UserError(f"mirror: '{name}' is not a checkpoint name like {PREFIX}00000050")
        dest_root = Path(dest_root)
        final, tmp = dest_root / name, dest_root / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            body = self._s3.get_object(Bucket=self.bucket, Key=self._key(name, MANIFEST))["Body"].read()
            (tmp / MANIFEST).write_bytes(body)
            for rel in json.loads(body)["sha256"]:
                p = PurePosixPath(rel)
                if p.is_absolute() or ".." in p.parts:  # the bucket must not write outside tmp
                    raise UserError(f"mirror: '{name}' manifest has an unsafe path '{rel}'")
                (tmp / p).parent.mkdir(parents=True, exist_ok=True)
                self._s3.download_file(self.bucket, self._key(name, p.as_posix()), str(tmp / p))
            verify(tmp)  # before the rename: a corrupt copy never appears under the final name
        except (*self._errors, KeyError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"mirror: checkpoint '{name}' from {self.url} is unusable: {e}") from None
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return final

    def download_latest(self, dest_root: Path) -> Path | None:
        """The newest complete checkpoint that downloads and verifies; corrupt newer ones are skipped."""
        for name in reversed(self.list_complete()):
            try:
                return self.download(name, dest_root)
            except UserError as e:
                self.on_event("mirror_corrupt", f"skipping {e}", name=name)
        return None


def open_mirror(cfg, alerts):
    """The S3 mirror of a run whose config has a `mirror` section (None when mirror.url is unset), checked at
    start so a wrong bucket or missing credentials is one clear error now instead of failed uploads later; its
    events become alerts."""
    if not cfg.mirror.url:
        return None
    mirror = S3Mirror(cfg.mirror.url, endpoint_url=cfg.mirror.endpoint_url, keep_last=cfg.mirror.keep_last,
                      on_event=lambda kind, message, **data: alerts.fire(data.pop("step", -1), kind, message, **data)
                      if kind != "mirror_uploaded" else None)
    try:
        mirror.list_complete()
    except Exception as e:  # botocore raises many types; all mean the same thing here
        raise UserError(f"mirror.url: cannot list '{cfg.mirror.url}': {type(e).__name__}: {e}") from None
    return mirror
