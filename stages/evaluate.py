"""`dihal evaluate`: bridge fidelity (--bridge) or generation quality (--samples), METHOD §3."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pandas as pd
import torch

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages.configs import FidelityConfig, SamplesConfig
from dihal.stages.fidelity import evaluate_fidelity
from dihal.stages.lineage import backbone_for, origin, same_model, trained_on
from dihal.stages.lm.hybrid import lm_logits
from dihal.stages.lm.models import LoadedModel, load_model, weights_digests
from dihal.stages.lm.tokens import start_token
from dihal.stages.parts.bridge import Bridge
from dihal.stages.runtime import dist
from dihal.stages.text.data import DataConfig, check, hashed_source, pack

STAGE = "evaluate"
CACHE_VERSION = 2  # 2: fidelity by position has each model's NLL (issue 47). Bump whenever its bytes change


def validation_ids(extract: Artifact, limit: int) -> torch.Tensor:
    group = hs.open_group(extract)
    seqs = hs.split_indices(group, "validation")[:limit]
    if seqs.size == 0:
        raise DihalError(f"extract {extract.id} has no validation sequences to evaluate on")
    return torch.from_numpy(np.asarray(group["input_ids"].oindex[seqs]).astype(np.int64))


def readable(bridge_art: Artifact, theirs, own) -> bool:
    """An extract's sequences are the bridge's to read: its model's, of its --seq-len, or longer for a
    rotary bridge."""
    if theirs == own:
        return True
    rotary = bridge_art.config.get("positions") == "rotary"
    return rotary and (theirs.model, theirs.revision) == (own.model, own.revision) and theirs.seq_len > own.seq_len


def unseen(held_out: Artifact, own: Artifact) -> bool:
    """The validation split of extract held_out holds no document the extract `own` trains on: each
    source the two share is split by the same rule (METHOD §0: the same seed and
    fraction give every document the same split)."""
    a, b = held_out.config["data"], own.config["data"]
    shared = {a["dataset"], *a.get("also", ())} & {b["dataset"], *b.get("also", ())}
    return not shared or (a["seed"], a["val_fraction"]) == (b["seed"], b["val_fraction"])


def dataset_ids(cfg: FidelityConfig, tokenizer, seq_len: int) -> torch.Tensor:
    """The first --limit sequences of --dataset, tokenized and packed as the extract packs its own."""
    data = DataConfig(dataset=cfg.dataset, seq_len=seq_len, max_sequences=cfg.limit, val_fraction=0.0)
    packed = pack(data, tokenizer)
    return torch.from_numpy(packed.input_ids.astype(np.int64))


def sample_ids(gen_art: Artifact, tokenizer, seq_len: int, limit: int) -> tuple[list[torch.Tensor], str]:
    """A generate artifact's samples as sequences from the start token (at most seq_len tokens): the
    original backbone's when it has them, else its own; one tensor per length, longest first, so a
    sample that ended early costs no position of the others. Samples with no token are left out."""
    name = "samples_original.jsonl" if gen_art.file("samples_original.jsonl").exists() else "samples.jsonl"
    samples = [json.loads(line) for line in gen_art.file(name).read_text().splitlines()][:limit]
    start = start_token(tokenizer)[0]
    seqs = [[start, *s["token_ids"]][:seq_len] for s in samples if not s.get("prompt")]
    seqs = [q for q in seqs if len(q) >= 2]
    if not seqs:
        raise DihalError(f"generate {gen_art.id} has no unprompted sample with a token to measure fidelity on")
    lengths = sorted({len(q) for q in seqs}, reverse=True)
    return [torch.tensor([q for q in seqs if len(q) == n], dtype=torch.int64) for n in lengths], name


def check_inputs(cfg: FidelityConfig) -> None:
    """Local data named by --dataset is read whole and checked before any work (one error: line)."""
    if cfg.dataset is not None:
        check(DataConfig(dataset=cfg.dataset))


def fidelity_key(cfg: FidelityConfig) -> dict:
    """What a fidelity id hashes: the flags, with a local --dataset named by its content (its last path part
    and its files' digest, as an extract's) and pydoc by the Python that wrote it, so that an edited file is
    another measurement and another spelling of its path the same one."""
    config = {"kind": "fidelity", **asdict(cfg)}
    if cfg.dataset is not None:
        config["dataset"], extra = hashed_source(DataConfig(dataset=cfg.dataset))
        config.update(extra)
    return config


def fidelity_cached(cfg: FidelityConfig, bridge_art: Artifact, store: ArtifactStore) -> bool:
    """Whether the fidelity of bridge_art on its own validation split is in the store (then no model loads)."""
    return store.cached(Job(STAGE, CACHE_VERSION, fidelity_key(cfg), {"bridge": bridge_art.id})) is not None


def samples_cached(cfg: SamplesConfig, gen_art: Artifact, store: ArtifactStore) -> bool:
    """Whether the scores of gen_art's samples are in the store."""
    return store.cached(Job(STAGE, CACHE_VERSION, samples_key(cfg), {"generate": gen_art.id})) is not None


def samples_key(cfg: SamplesConfig) -> dict:
    """What a samples score's id hashes: the flags, and a local --evaluator by its files."""
    return {"kind": "samples", **asdict(cfg), **weights_digests(evaluator=cfg.evaluator)}


def run_fidelity(
    cfg: FidelityConfig,
    bridge_art: Artifact,
    store: ArtifactStore,
    *,
    force: bool = False,
    loaded: LoadedModel | None = None,
    trust_remote_code: bool = False,
    samples: Artifact | None = None,
    held_out: Artifact | None = None,
) -> Artifact:
    """Teacher-forced fidelity on the validation split of the bridge's extract (or of `held_out`, an
    extract of the same model and seq_len), on --dataset, or on `samples`."""
    own_extract = store.load("extract", bridge_art.manifest["parents"]["extract"])
    held_out = None if held_out is not None and held_out.id == own_extract.id else held_out
    if not own_extract.complete and samples is None and cfg.dataset is None and held_out is None:
        where = "was imported without it" if bridge_art.manifest.get("imported") else f"is {own_extract.status}"
        raise DihalError(
            f"fidelity reads the validation split of the bridge's extract {own_extract.id}, which {where}; "
            "give --dataset SPEC (or --extract ID of the same model and --seq-len)"
        )
    if sum(x is not None for x in (samples, cfg.dataset, held_out)) > 1:
        raise DihalError("measure fidelity on one of --dataset, --samples or --extract")
    if held_out is not None and not readable(bridge_art, origin(held_out), origin(bridge_art)):
        longer = " (or longer: a --positions rotary bridge runs past its --seq-len)"
        raise DihalError(
            f"extract {held_out.id} is not of the bridge's model and --seq-len ({origin(bridge_art).model}, "
            f"{origin(bridge_art).seq_len}); give an extract of those{longer}"
        )
    if samples is not None and not same_model(samples.manifest.get("model"), bridge_art.manifest.get("model")):
        raise DihalError(f"generate {samples.id} did not come from the bridge's backbone; use samples of that model")
    check_inputs(cfg)
    config, parents = fidelity_key(cfg), {"bridge": bridge_art.id}
    if samples is not None:
        parents["generate"] = samples.id
    if held_out is not None:
        parents["extract"] = held_out.id

    def work(art: Artifact) -> None:
        nonlocal loaded
        loaded = loaded or backbone_for(bridge_art, cfg.device, cfg.dtype, trust_remote_code)
        bridge = Bridge.load(bridge_art, cfg.device)
        seq_len = origin(bridge_art).seq_len
        unseen_text = True  # the extract's validation split; samples the bridge was not trained on
        if samples is not None:
            ids, source = sample_ids(samples, loaded.tokenizer, seq_len, cfg.limit)
            unseen_text = samples.id not in trained_on(store, bridge_art)
            source = f"generate {samples.id} ({source}{'' if unseen_text else ', which the bridge was trained on'})"
        elif cfg.dataset is not None:
            ids, source = dataset_ids(cfg, loaded.tokenizer, seq_len), f"dataset {cfg.dataset}"
            unseen_text = None  # whether its text overlaps the training text is not known here
        elif held_out is not None:
            ids, source = validation_ids(held_out, cfg.limit), f"extract {held_out.id} validation split"
            unseen_text = unseen(held_out, own_extract)
        else:
            ids, source = validation_ids(own_extract, cfg.limit), "extract validation split"
        totals = evaluate_fidelity(loaded.model, bridge, ids, list(cfg.sample_steps), cfg.batch_size, cfg.seed)
        rows = [{"steps": s, **t.metrics()} for s, t in totals.items()]
        by_position = [{"steps": s, **r} for s, t in totals.items() for r in t.position_metrics()]
        pd.DataFrame(rows).to_csv(art.file("fidelity.csv"), index=False)
        pd.DataFrame(by_position).to_csv(art.file("fidelity_by_position.csv"), index=False)
        groups = ids if isinstance(ids, list) else [ids]
        summary = {
            "layer": bridge.layer,
            "source": source,
            "held_out": unseen_text,
            "n_sequences": sum(int(g.shape[0]) for g in groups),
            "seq_len": max(int(g.shape[1]) for g in groups),
        }
        art.file("results.json").write_text(json.dumps({**summary, "fidelity": rows}, indent=2))
        art.manifest["metrics"] = {**summary, "fidelity": rows}

    extra = {"model": bridge_art.manifest.get("model")}
    job = Job(STAGE, CACHE_VERSION, config, parents, work, seed=cfg.seed, device=cfg.device, extra=extra)
    return store.run_stage(job, force=force, group=dist.group())


OTHER_BUILTIN = {"smollm2-135m": "gemma3-270m", "gemma3-270m": "smollm2-135m"}


def second_evaluator(evaluator: str | None, backbone: str) -> str:
    """The evaluator named, else the other builtin; a second opinion on Gen.PPL."""
    if evaluator:
        return evaluator
    if backbone in OTHER_BUILTIN:
        return OTHER_BUILTIN[backbone]
    raise DihalError(f"name a second evaluator for {backbone} with --evaluator (a model other than the backbone)")


EVAL_BATCH = 16  # texts per evaluator forward, right-padded (a causal model's real positions never see the padding)
HEAD_ROWS = 1024  # scored positions per pass through the LM head: 1 GiB of float32 logits at a 262k vocabulary


def _forward_padded(loaded: LoadedModel, rows: list[list[int]]) -> torch.Tensor:
    """(B, T, D) last-layer states of token-id rows of any lengths, right-padded and masked."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    ids, mask = ids.to(loaded.device), mask.to(loaded.device)
    return loaded.model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state


def _batches(rows: list[list[int]], batch_size: int):
    """Indices of rows in batches of similar length (less padding), each batch in order."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    for b in range(0, len(order), batch_size):
        yield order[b : b + batch_size]


def _token_nll(model, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """-log p(target) of each row of last-layer states under the model's LM head."""
    return -torch.log_softmax(lm_logits(model, hidden), -1).gather(-1, target[:, None])[:, 0]


@torch.no_grad()
def sample_nlls(
    loaded: LoadedModel, prompts: list[str], texts: list[str], batch_size: int = EVAL_BATCH
) -> list[tuple[float, int]]:
    """(summed NLL, token count) of each text's tokens under the evaluator, given BOS + prompt."""
    from dihal.stages.generate import prompt_ids

    tok, model = loaded.tokenizer, loaded.model
    fulls = [prompt_ids(tok, prompt + text) for prompt, text in zip(prompts, texts)]
    n_new = [len(full) - len(prompt_ids(tok, prompt)) for prompt, full in zip(prompts, fulls)]
    out = [(0.0, 0)] * len(texts)
    scored = [i for i in range(len(texts)) if n_new[i] > 0]
    for batch in _batches([fulls[i] for i in scored], batch_size):
        chosen = [scored[k] for k in batch]
        hidden = _forward_padded(loaded, [fulls[i] for i in chosen])
        # the scored positions of the whole batch through the head at once, HEAD_ROWS at a time (O(rows x V))
        rows = torch.cat([hidden[r, len(fulls[i]) - n_new[i] - 1 : len(fulls[i]) - 1] for r, i in enumerate(chosen)])
        target = torch.tensor([t for i in chosen for t in fulls[i][len(fulls[i]) - n_new[i] :]], device=rows.device)
        nll = (
            torch.cat(
                [
                    _token_nll(model, rows[a : a + HEAD_ROWS], target[a : a + HEAD_ROWS])
                    for a in range(0, len(rows), HEAD_ROWS)
                ]
            )
            .double()
            .cpu()
        )
        for i, part in zip(chosen, nll.split([n_new[i] for i in chosen])):
            out[i] = (float(part.sum()), n_new[i])
    return out


@torch.no_grad()
def last_token_features(loaded: LoadedModel, texts: list[str], batch_size: int = EVAL_BATCH) -> np.ndarray:
    """(N, D) the evaluator's last-layer state at each text's last token, after the start token: the
    features MAUVE compares (as MAUVE's reference code does with GPT-2's)."""
    from dihal.stages.generate import prompt_ids

    rows = [prompt_ids(loaded.tokenizer, text) for text in texts]
    out = [None] * len(rows)
    for batch in _batches(rows, batch_size):
        hidden = _forward_padded(loaded, [rows[i] for i in batch])
        for k, i in enumerate(batch):
            out[i] = hidden[k, len(rows[i]) - 1].float().cpu()
    return torch.stack(out).numpy().astype(np.float64) if out else np.zeros((0, 0))


def gen_ppl(nlls: list[tuple[float, int]]) -> dict[str, float]:
    scored = [(s, n) for s, n in nlls if n > 0]
    if not scored:
        return {"gen_ppl_token": float("nan"), "gen_ppl_mean": float("nan")}
    return {
        "gen_ppl_token": float(np.exp(sum(s for s, _ in scored) / sum(n for _, n in scored))),
        "gen_ppl_mean": float(np.mean([np.exp(s / n) for s, n in scored])),
    }


def run_samples(
    cfg: SamplesConfig,
    gen_art: Artifact,
    store: ArtifactStore,
    *,
    force: bool = False,
    loaded: LoadedModel | None = None,
    trust_remote_code: bool = False,
) -> Artifact:
    from dihal.stages.text.text_metrics import text_metrics, token_entropy

    config, parents = samples_key(cfg), {"generate": gen_art.id}

    def work(art: Artifact) -> None:
        nonlocal loaded
        spec = cfg.evaluator or origin(gen_art).model
        loaded = loaded or load_model(spec, cfg.device, cfg.dtype, trust_remote_code=trust_remote_code)
        rows, per_sample = [], []
        for name in ("samples.jsonl", "samples_original.jsonl"):
            if not gen_art.file(name).exists():
                continue
            samples = [json.loads(l) for l in gen_art.file(name).read_text().splitlines()][: cfg.limit]
            texts = [s["text"] for s in samples]
            nlls = sample_nlls(loaded, [s["prompt"] for s in samples], texts, cfg.batch_size)
            per_sample += [
                {
                    "model": s["model"],
                    "index": i,
                    "nll": nll,
                    "n_scored": n,
                    "n_tokens": s["n_tokens"],
                    "token_entropy": token_entropy([s["token_ids"]]) if s["token_ids"] else float("nan"),
                }
                for i, (s, (nll, n)) in enumerate(zip(samples, nlls))
            ]
            rows.append(
                {
                    "model": samples[0]["model"],
                    "n_samples": len(samples),
                    **gen_ppl(nlls),
                    **text_metrics(texts),
                    "token_entropy": token_entropy([s["token_ids"] for s in samples]),
                    "mean_tokens": float(np.mean([s["n_tokens"] for s in samples])),
                }
            )
        pd.DataFrame(rows).to_csv(art.file("generation.csv"), index=False)
        pd.DataFrame(per_sample).to_csv(art.file("per_sample.csv"), index=False)  # for intervals over samples
        art.file("results.json").write_text(json.dumps({"evaluator": spec, "rows": rows}, indent=2))
        art.manifest["metrics"] = {"evaluator": spec, "rows": rows}

    extra = {"model": gen_art.manifest.get("model")}
    job = Job(STAGE, CACHE_VERSION, config, parents, work, device=cfg.device, extra=extra)
    return store.run_stage(job, force=force, group=dist.group())
