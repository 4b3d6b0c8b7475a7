"""Dolma as it is published (issue 46): a URL list served over HTTP on the loopback address, gzipped
JSON-lines shards of two sources whose `metadata` differ, read with only their text; the mix seeded and
spread over the sources; the shard list in the manifest; loading-script hub datasets refused in the plan."""

from __future__ import annotations

import functools
import gzip
import http.server
import importlib.util
import json
import threading

import numpy as np
import pytest

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from dihal.stages.text import dolma
from tests.conftest import invoke
from tests.test_hardening import _one_error_line

# source -> (its shards in the list, the word its documents are made of, its metadata struct)
SOURCES = {
    "algebraic-stack": (1, "beta", lambda i: {"lang": "python", "stars": i}),
    "c4": (3, "alpha", lambda i: {"url": f"http://c4/{i}", "timestamp": "2019", "extra": {"a": [1, 2]}}),
}
DOCS_PER_SHARD = 150


def write_shards(folder) -> list[str]:
    """Dolma-format shards (id, text, added, source, metadata) under folder/dolma-v1_7/<source>/; their
    paths relative to folder, in the list's order."""
    names, rng = [], np.random.default_rng(0)
    filler = ["the", "a", "of", "data", "model", "text", "and"]
    for source, (count, word, metadata) in SOURCES.items():
        for shard in range(count):
            name = f"dolma-v1_7/{source}/{source}-train-{shard:04d}.json.gz"
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(folder / name, "wt") as fh:
                for i in range(DOCS_PER_SHARD):
                    text = f"{word} {shard} " + " ".join(rng.choice(filler, size=30)) + f" {word}"
                    record = {"id": f"{source}-{shard}-{i}", "text": text, "added": "2024", "source": source}
                    fh.write(json.dumps({**record, "metadata": metadata(i)}) + "\n")
            names.append(name)
    return names


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(URL of the list, folder): the shards and urls/v1_7.txt served over HTTP on 127.0.0.1."""
    folder = tmp_path_factory.mktemp("dolma")
    names = write_shards(folder)
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    (folder / "urls").mkdir()
    (folder / "urls" / "v1_7.txt").write_text("".join(f"{base}/{n}\n" for n in names))
    yield f"{base}/urls/v1_7.txt", folder
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _extract(tiny_dirs, dataset: str, *extra: str) -> list[str]:
    return [
        "extract",
        "--model",
        str(tiny_dirs["llama"]),
        "--dataset",
        dataset,
        "--max-sequences",
        "60",
        "--seq-len",
        "16",
        "--layers",
        "0,2",
        "--shuffle-buffer",
        "50",
        "--device",
        "cpu",
        *extra,
    ]


def _words(art) -> dict[str, int]:
    """How many times each source's word appears in the extract's sequences."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art.manifest["model"]["path"])
    text = " ".join(tok.batch_decode(np.asarray(hs.open_group(art)["input_ids"][:])))
    return {source: text.count(word) for source, (_, word, _) in SOURCES.items()}


def test_dolma_over_http_mixes_both_sources_by_their_share_and_records_its_shards(tiny_dirs, served, root):
    url, _ = served
    first = invoke(*_extract(tiny_dirs, f"dolma:{url}"))
    assert first.exit_code == 0, first.output
    art = ArtifactStore(root).resolve("latest", "extract")
    info = art.manifest["dolma"][f"dolma:{url}"]
    shards = info["shards"]
    assert [s["source"] for s in shards] == ["algebraic-stack", "c4"]  # one of each source (--dolma-shards 1)
    assert all(s["location"].startswith(url.rsplit("/urls", 1)[0]) for s in shards)
    assert [s["weight"] for s in shards] == [0.25, 0.75]  # 1 and 3 of the list's 4 shards
    read = info["documents_read"]
    n = sum(read.values())
    share = read["c4"] / n
    assert abs(share - 0.75) < 3 * np.sqrt(0.75 * 0.25 / n), (read, n)  # the seeded draw follows the weights
    words = _words(art)
    assert words["algebraic-stack"] > 0 and words["c4"] > words["algebraic-stack"], words
    assert art.manifest["document_end"] == {"id": 2, "token": "<eos>", "kind": "eos"}
    # the same command in another store: the same id and the same sequences
    again = invoke(*_extract(tiny_dirs, f"dolma:{url}"), "--root", str(root.parent / "other"))
    assert again.exit_code == 0, again.output
    other = ArtifactStore(root.parent / "other").resolve("latest", "extract")
    assert other.id == art.id
    assert np.array_equal(hs.open_group(other)["input_ids"][:], hs.open_group(art)["input_ids"][:])
    # another seed: another choice of c4's three shards is possible, and the id moves
    seeded = invoke(*_extract(tiny_dirs, f"dolma:{url}"), "--seed", "3", "--dry-run")
    assert seeded.exit_code == 0 and art.id not in seeded.output, seeded.output


def test_the_shard_choice_is_seeded_and_spread_over_every_source():
    listed = [f"https://x/v/{s}/{s}-{k:04d}.json.gz" for s, n in (("a", 5), ("b", 20), ("c", 2)) for k in range(n)]
    chosen = dolma.choose(listed, 2, seed=0)
    assert [s.source for s in chosen] == ["a", "a", "b", "b", "c", "c"]
    assert dolma.choose(listed, 2, seed=0) == chosen
    picks = {tuple(s.location for s in dolma.choose(listed, 2, seed=k) if s.source == "b") for k in range(8)}
    assert len(picks) > 4  # not the first files: another seed, other shards
    weights = {s.source: 0.0 for s in chosen}
    for s in chosen:
        weights[s.source] += s.weight
    assert weights == pytest.approx({"a": 5 / 27, "b": 20 / 27, "c": 2 / 27})
    flat = [f"/d/{s}-{k:04d}.json.gz" for s in ("books", "c4") for k in range(3)]  # one folder: by name
    assert {s.source for s in dolma.choose(flat, 1, seed=0)} == {"books", "c4"}


def test_downloaded_shards_read_offline_as_dolma_and_as_plain_gzipped_json(tiny_dirs, served, root, monkeypatch):
    _, folder = served
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shards = str(folder / "dolma-v1_7" / "*" / "*.json.gz")
    res = invoke(*_extract(tiny_dirs, f"dolma:{shards}"))
    assert res.exit_code == 0, res.output
    art = ArtifactStore(root).resolve("latest", "extract")
    assert {s["source"] for s in art.manifest["dolma"][f"dolma:{shards}"]["shards"]} == set(SOURCES)
    assert "data_sha256" in art.config  # downloaded shards: their bytes are in the id
    plain = invoke(*_extract(tiny_dirs, shards))  # the same files as a plain glob: read in order, text only
    assert plain.exit_code == 0, plain.output
    words = _words(ArtifactStore(root).resolve("latest", "extract"))
    assert words["algebraic-stack"] > 0 and words["c4"] == 0  # sorted names: algebraic-stack first


def test_a_loading_script_dataset_is_one_line_before_any_model_loads(tiny_dirs, root, no_model_loads):
    for extra in ([], ["--dry-run"]):
        res = invoke(*_extract(tiny_dirs, "allenai/dolma"), "--dataset-config", "v1_7", *extra)
        _one_error_line(res, "is a loading script")
        assert "--dataset dolma:v1_7" in res.output


def test_dolma_offline_and_bad_lists_are_one_line(tiny_dirs, tmp_path, root, monkeypatch, no_model_loads):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _one_error_line(invoke(*_extract(tiny_dirs, "dolma:v1_7")), "cannot read the URL list of Dolma v1_7")
    dry = invoke(*_extract(tiny_dirs, "dolma:v1_7"), "--dry-run")  # a dry run offline leaves it for the real run
    assert dry.exit_code == 0, dry.output
    listed = tmp_path / "urls.txt"
    listed.write_text("https://x/a/a-0000.parquet\n")
    _one_error_line(invoke(*_extract(tiny_dirs, f"dolma:{listed}")), "not a .json(l)[.gz|.zst] shard")
    _one_error_line(invoke(*_extract(tiny_dirs, f"dolma:{tmp_path}/none/*.json.gz")), "names no shard")
    if importlib.util.find_spec("zstandard") is None:  # not a dependency: without it, one line naming it
        (tmp_path / "x.json.zst").write_bytes(b"\x28\xb5\x2f\xfd")
        _one_error_line(invoke(*_extract(tiny_dirs, str(tmp_path / "x.json.zst"))), "pip install zstandard")


def test_a_gzipped_json_lines_file_with_a_bad_record_is_one_line(tiny_dirs, tmp_path, root, no_model_loads):
    path = tmp_path / "bad.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps({"text": "fine words here"}) + "\n" + json.dumps({"text": 7}) + "\n")
    _one_error_line(invoke(*_extract(tiny_dirs, str(path))), "record 1 of dataset")


REACH = "from dihal.stages.runtime import hub; print(hub.reachable())"


def test_three_sources_with_mixed_schemas_in_one_shard_and_a_zst_shard_read_with_their_text(tiny_dirs, tmp_path, root):
    """Dolma's sources disagree on `metadata` (a struct, a list, null), sometimes within one shard, and ship
    .json.zst as well as .json.gz: three sources, one shard mixing all three schemas, one zstd-compressed, read
    offline with only their text; each source's word in the extract, as many documents read as written."""
    import zstandard

    base = tmp_path / "dolma-v1_7"
    metadata = [{"url": "http://x", "nested": {"a": 1}}, ["a", "list", 3], None, {"other": True}]
    words = {"mixed": "gamma", "books": "delta", "zstd": "epsilon"}
    for source, word in words.items():
        lines = []
        for i in range(60):
            record = {"id": f"{source}-{i}", "text": f"{word} " + "text of the document " * 4 + word}
            record |= {"source": source, "added": "2024" if i % 2 else 2024, "metadata": metadata[i % 4]}
            lines.append(json.dumps(record) + "\n")
        (base / source).mkdir(parents=True)
        data = "".join(lines).encode()
        if source == "zstd":
            (base / source / f"{source}-0000.json.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
        else:
            with gzip.open(base / source / f"{source}-0000.json.gz", "wb") as fh:
                fh.write(data)
    spec = f"dolma:{base}/*/*.json.*"
    res = invoke(*_extract(tiny_dirs, spec, "--max-sequences", "40"))
    assert res.exit_code == 0, res.output
    art = ArtifactStore(root).resolve("latest", "extract")
    info = art.manifest["dolma"][spec]
    assert sorted(s["source"] for s in info["shards"]) == sorted(words)
    assert any(s["location"].endswith(".json.zst") for s in info["shards"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art.manifest["model"]["path"])
    text = " ".join(tok.batch_decode(np.asarray(hs.open_group(art)["input_ids"][:])))
    assert all(text.count(word) > 0 for word in words.values()), {w: text.count(w) for w in words.values()}
    assert set(info["documents_read"]) == set(words)


def test_the_hub_is_reached_as_huggingface_hub_reaches_it(served):
    """Its endpoint (HF_ENDPOINT), its proxies (HTTP(S)_PROXY) and its offline switch, not a raw socket to
    huggingface.co: a user behind a proxy is not told they are offline."""
    import subprocess
    import sys

    url, _ = served
    endpoint = url.rsplit("/urls", 1)[0]
    env = {k: v for k, v in __import__("os").environ.items() if "PROXY" not in k.upper()}
    run = lambda **extra: subprocess.run(
        [sys.executable, "-c", REACH], env={**env, **extra}, capture_output=True, text=True, timeout=60
    ).stdout.strip()
    assert run(HF_ENDPOINT=endpoint) == "True"
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    assert run(HF_ENDPOINT=endpoint, HTTP_PROXY=dead, HTTPS_PROXY=dead) == "False"  # through the proxy
    assert run(HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="1") == "False"
