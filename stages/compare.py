"""`dihal compare`: the diagnostic comparison of METHOD §5 (revision 2), as one stage.

For every budget (multiples of the protocol's steps) and seed it trains (or finds in the store)
each part a row needs under ONE protocol, so the budget is matched: the prior over normalized h_0,
its self-conditioned twin (SED), the prior over normalized h_l* (DiHAL-direct), the CoDAR decoder,
the bridges at l* and at argmin S trained on corrupted conditions, and the section-2 bridge at l*
for the AR hybrid. Then it generates N sequences per row (rows that share a prior share its
weights and noise): every row that ends in a distribution at each temperature of the grid (a
curve of Gen.PPL against entropy), every rounding row once (a point); the controls read the
oracle prior (held-out real states) and the null prior (bare noise) through the same recoveries.

Headline of a row, per evaluator: a curve's Gen.PPL interpolated (log Gen.PPL, linear in entropy)
at the held-out text's entropy, or a point's own Gen.PPL, with a bootstrap interval over samples
and seeds that contains it. Claim 3's verdict compares DiHAL (l*) with each baseline at the
baseline's own entropies under the primary evaluator (a model other than the backbone).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages import (
    compare_stats,
    generate_parallel,
    registry,
    train_autoencoder,
    train_bridge,
    train_decoder,
    train_prior,
)
from dihal.stages import evaluate as eval_stage
from dihal.stages import generate as gen_stage
from dihal.stages import score as score_stage
from dihal.stages.configs import (
    PROTOCOLS,
    CompareConfig,
    DataConfig,
    GenerateConfig,
    check_evaluator,
    gpu_key,
)
from dihal.stages.lineage import origin, scored_extract
from dihal.stages.lm import tokens
from dihal.stages.lm.models import weights_digests
from dihal.stages.runtime import dist, plotting
from dihal.stages.runtime.progress import NullProgress, Progress
from dihal.stages.text.data import hashed_source
from dihal.stages.text.text_metrics import token_entropy

STAGE = "compare"
CACHE_VERSION = (
    5  # 2: AR rows' unprompted generation fixed; 3: METHOD §5, method revision 2; 4: seeds' diversity; 5: stops
)


def layers_from_score(score_art: Artifact, cfg: CompareConfig) -> tuple[int, int]:
    """(l*: --layer, else the score's own pick (argmax S, or argmax r2_token under its --select); argmin S)."""
    table = score_stage.load_table(score_art).set_index("layer")["S"]
    l_star = cfg.layer if cfg.layer is not None else int(score_art.manifest["metrics"]["l_star"])
    return l_star, int(table.idxmin())


def frozen_parameters(model, part: Artifact) -> int:
    """The pretrained parameters a part uses without training them: the decoder's embedding table; a
    bridge's upper blocks, final norm and LM head; nothing for a prior."""
    if part.stage == "decoder":
        return int(part.manifest.get("metrics", {}).get("frozen_parameters") or 0)
    if part.stage == "autoencoder":  # the frozen encoder: embeddings and blocks up to the layer it reads
        layer = part.manifest.get("metrics", {}).get("encoder_layer", len(model.model.layers))
        modules = [model.model.embed_tokens, *list(model.model.layers)[:layer]]
    elif part.stage == "bridge":
        modules = [*list(model.model.layers)[part.config["layer"] :], model.model.norm, model.lm_head]
    else:
        return 0
    return sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())


def part_row(name: str, art: Artifact, model) -> dict:
    m = art.manifest.get("metrics", {})
    return {
        "part": name,
        "id": art.id,
        "parameters": m.get("parameters"),
        "frozen_parameters": frozen_parameters(model, art),
        "steps": m.get("steps"),
        "global_batch": m.get("global_batch"),
        "tokens_seen": m.get("tokens_seen"),
        "val_loss": m.get("val_loss"),
        "unigram_entropy": m.get("unigram_entropy"),
        "reconstruction_accuracy": m.get("reconstruction_accuracy"),
        "wall_seconds": art.wall_seconds,
    }


def layer_names(l_star: int, worst: int, oracle: int | None, backbone: str = "the backbone") -> dict:
    """What the registry's layer names (and a row name's {backbone}) stand for in this comparison."""
    named = {"0": 0, "l_star": l_star, "worst": worst, **({"oracle": oracle} if oracle is not None else {})}
    return {**named, "backbone": backbone}


def active_rows(cfg: CompareConfig) -> list[registry.Row]:
    """The registry's rows this comparison runs, then DiHAL (l*) once for each other readout (--readout)."""
    rows = [
        row
        for row in registry.ROWS
        if (cfg.oracle is not None or not row.needs_oracle) and (not cfg.rows or row.key in cfg.rows)
    ]
    return rows + [registry.readout_row(r) for r in cfg.readouts if r != "independent"]


def budget_overrides(cfg: CompareConfig, k: int) -> dict:
    """The protocol's budget times k: its steps (or epochs, for an epoch protocol), after the overrides."""
    fields = {**PROTOCOLS[cfg.protocol], **dict(cfg.overrides)}
    if fields.get("steps") is not None:
        return {**dict(cfg.overrides), "steps": int(fields["steps"]) * k}
    return {**dict(cfg.overrides), "epochs": fields["epochs"] * k}


def part_configs(cfg: CompareConfig, seed: int, l_star: int, worst: int, k: int = 1) -> dict[str, tuple]:
    """{part label: (part, its stage's run, its config)} of one seed and budget: each distinct part of the
    registry's rows (and of the AR references) once, every one under the one protocol."""
    layers = layer_names(l_star, worst, cfg.oracle)
    common = dict(seed=seed, device=cfg.device, dtype=cfg.dtype)
    condition = dict(condition_noise=cfg.condition_noise, condition_from=cfg.condition_from)
    prior = dict(time_shift=cfg.prior_time_shift, token_ce=cfg.prior_token_ce, data=cfg.prior_data)
    prior.update(token_ce_max_t=cfg.prior_token_ce_max_t)
    overrides = budget_overrides(cfg, k) if k != 1 else dict(cfg.overrides)

    def build(spec) -> tuple:  # every kind of part alike: its stage, its config under the one protocol
        own = {k: v for k, v in overrides.items() if not (spec.fixed_depth and k == "depth")}
        fields = spec.fields(layers, condition, prior)
        # every part over a layer (h_0, h_l, the autoencoder's h_L) computes it; a prior over latents reads them, and
        # one over --prior-data corpus embeds its token ids, reading no layer either
        over_layer = not fields.get("latent") and fields.get("data", "extract") == "extract"
        if cfg.states == "model" and over_layer:
            fields["states"] = "model"
        part_cfg = registry.resolve(spec.config).for_run(cfg.protocol, own, **fields, **common)
        return spec, registry.resolve(spec.run), part_cfg

    specs = [spec for row in active_rows(cfg) for spec in row.parts()] + [registry.AR_REFERENCE_BRIDGE]
    return {spec.label(layers): build(spec) for spec in dict.fromkeys(specs)}


def reads_of(part_cfg) -> str | None:
    """The part a part's training reads: the prior's estimates (--condition-noise prior:T), or the autoencoder's
    latents (a prior over them); None."""
    if getattr(part_cfg, "latent", False):
        return "autoencoder"
    return "prior" if getattr(part_cfg, "condition_from", None) == "prior" else None


def train_parts(
    cfg: CompareConfig,
    extract,
    store,
    seed: int,
    l_star: int,
    worst: int,
    k: int,
    progress: Progress,
    loaded,
    only=None,
) -> dict[str, Artifact]:
    """Every part of one seed and budget (only: those labels and the parts they read), in training order: a
    part another reads comes first. loaded() -> the backbone this comparison holds; the decoder and the
    autoencoder read their frozen embedding table from it instead of loading it again."""
    configs = part_configs(cfg, seed, l_star, worst, k)
    wanted = set(configs if only is None else only)
    for name in reversed(list(configs)):  # a part's reads, and theirs
        if name in wanted and reads_of(configs[name][2]) is not None:
            wanted.add(reads_of(configs[name][2]))
    parts = {}
    for name, (spec, run, part_cfg) in configs.items():
        if name not in wanted:
            continue
        reads = {}
        if (needs := reads_of(part_cfg)) is not None:
            reads = {"latents" if needs == "autoencoder" else needs: parts[needs]}
        if spec.reads_backbone:
            reads["loaded"] = loaded()
        parts[name] = run(part_cfg, extract, store, progress=progress, **reads)
    return parts


def generations(cfg: CompareConfig) -> list[dict]:
    """Every generation of one seed and budget: (row, source, temperature) and what it reads, then the AR
    references (the backbone's own AR samples and the hybrid's, at each temperature)."""
    out = []
    for row in active_rows(cfg):
        temps = cfg.temperatures if row.curve else (None,)
        sources = ["prior"] + (["oracle", "null"] if (row.controls_of or row.key) in cfg.controls else [])
        for source in sources:
            for t in temps if source == "prior" else (temps[-1],):  # controls at the grid's last temperature
                what = {"key": row.key, "source": source, "temperature": t, "cost": row.cost}
                out.append({"row": row, **what, "kind": "curve" if row.curve else "point"})
    for t in cfg.temperatures:
        what = {"key": AR_REFERENCES, "source": "prior", "temperature": t, "cost": "reference"}
        out.append({"row": None, **what, "kind": "curve"})
    return out


def generate_one(g: dict, cfg, parts, store, loaded, seed, l_star, worst, progress) -> Artifact:
    """One generation of generations(): a registry row's parallel one, or an AR reference."""
    layers = layer_names(l_star, worst, cfg.oracle)
    common = dict(sample_steps=cfg.sample_steps, num_samples=cfg.num_samples, batch_size=cfg.batch_size, seed=seed)
    common |= dict(device=cfg.device, dtype=cfg.dtype, top_p=cfg.top_p)
    row = g["row"]
    if row is None:
        reference = parts[registry.AR_REFERENCE_BRIDGE.label(layers)]
        t = g["temperature"]
        ar = GenerateConfig(max_new_tokens=origin(reference).seq_len - 1, baseline="original", temperature=t, **common)
        return gen_stage.run(ar, reference, store, loaded, progress=progress)
    gcfg = GenerateConfig(
        mode="parallel",
        recovery=row.recovery,
        clamp=row.clamp and g["source"] == "prior",
        source=g["source"],
        prior_steps=cfg.prior_steps,
        temperature=g["temperature"],
        readout=row.readout,
        guidance=cfg.guidance if row.readout != "independent" else GenerateConfig.guidance,
        **common,
    )
    part = parts[row.part.label(layers)] if row.part is not None else None
    prior = parts[row.prior.label(layers)]
    return generate_parallel.run_parallel(gcfg, prior, store, loaded, part, progress=progress)


def held_out_texts(extract: Artifact, loaded, n: int) -> tuple[list[str], list[list[int]]]:
    group = hs.open_group(extract)
    seqs = hs.split_indices(group, "validation")[:n]
    ids = np.asarray(group["input_ids"].oindex[seqs])[:, 1:]
    kept = [tokens.truncate(row.tolist(), loaded.stop_ids) for row in ids]
    return [loaded.tokenizer.decode(k, skip_special_tokens=True) for k in kept], kept


# Rows beside the registry's, by key; an AR reference generation holds both of its models' samples
AR_REFERENCES, AR_ROWS, HELD_OUT = "ar-references", {"hybrid": "ar-hybrid", "original": "ar-original"}, "held-out"
# Labels, used only where a table, JSON or plot is written (rows and sources are keys until then)
ROW_LABELS = {"ar-hybrid": "AR hybrid (l*)", "ar-original": "original (AR)", HELD_OUT: "held-out text"}


def row_labels(cfg: CompareConfig, plan: Plan) -> dict[str, str]:
    """Every row key of this comparison -> its label (the registry's name with its layer filled in)."""
    named = layer_names(plan.l_star, plan.worst, cfg.oracle, plan.short)
    return {**{row.key: row.label(named) for row in active_rows(cfg)}, **ROW_LABELS}


def labelled(frame: pd.DataFrame, rows: dict[str, str]) -> pd.DataFrame:
    """A frame of keys as it is written: its row and source columns turned into labels."""
    out = frame.copy()
    if "row" in out:
        out["row"] = out["row"].map(rows)
    if "source" in out:
        out["source"] = out["source"].map(registry.SOURCE_LABELS)
    return out


def scored_samples(art: Artifact, ev, store: ArtifactStore, cfg: CompareConfig) -> pd.DataFrame:
    """Per sample of a generate artifact: NLL and scored tokens under one evaluator (cached as an
    evaluate artifact; one made before it kept per-sample scores is remade)."""
    scfg = eval_stage.SamplesConfig(
        evaluator=ev.identity["name"], limit=cfg.num_samples, device=cfg.device, dtype=cfg.dtype
    )
    res = eval_stage.run_samples(scfg, art, store, loaded=ev)
    if not res.file("per_sample.csv").exists():
        res = eval_stage.run_samples(scfg, art, store, loaded=ev, force=True)
    return pd.read_csv(res.file("per_sample.csv"))


def texts_of(art: Artifact) -> dict[str, list[dict]]:
    out = {}
    for name in ("samples.jsonl", "samples_original.jsonl"):
        if art.file(name).exists():
            rows = [json.loads(line) for line in art.file(name).read_text().splitlines()]
            out[rows[0]["model"]] = rows
    return out


def sample_table(gens, evaluators: dict, store, cfg, budget: int, seed: int) -> pd.DataFrame:
    """One line per generated sample of one budget and seed, scored under both evaluators."""
    frames = []
    for what, art in gens:
        scores = {name: scored_samples(art, ev, store, cfg) for name, ev in evaluators.items()}
        for model, samples in texts_of(art).items():
            frame = pd.DataFrame(
                {
                    "budget": budget,
                    "seed": seed,
                    "row": AR_ROWS[model] if what["key"] == AR_REFERENCES else what["key"],
                    "kind": what["kind"],
                    "source": what["source"],
                    "temperature": what["temperature"],
                    "index": range(len(samples)),
                    "text": [r["text"] for r in samples],
                    "n_tokens": [r["n_tokens"] for r in samples],
                    "ms_per_sample": art.manifest["metrics"].get(model, art.manifest["metrics"]).get("ms_per_sample"),
                    "cost": what["cost"],
                    "plan_agreement": art.manifest["metrics"].get("plan_agreement"),  # METHOD §5.1, per artifact
                    "generate": art.id,
                }
            )
            for name, sc in scores.items():
                sc = sc[sc["model"] == model].set_index("index").loc[frame["index"]]
                frame[f"nll_{name}"], frame[f"n_{name}"] = sc["nll"].to_numpy(), sc["n_scored"].to_numpy()
                frame["token_entropy"] = sc["token_entropy"].to_numpy()
            frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def held_out_samples(texts: list[str], ids: list[list[int]], evaluators: dict) -> pd.DataFrame:
    """The held-out text of the same length, scored like a row (the same for every budget and seed)."""
    frame = pd.DataFrame(
        {
            "row": HELD_OUT,
            "kind": "point",
            "source": compare_stats.DATA,
            "temperature": np.nan,
            "index": range(len(texts)),
            "text": texts,
            "n_tokens": [len(i) for i in ids],
            "token_entropy": [token_entropy([i]) if i else np.nan for i in ids],
        }
    )
    for name, ev in evaluators.items():
        nlls = eval_stage.sample_nlls(ev, [""] * len(texts), texts)
        frame[f"nll_{name}"], frame[f"n_{name}"] = [n for n, _ in nlls], [c for _, c in nlls]
    return frame


def plot(lines: pd.DataFrame, rows: dict[str, str], h_ref: float, path, title: str) -> None:
    """Gen.PPL against entropy under each evaluator (a line per curve row, a marker per point row, the
    held-out entropy dashed) and diversity against primary Gen.PPL at the grid's top temperature."""
    fig, axes = plotting.figure(16, 5, ncols=3)
    mean = (
        lines[lines.source.isin([compare_stats.TRAINED, compare_stats.DATA])]
        .groupby(["row", "kind", "temperature"], dropna=False, sort=False)
        .mean(numeric_only=True)
        .reset_index()
    )
    mean["row"] = mean["row"].map(rows)
    for ax, ev in zip(axes[:2], compare_stats.EVALUATORS):
        for (row, kind), g in mean.groupby(["row", "kind"], sort=False):
            g = g.sort_values("token_entropy")
            style = dict(marker="o") if kind == "curve" else dict(marker="s", linestyle="none", markersize=8)
            ax.plot(g["token_entropy"], g[f"gen_ppl_token_{ev}"], label=row, **style)
        ax.axvline(h_ref, color="gray", linestyle="--")
        ax.set_yscale("log")
        ax.set_xlabel("mean per-sample token entropy (nats)")
        ax.set_ylabel(f"Gen.PPL under the {ev}")
        ax.set_title(f"{ev}: lower is better at equal entropy", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    top = mean[(mean.kind == "point") | (mean.temperature == mean.temperature.max())]
    axes[2].scatter(top["gen_ppl_token_evaluator"], top["diversity"])
    for _, r in top.iterrows():
        axes[2].annotate(r["row"], (r["gen_ppl_token_evaluator"], r["diversity"]), fontsize=7)
    axes[2].set_xscale("log")
    axes[2].set_xlabel("Gen.PPL under the evaluator")
    axes[2].set_ylabel("diversity")
    plotting.save(fig, axes[2], path, title)


@dataclass(frozen=True)
class Plan:
    """What check() settles before anything runs."""

    l_star: int
    worst: int
    backbone: str  # the extract's model spec
    short: str  # its name in the rows' labels
    primary: str  # the primary evaluator


def check(cfg: CompareConfig, extract: Artifact, score_art: Artifact, store: ArtifactStore) -> Plan:
    """Every way the comparison's inputs disagree, one line each, before any model loads."""
    scored_extract(score_art, extract, store, computed=cfg.states == "model")
    if "dihal-oracle" in cfg.rows + cfg.controls and cfg.oracle is None:
        raise DihalError("the dihal-oracle row needs --oracle LAYER (a sweep's oracle layer)")
    l_star, worst = layers_from_score(score_art, cfg)
    needed = {0, l_star, worst} | ({cfg.oracle} if cfg.oracle else set())
    if cfg.states == "model":  # every layer is computed from the token ids by the backbone: none is read
        deepest, blocks = max(needed), int(extract.manifest["metrics"]["num_blocks"])
        if deepest > blocks:
            raise DihalError(f"--states model runs the backbone's first {deepest} blocks, but it has {blocks}")
        needed = set()
    hs.open_with_layers(extract, needed, ": compare needs layers 0, l*, argmin S (and the oracle)")
    backbone = extract.config["model"]
    primary = eval_stage.second_evaluator(cfg.evaluator, backbone)
    check_evaluator(primary, backbone)
    group = hs.open_group(extract)
    n_val = len(hs.split_indices(group, "validation"))
    if cfg.controls and n_val < cfg.num_samples:
        raise DihalError(
            f"the oracle controls read {cfg.num_samples} held-out sequences but extract {extract.id} has {n_val}; "
            "use a smaller --num-samples, a larger --val-fraction, or --controls ''"
        )
    return Plan(l_star, worst, backbone, Path(backbone).name, primary)


@dataclass(frozen=True)
class Unit:
    """A piece of a comparison that any rank does alone (dist.share), with its own artifacts and randomness
    (seeded from its seed, never the rank): one part's training, or one generation and its scoring under both
    evaluators, of one budget and seed. A part comes a wave after the part it reads; the generations after
    every part. Its cost, for dealing: the budget's multiple for a part, 1 for a generation."""

    budget: int
    seed: int
    what: str  # a part's label, or a generation's (row, source, temperature)
    wave: int
    generation: int | None = None  # its index in generations()

    @property
    def cost(self) -> float:
        return float(self.budget if self.generation is None else 1)

    def name(self) -> str:
        return f"budget x{self.budget}, seed {self.seed}: {self.what}"


def units(cfg: CompareConfig, plan: Plan) -> list[Unit]:
    """Every unit of the comparison, in the order one process does them."""
    out = []
    for k in cfg.budgets:
        for seed in cfg.seeds:
            configs, wave = part_configs(cfg, seed, plan.l_star, plan.worst, k), {}
            for name, (_, _, part_cfg) in configs.items():
                needs = reads_of(part_cfg)
                wave[name] = 0 if needs is None else wave[needs] + 1
                out.append(Unit(k, seed, name, wave[name]))
    last = max(u.wave for u in out) + 1
    for k in cfg.budgets:
        for seed in cfg.seeds:
            for i, g in enumerate(generations(cfg)):
                what = f"{g['key']}, {g['source']}, t={g['temperature']}"
                out.append(Unit(k, seed, what, last, i))
    return out


def evaluators(model, plan: Plan) -> dict:
    """The primary evaluator and the backbone, by model(spec): load_model under functools.cache, so each loads
    on first use by the rank that needs it."""
    return {"evaluator": model(plan.primary), "backbone": model(plan.backbone)}


def do_units(cfg: CompareConfig, plan: Plan, extract: Artifact, store, model, progress) -> None:
    """Every unit done once over the ranks of this command (a wave at a time: each ends when every rank has
    done its share of it), every one an artifact in the store."""
    backbone = lambda: model(plan.backbone)
    train = lambda k, seed, inner, only=None: train_parts(
        cfg, extract, store, seed, plan.l_star, plan.worst, k, inner, backbone, only
    )
    parts = functools.cache(lambda k, seed: train(k, seed, NullProgress()))  # a generation's: each a cache hit

    def do(unit: Unit, inner: Progress) -> None:
        if unit.generation is None:
            train(unit.budget, unit.seed, inner, only={unit.what})
            return
        g = generations(cfg)[unit.generation]
        art = generate_one(
            g, cfg, parts(unit.budget, unit.seed), store, backbone(), unit.seed, plan.l_star, plan.worst, inner
        )
        for ev in evaluators(model, plan).values():
            scored_samples(art, ev, store, cfg)

    todo = units(cfg, plan)
    for wave in sorted({u.wave for u in todo}):
        dist.share([u for u in todo if u.wave == wave], do, Unit.name, cost=lambda u: u.cost, progress=progress)


def collect(cfg: CompareConfig, plan: Plan, extract: Artifact, store: ArtifactStore, model) -> dict:
    """Every unit's artifacts (each a cache hit after do_units) gathered into {samples (one line per sample,
    the held-out text's too), parts, texts, h_ref, evaluators}."""
    loaded, scorers = model(plan.backbone), evaluators(model, plan)
    texts, ids = held_out_texts(extract, loaded, cfg.num_samples)
    real = held_out_samples(texts, ids, scorers)
    frames, parts_table, quiet = [], [], NullProgress()
    for k in cfg.budgets:
        for seed in cfg.seeds:
            parts = train_parts(cfg, extract, store, seed, plan.l_star, plan.worst, k, quiet, lambda: loaded)
            parts_table += [{"budget": k, "seed": seed, **part_row(n, a, loaded.model)} for n, a in parts.items()]
            gens = [
                (
                    {k: v for k, v in g.items() if k != "row"},
                    generate_one(g, cfg, parts, store, loaded, seed, plan.l_star, plan.worst, quiet),
                )
                for g in generations(cfg)
            ]
            frames.append(sample_table(gens, scorers, store, cfg, k, seed))
            frames.append(real.assign(budget=k, seed=seed))
    return {
        "samples": pd.concat(frames, ignore_index=True),
        "parts": pd.DataFrame(parts_table),
        "texts": texts,
        "h_ref": float(real["token_entropy"].mean()),
        "evaluators": scorers,
    }


def write(art: Artifact, cfg: CompareConfig, plan: Plan, got: dict, stats: dict, ours: str, seconds: float) -> None:
    """The tables (CSV), compare.json, a plot per budget, and the manifest's metrics: every row and source
    key turned into its label here."""
    rows = row_labels(cfg, plan)
    lines, heads, controls = (labelled(stats[k], rows) for k in ("lines", "heads", "controls"))
    parts = got["parts"]
    lines.to_csv(art.file("compare.csv"), index=False)
    heads.to_csv(art.file("summary.csv"), index=False)
    controls.to_csv(art.file("controls.csv"), index=False)
    parts.to_csv(art.file("parts.csv"), index=False)
    labelled(got["samples"], rows).drop(columns=["text"]).to_csv(art.file("samples.csv"), index=False)
    control_means = controls.groupby(["budget", "row", "source"], sort=False)[
        ["gen_ppl_token_evaluator", "gen_ppl_token_backbone", "token_entropy", "diversity"]
    ].mean()  # over seeds
    name = lambda v, key: {**v, key: rows[v[key]]}
    verdicts = [{**v, "baselines": [name(b, "baseline") for b in v["baselines"]]} for v in stats["verdicts"]]
    by_class = [
        name({**v, "baselines": [name(b, "baseline") for b in v["baselines"]]}, "dihal") for v in stats["by_class"]
    ]
    result = {
        "l_star": plan.l_star,
        "argmin_S": plan.worst,
        "oracle": cfg.oracle,
        "evaluators": {"backbone": plan.backbone, "evaluator": plan.primary},
        "held_out_entropy": got["h_ref"],
        "mauve": compare_stats.mauve_available() or "not installed (pip install dihal[mauve])",
        "temperatures": list(cfg.temperatures),
        "budgets": list(cfg.budgets),
        "seeds": list(cfg.seeds),
        "ours": rows[ours],
        "summary": heads.to_dict("records"),
        "verdicts": verdicts,
        "verdicts_by_class": by_class,  # like with like (METHOD §5.1)
        "lm_written": sorted({h["row"] for h in heads.to_dict("records") if h.get("lm_written") is True}),
        "parts": parts.to_dict("records"),
        "controls": control_means.reset_index().to_dict("records"),
        "wall_seconds": seconds,
    }
    art.file("compare.json").write_text(json.dumps(result, indent=2, default=float))
    for k in cfg.budgets:
        title = f"section 5 at {k}x the protocol's steps; seeds {list(cfg.seeds)}"
        plot(stats["lines"][stats["lines"].budget == k], rows, got["h_ref"], art.file(f"compare_x{k}.png"), title)
    big = ("summary", "parts", "verdicts", "verdicts_by_class", "controls")
    art.manifest["metrics"] = {k: v for k, v in result.items() if k not in big}
    art.manifest["metrics"]["claim_3"] = {str(v["budget"]): v["claim_3"] for v in verdicts}
    art.manifest["metrics"]["claim_3_by_class"] = {
        f"{v['budget']} {v['class']}: {v['dihal']}": v["claim_3"] for v in by_class
    }


def compare_key(cfg: CompareConfig, plan) -> dict:
    """What a comparison's id hashes: the flags and the plan's layers and evaluator, a local evaluator by its
    files and a --prior-data corpus:FILE by its content (as train-prior names it), so that neither rewritten
    serves the old comparison."""
    config = {**cfg.hashed(), "l_star": plan.l_star, "worst": plan.worst, "evaluator": plan.primary}
    config.update(weights_digests(evaluator=plan.primary))
    parts = (train_bridge, train_prior, train_decoder, train_autoencoder)  # what its parts compute, by version
    config["part_versions"] = {m.STAGE: m.CACHE_VERSION for m in parts}
    config |= gpu_key(cfg.device)
    config.update(gen_stage.noise_key())  # its AR rows' bridge noise, where it is not the 1 of every id before it
    if cfg.prior_data.startswith("corpus:"):
        name, extra = hashed_source(DataConfig(dataset=cfg.prior_data.removeprefix("corpus:")))
        config["prior_data"] = f"corpus:{name}"
        config.update({f"prior_{k}": v for k, v in extra.items()})
    return config


def run(
    cfg: CompareConfig,
    extract: Artifact,
    score_art: Artifact,
    store: ArtifactStore,
    load_model,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """check -> collect -> analyse -> write. load_model(spec) -> LoadedModel, called only when there is work."""
    progress = progress or NullProgress()
    plan = check(cfg, extract, score_art, store)
    config = compare_key(cfg, plan)
    parents = {"extract": extract.id, "score": score_art.id}
    extra = {"model": extract.manifest.get("model")}

    def work(art: Artifact) -> None:  # on every rank: the units dealt over them; rank 0 gathers and writes
        start, model = time.time(), functools.cache(load_model)
        do_units(cfg, plan, extract, store, model, progress)
        if dist.distributed()[0] != 0:
            return
        with dist.local():  # rank 0 alone: every stage it calls now is a cache hit of this process
            got = collect(cfg, plan, extract, store, model)
        ours = next(r.key for r in active_rows(cfg) if r.ours)
        baselines = [r.key for r in active_rows(cfg) if r.baseline]
        dihal = [r.key for r in active_rows(cfg) if r.ours or r.controls_of == "dihal"]
        evaluator = got["evaluators"]["evaluator"]
        stats = compare_stats.analyse(
            got["samples"], got["h_ref"], cfg, ours, baselines, evaluator, got["texts"], dihal=dihal
        )
        write(art, cfg, plan, got, stats, ours, time.time() - start)

    job = Job(STAGE, CACHE_VERSION, config, parents, work, device=cfg.device, extra=extra, every_rank=True)
    return store.run_stage(job, force=force, progress=progress, group=dist.group())
