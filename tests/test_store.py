"""The artifact store: content-hashed ids, manifests, references, locks."""

from __future__ import annotations

import json

import pytest

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import SCHEMA_VERSION, ArtifactStore, Job, artifact_id
from tests.conftest import invoke


def test_id_is_sha256_prefix_of_canonical_json_and_order_free():
    import hashlib

    a = artifact_id("score", {"k": 64, "tokens": 4096}, {"extract": "abc"})
    b = artifact_id("score", {"tokens": 4096, "k": 64}, {"extract": "abc"})
    payload = json.dumps(
        {
            "stage": "score",
            "schema": SCHEMA_VERSION,
            "config": {"k": 64, "tokens": 4096},
            "parents": {"extract": "abc"},
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    assert a == b == hashlib.sha256(payload.encode()).hexdigest()[:12]
    assert artifact_id("score", {"k": 65, "tokens": 4096}, {"extract": "abc"}) != a
    assert artifact_id("score", {"k": 64, "tokens": 4096}, {"extract": "abd"}) != a


def test_manifest_lifecycle_and_references(tmp_path):
    store = ArtifactStore(tmp_path)
    job = Job("extract", 1, {"x": 1}, {})
    first = store.begin("extract", job.key, {}, seed=3)
    assert first.id == job.id and first.config["cache_version"] == 1
    assert first.status == "running" and store.cached(job) is None
    (first.path / "data.bin").write_bytes(b"12345")
    first.finish()
    manifest = json.loads(first.manifest_path.read_text())
    assert manifest["status"] == "complete" and manifest["seed"] == 3
    import hashlib

    assert manifest["files"] == {"data.bin": {"bytes": 5, "sha256": hashlib.sha256(b"12345").hexdigest()}}
    for key in ("environment", "dihal_version", "created", "finished", "schema_version", "config", "parents"):
        assert key in manifest
    assert (
        manifest["digest"]
        == hashlib.sha256(
            json.dumps(
                {k: v for k, v in manifest.items() if k != "digest"}, sort_keys=True, separators=(",", ":")
            ).encode()
        ).hexdigest()
    )
    assert store.cached(job).id == first.id
    with pytest.raises(DihalError, match="complete"):
        first.set_metrics(loss=1.0)
    second = store.begin("extract", {"x": 2}, {})
    second.finish()
    assert store.resolve("latest", "extract").id == second.id
    assert store.resolve(first.id[:6], "extract").id == first.id
    with pytest.raises(DihalError, match="no extract artifact 'zzz'"):
        store.resolve("zzz", "extract")


def test_lock_stops_a_second_writer(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.lock("bridge", "abc"):
        other = ArtifactStore(tmp_path)
        with pytest.raises(DihalError, match="another process is writing"):
            with other.lock("bridge", "abc"):
                pass


def test_runs_list_and_show(tmp_path, monkeypatch):
    monkeypatch.setenv("DIHAL_ROOT", str(tmp_path))
    store = ArtifactStore(tmp_path)
    parent = store.begin("extract", {"model": "m"}, {})
    parent.finish()
    child = store.begin("score", {"k": 5}, {"extract": parent.id})
    child.finish()
    listed = invoke("runs", "list")
    assert listed.exit_code == 0 and parent.id in listed.output and child.id in listed.output
    shown = invoke("runs", "show", child.id[:5])
    assert shown.exit_code == 0 and f"<- extract {parent.id}" in shown.output
    assert invoke("runs", "latest", "score").output.strip() == child.id
    assert invoke("runs", "show", "nope").exit_code == 2


def test_runs_list_at_80_columns_keeps_stage_id_and_status_whole(tmp_path):
    """Less important columns give way first: every stage, full id and status reads back whole."""
    from tests.conftest import run_cli

    store = ArtifactStore(tmp_path)
    made = []
    long_model = {"model": "/a/long/path/to/some/local/model-directory", "layers": "all"}
    for stage, cfg in (("extract", long_model), ("evaluate", {"kind": "fidelity"}), ("generate", {"mode": "parallel"})):
        art = store.begin(stage, cfg, {})
        if stage != "generate":
            art.finish()  # the generate artifact stays 'running'
        made.append(art)
    proc = run_cli("runs", "list", "--root", str(tmp_path), env={"COLUMNS": "80"}, check=True)
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    for art in made:
        row = next(line for line in lines if art.id in line)  # the full 12-digit id
        assert row.split()[:3] == [art.stage, art.id, store.load(art.stage, art.id).status]


def test_a_complete_manifest_reads_back_complete_whatever_its_keys(tmp_path):
    """The digest is of the manifest as written: integer keys (layers 0..30 of a builtin) become strings
    that sort as text, and the artifact still reads complete, not corrupt (it read corrupt once)."""
    store = ArtifactStore(tmp_path)
    art = store.begin("extract", {"x": 1}, {})
    art.manifest["metrics"] = {"store_dtypes": {layer: "float16" for layer in range(31)}}
    art.finish()
    again = store.load("extract", art.id)
    assert again.complete and again.verify() == []
