"""Where the hybrid's free-running generation loses what teacher forcing keeps (issue 66 item 1).

For one bridge, per position of the sequence, the original's next-token distribution p against the
hybrid's q on the same prefix: KL(p || q) (fidelity's), KL(q || p) (what sampling from q pays under p),
the hybrid's rank of the original's top token and the share of positions whose top-1 flips, each
    teacher forced   on held-out sequences of the bridge's extract (its validation split), and
    free running     on the hybrid's own samples from the start token (scored on the same prefixes,
                     with the bridge noise that wrote them),
for each generation-time setting of the bridge: its noise scaled by s (s = 0: the flow's mean path) and
its Euler steps. Then Gen.PPL under the original of each setting's free-running samples, and both
models' Gen.PPL against unigram entropy over a temperature grid, read at matched entropy, with a 90%
bootstrap interval over samples (--bootstrap; each point's samples in curve_samples.csv).
With --by-source, teacher forced on the extract's train and validation rows, each divided into the
backbone's own samples and the corpus: whether the bridge fits the text it trained on better than
held-out text of the same kind (sources.csv).

Every row uses the same decoding (temperature, top-p 1 unless --top-p), the same number of samples and tokens
and the same seeds. Gen.PPL here is token-level on the sampled ids (no decode and re-encode) and positions after a stop
token are left out; `dihal evaluate --samples` scores decoded text, so its figures differ slightly.

    python scripts/hybrid_study.py --bridge ID --root runs/main-smollm2-135m --out docs/results/hybrid_study
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from dihal.stages.configs import GenerateConfig
from dihal.stages.diffusion import draws
from dihal.stages.extract import samples_file
from dihal.stages.generate import generate_hybrid, generate_original
from dihal.stages.lineage import backbone_for
from dihal.stages.lm.capture import hidden_states
from dihal.stages.lm.hybrid import lm_logits, suffix_hidden, suffix_model
from dihal.stages.lm.tokens import start_token, truncate
from dihal.stages.parts.bridge import Bridge
from dihal.stages.runtime import bootstrap as bootstrap_ci
from dihal.stages.text.text_metrics import token_entropy


def settings(text: str) -> list[tuple[float, int]]:
    """'1x8,0x8' -> [(noise scale, Euler steps), ...]; '' -> none."""
    return [(float(s.split("x")[0]), int(s.split("x")[1])) for s in text.split(",") if s]


def compare_on(loaded, bridge: Bridge, suffix, ids, noise, steps: int, stops, rows: int = 8) -> dict:
    """compare_rows over slices of `rows` sequences (a (B, T, V) float32 tensor of gemma3's 262k vocabulary is
    4 GiB at 64 x 64), joined."""
    parts = [
        compare_rows(loaded, bridge, suffix, ids[s:e], noise[s:e], steps, stops) for s, e in batches(len(ids), rows)
    ]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@torch.no_grad()
def compare_rows(loaded, bridge: Bridge, suffix, ids: torch.Tensor, noise: torch.Tensor, steps: int, stops) -> dict:
    """ids (B, T) starting with the start token; noise (B, T - start, D) as the bridge draws it. Per position
    0..T-2 (the prediction of token p + 1): KL both ways, rank of p's top token under q, top-1 flip, and the NLL
    under p and q of the next token in ids. Positions at or after a stop token are masked out."""
    model = loaded.model
    p = lm_logits(model, model.model(input_ids=ids, use_cache=False).last_hidden_state).float()
    h0 = hidden_states(model, ids, [0])[0].float()
    h = bridge.sample(h0, steps, noise)
    q = lm_logits(suffix, suffix_hidden(suffix, h)).float()
    lp, lq = F.log_softmax(p[:, :-1], -1), F.log_softmax(q[:, :-1], -1)
    kl_pq = (lp.exp() * (lp - lq)).sum(-1)
    kl_qp = (lq.exp() * (lq - lp)).sum(-1)
    h_p, h_q = -(lp.exp() * lp).sum(-1), -(lq.exp() * lq).sum(-1)
    top = lp.argmax(-1, keepdim=True)
    rank = (lq > lq.gather(-1, top)).sum(-1)  # 0: q's top token is p's
    nxt = ids[:, 1:, None]
    nll_p, nll_q = -lp.gather(-1, nxt)[..., 0], -lq.gather(-1, nxt)[..., 0]
    keep = torch.ones_like(kl_pq, dtype=torch.bool)
    for b, row in enumerate(ids[:, 1:].tolist()):  # a stop as token k + 1 ends the positions after k
        first = next((k for k, t in enumerate(row) if t in stops), None)
        if first is not None:
            keep[b, first + 1 :] = False
    return {
        "kl_pq": kl_pq,
        "kl_qp": kl_qp,
        "rank": rank.float(),
        "flip": (rank > 0).float(),
        "nll_p": nll_p,
        "nll_q": nll_q,
        "h_p": h_p,
        "h_q": h_q,
        "keep": keep,
    }


def per_position(got: dict, setting: str, mode: str) -> pd.DataFrame:
    keep = got["keep"].float()
    count = keep.sum(0)
    frame = {"setting": setting, "mode": mode, "position": np.arange(keep.shape[1]), "count": count.numpy()}
    for name in ("kl_pq", "kl_qp", "rank", "flip", "nll_p", "nll_q", "h_p", "h_q"):
        frame[name] = ((got[name] * keep).sum(0) / count.clamp(min=1)).numpy()
    return pd.DataFrame(frame)


def summary(got: dict) -> dict:
    """Means over positions 1.. (position 0 reads the exact start-token state in both, as fidelity leaves it
    out); the NLLs and Gen.PPL over every predicted token, the first one included."""
    keep, later = got["keep"], got["keep"].clone()
    later[:, 0] = False
    out = {name: float(got[name][later].mean()) for name in ("kl_pq", "kl_qp", "flip")}
    out |= {name: float(got[name][keep].mean()) for name in ("nll_p", "nll_q", "h_p", "h_q")}
    out["mean_rank"] = float(got["rank"][later].mean())
    out["gen_ppl"] = math.exp(out["nll_p"])  # of the next tokens in the sequences, under the original
    return out


OWN_RUN = 8  # tokens: a row is the backbone's own text when most of its runs of this length are runs of its samples


def own_rows(store: ArtifactStore, extract, ids: np.ndarray) -> np.ndarray:
    """Which of the extract's rows hold the backbone's own samples (its generate: sources, --own-text): rows
    pack documents, so a row is matched by its runs of OWN_RUN tokens (a row of own text holds a few runs that
    cross a document end; a corpus row holds none)."""
    runs = set()
    for spec in extract.config["data"].get("also") or ():
        if spec.startswith("generate:"):
            art = store.load("generate", spec.removeprefix("generate:"))
            for line in art.file(samples_file(art)).read_text().splitlines():
                t = json.loads(line)["token_ids"]
                runs |= {tuple(t[i : i + OWN_RUN]) for i in range(len(t) - OWN_RUN + 1)}
    share = [np.mean([tuple(r[i : i + OWN_RUN]) in runs for i in range(1, len(r) - OWN_RUN + 1)]) for r in ids.tolist()]
    return np.asarray(share) > 0.5


def by_source(store, extract, group, loaded, bridge, suffix, tokens: int, n: int, steps: int, stops) -> list[dict]:
    """Teacher forced, noise 0: KL(original || hybrid) and top-1 flips on up to n rows of each (split, source)."""
    ids = np.asarray(group["input_ids"])[:, : tokens + 1]
    split, own = np.asarray(group["split"]), own_rows(store, extract, ids)
    rows = []
    for code, name in ((0, "train"), (1, "validation")):
        for mask, source in ((own, "own samples"), (~own, "corpus")):
            picked = torch.tensor(ids[(split == code) & mask][:n], dtype=torch.long)
            if not len(picked):
                continue
            got = summary(
                compare_on(
                    loaded,
                    bridge,
                    suffix,
                    picked,
                    bridge.noise(len(picked), picked.shape[1], draws.stream(0, 0)) * 0.0,
                    steps,
                    stops,
                )
            )
            rows.append({"split": name, "source": source, "sequences": len(picked)} | got)
            print(
                f"teacher forced, {name}, {source} ({len(picked)}): KL {got['kl_pq']:.3f} flip {got['flip']:.3f}",
                flush=True,
            )
    return rows


def batches(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def sample(
    loaded, bridge, suffix, cfg: GenerateConfig, n: int, noise_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """n free-running samples (start token + new ids) and the bridge noise that wrote them; noise None: the
    original backbone's samples. Batch b draws from stream (seed, b) as `dihal generate` does."""
    first = start_token(loaded.tokenizer)[0]
    ids, noises = [], []
    for b, (s, e) in enumerate(batches(n, cfg.batch_size)):
        gen = draws.stream(cfg.seed, b)
        prefix = torch.full((e - s, 1), first, dtype=torch.long)
        if bridge is None:
            new = generate_original(loaded, prefix, cfg, gen)
        else:
            noise = bridge.noise(e - s, 1 + cfg.max_new_tokens, gen) * noise_scale
            new = generate_hybrid(loaded, bridge, suffix, prefix, cfg, gen, noise=noise)
            noises.append(noise)
        ids.append(torch.cat([prefix, new], dim=1))
    return torch.cat(ids), (torch.cat(noises) if noises else None)


def entropy_of(ids: torch.Tensor, stops) -> float:
    return token_entropy([truncate(row, stops) for row in ids[:, 1:].tolist()])


def per_sample(loaded, ids: torch.Tensor, stops) -> pd.DataFrame:
    """Per sample: its unigram entropy, and its new tokens up to a stop with their summed NLL under the original,
    read on the ids as written rather than on their decoded and re-tokenised text (the curve point's units)."""
    model, nll = loaded.model, []
    with torch.no_grad():
        for s, e in batches(len(ids), 8):
            hidden = model.model(input_ids=ids[s:e], use_cache=False).last_hidden_state
            lp = F.log_softmax(lm_logits(model, hidden), -1)
            nll.append(-lp[:, :-1].gather(-1, ids[s:e, 1:, None])[..., 0])
    nll = torch.cat(nll)
    kept = [truncate(row, stops) for row in ids[:, 1:].tolist()]
    return pd.DataFrame(
        {
            "sample": range(len(kept)),
            "entropy": [token_entropy([k]) for k in kept],
            "nll": [float(nll[b, : len(k)].sum()) for b, k in enumerate(kept)],
            "tokens": [len(k) for k in kept],
        }
    )


def point(units: pd.DataFrame) -> dict:
    """A curve point from its samples: mean entropy over non-empty samples (token_entropy's) and Gen.PPL per
    token (evaluate's formula)."""
    kept = units[units.tokens > 0]
    return {"entropy": float(kept.entropy.mean()), "gen_ppl": float(np.exp(kept.nll.sum() / kept.tokens.sum()))}


def reading(curves: list[dict], who: str) -> tuple[float, str, float]:
    """(entropy read at, where, hybrid / original Gen.PPL there) for one hybrid curve."""
    orig = [c for c in curves if c["model"] == "original"]
    hyb = [c for c in curves if c["model"] == who]
    at, where = matched_entropy(orig, hyb)
    return at, where, matched(hyb, at) / matched(orig, at)


def curves_of(units: dict, idx=slice(None)) -> list[dict]:
    """Every curve point from its samples (rows idx of each: the same rows at every point)."""
    return [{"model": m, "temperature": t} | point(u.iloc[idx]) for (m, t), u in units.items()]


def bootstrap(units: dict, who: str, draws_: int, seed: int = 0) -> tuple[float, float]:
    """90% percentile interval of the matched-entropy ratio (stages/runtime/bootstrap.py's, so it contains the
    reading), resampling samples with replacement. The same indices are drawn for every curve point (sample i of
    every point comes from batch stream (seed, i // batch) at every temperature, so points are paired)."""
    rng = np.random.default_rng(seed)
    n = len(next(iter(units.values())))
    ratios = [reading(curves_of(units, rng.integers(0, n, n)), who)[2] for _ in range(draws_)]
    ci = bootstrap_ci.interval(reading(curves_of(units), who)[2], ratios, 0.90)
    return ci["lo"], ci["hi"]


def matched_entropy(orig: list[dict], hyb: list[dict]) -> tuple[float, str]:
    """Where both curves are read: the original's entropy at temperature 1 when the hybrid's curve reaches it,
    else the top of the entropy range both curves cover (never an extrapolation)."""
    top = next((c["entropy"] for c in orig if c["temperature"] == 1.0), max(c["entropy"] for c in orig))
    low = max(min(c["entropy"] for c in orig), min(c["entropy"] for c in hyb))
    high = min(max(c["entropy"] for c in orig), max(c["entropy"] for c in hyb))
    if low <= top <= high:
        return top, "the original's entropy at temperature 1"
    return high, "the top of the range both curves cover"


def matched(curve: list[dict], entropy: float) -> float:
    """log Gen.PPL linear in entropy between the grid's points (compare's rule), read at `entropy`."""
    pts = sorted((c["entropy"], math.log(c["gen_ppl"])) for c in curve)
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    return math.exp(float(np.interp(entropy, xs, ys)))  # clamped at the grid's ends (said in the table)


def at_one(units: dict, who: str, draws_: int, seed: int = 0) -> dict:
    """Both models at temperature 1 (the issue's definition of matched when their entropies agree within 2%, and
    no interpolation): the ratio, the entropies' gap as a share of the original's, and a 90% paired interval."""
    o, h = units[("original", 1.0)], units[(who, 1.0)]
    po, ph = point(o), point(h)
    gap = (po["entropy"] - ph["entropy"]) / po["entropy"]
    r = paired_ratio(h, o, draws_, seed)
    return {"ratio": r["ratio"], "entropy_gap": gap, "ratio_90": r["ratio_90"]}


def paired_ratio(a: pd.DataFrame, b: pd.DataFrame, draws_: int, seed: int = 0) -> dict:
    """Gen.PPL of samples a over that of samples b, sample i of both from one stream, so both are resampled by one
    index (a paired bootstrap): the ratio and its 90% interval (nan without resamples)."""
    rng, ratios = np.random.default_rng(seed), []
    for _ in range(draws_):
        idx = rng.integers(0, len(b), len(b))
        ratios.append(point(a.iloc[idx])["gen_ppl"] / point(b.iloc[idx])["gen_ppl"])
    ratio = point(a)["gen_ppl"] / point(b)["gen_ppl"]
    ci = bootstrap_ci.interval(ratio, ratios, 0.90)
    return {"ratio": ratio, "ratio_90": [ci["lo"], ci["hi"]]}


def readings_of(units: dict, curves: list[dict], who: str, draws_: int, label: str = "") -> dict:
    """One hybrid's readings, printed: at matched entropy (with its interval when draws_), and both at temperature 1
    where both were drawn there. label prefixes the lines (hybrid_pool.py names its pooled sample count)."""
    at, where, ratio = reading(curves, who)
    out = {"entropy": at, "where": where, "ratio": ratio}
    if draws_:
        out["ratio_90"] = bootstrap(units, who, draws_)
    band = " [{:.2f}, {:.2f}] (90%)".format(*out["ratio_90"]) if draws_ else ""
    print(f"{who}: {label}matched entropy {at:.3f} ({where}): hybrid / original Gen.PPL {ratio:.2f}{band}")
    if (who, 1.0) in units and ("original", 1.0) in units:
        one = out["at_temperature_1"] = at_one(units, who, draws_)
        print(
            f"{who}: both at temperature 1, entropies {one['entropy_gap']:+.1%} apart: {one['ratio']:.2f}x "
            "[{:.2f}, {:.2f}] (90%)".format(*one["ratio_90"])
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bridge", required=True)
    p.add_argument("--root", default=None)
    p.add_argument(
        "--samples",
        type=int,
        default=64,
        help="free-running samples per draw; teacher forced on up to as many held-out rows (studies before "
        "2026-12-06 drew one sample per held-out row: 38 on the main job's extracts, so rerun those with --samples 38)",
    )
    p.add_argument(
        "--tokens", type=int, default=None, help="new tokens per sample (default: the extract's seq_len - 1)"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--settings", default="1x8,0x8,0.5x8,1x1,1x32,0x32", help="noise scale x Euler steps, comma list")
    p.add_argument("--temperatures", default="0.7,0.85,1.0", help="both models' curves")
    p.add_argument(
        "--hybrid-temperatures",
        default="",
        help="further temperatures of the hybrid's curves alone (above 1 where the hybrid is the colder model)",
    )
    p.add_argument("--curve-settings", default="1x8", help="the hybrid settings of the entropy curves, comma list")
    p.add_argument("--top-p", type=float, default=1.0, help="both models' nucleus, every sample (1: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bootstrap", type=int, default=1000, help="resamples for the matched ratio's 90%% interval (0: none)"
    )
    p.add_argument("--by-source", action="store_true", help="also teacher forced on train and held-out rows, by source")
    p.add_argument("--weights", default=None, help="the bridge's network weights from this file (distill_probe.py's)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    store = ArtifactStore(a.root or os.environ.get("DIHAL_ROOT", "runs"))
    art = store.load("bridge", a.bridge)
    extract = store.load("extract", art.manifest["parents"]["extract"])
    loaded = backbone_for(art, "cpu", "float32")
    bridge = Bridge.load(art)
    if a.weights:
        bridge.net.load_state_dict(files.load_tensors(Path(a.weights)))
    suffix = suffix_model(loaded.model, bridge.layer)
    stops = loaded.stop_ids
    group = hs.open_group(extract)
    seq_len = int(np.asarray(group["input_ids"]).shape[1])
    tokens = a.tokens or seq_len - 1
    held = hs.split_indices(group, "validation")[: a.samples]
    real = torch.tensor(np.asarray(group["input_ids"].oindex[held])[:, : tokens + 1], dtype=torch.long)
    cfg = GenerateConfig(
        max_new_tokens=tokens, batch_size=a.batch_size, seed=a.seed, device="cpu", dtype="float32", top_p=a.top_p
    )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    frames, rows, started = [], [], time.time()
    sources = (
        by_source(store, extract, group, loaded, bridge, suffix, tokens, a.samples, 8, stops) if a.by_source else []
    )
    if sources:
        pd.DataFrame(sources).to_csv(out / "sources.csv", index=False)
    if not a.settings and not a.curve_settings:
        return
    drawn = {}  # (setting, temperature actually used) -> samples: the same draws are never made twice

    def draw(bridge_or_none, c: GenerateConfig, noise_scale: float):
        key = (bridge_or_none is not None, noise_scale, c.sample_steps, c.decoding_temperature)
        if key not in drawn:
            drawn[key] = sample(loaded, bridge_or_none, suffix, c, a.samples, noise_scale)
        return drawn[key]

    own, _ = draw(None, cfg, 0.0)  # the original's own samples: the text a perfect
    own_entropy = entropy_of(own, stops)  # hybrid would write, read by the hybrid teacher forced (the control)
    for noise_scale, steps in settings(a.settings):
        name = f"noise {noise_scale:g}, {steps} steps"
        # teacher forced: held-out text, noise drawn as fidelity draws it (stream (seed, 0)), scaled
        gen = draws.stream(a.seed, 0)
        tf_noise = bridge.noise(len(real), real.shape[1], gen) * noise_scale
        tf = compare_on(loaded, bridge, suffix, real, tf_noise, steps, stops)
        # free running: the hybrid's own samples at this setting, scored with the noise that wrote them
        ids, noise = draw(bridge, replace(cfg, sample_steps=steps), noise_scale)
        fr = compare_on(loaded, bridge, suffix, ids, noise, steps, stops)
        gen = draws.stream(a.seed, 1)
        ot = compare_on(
            loaded, bridge, suffix, own, bridge.noise(len(own), own.shape[1], gen) * noise_scale, steps, stops
        )
        frames += [
            per_position(x, name, m) for x, m in ((tf, "teacher forced"), (fr, "free running"), (ot, "original's text"))
        ]
        row = {"setting": name, "noise_scale": noise_scale, "steps": steps}
        row |= {f"tf_{k}": v for k, v in summary(tf).items()} | {f"fr_{k}": v for k, v in summary(fr).items()}
        row |= {f"ot_{k}": v for k, v in summary(ot).items()}
        row["fr_entropy"], row["ot_entropy"] = entropy_of(ids, stops), own_entropy
        rows.append(row)
        print(
            f"{name}: TF KL {row['tf_kl_pq']:.3f} flip {row['tf_flip']:.3f} | own text KL {row['ot_kl_pq']:.3f} "
            f"flip {row['ot_flip']:.3f} Gen.PPL {row['ot_gen_ppl']:.1f} H(p) {row['ot_h_p']:.3f} | "
            f"FR H(p) {row['fr_h_p']:.3f} H(q) {row['fr_h_q']:.3f} | FR KL {row['fr_kl_pq']:.3f} "
            f"KL(q||p) {row['fr_kl_qp']:.3f} flip {row['fr_flip']:.3f} Gen.PPL {row['fr_gen_ppl']:.1f} "
            f"entropy {row['fr_entropy']:.3f} ({time.time() - started:.0f} s)",
            flush=True,
        )
    positions = pd.concat(frames) if frames else pd.DataFrame(columns=["setting", "mode", "position", "kl_pq", "flip"])
    positions.to_csv(out / "per_position.csv", index=False)
    table = pd.DataFrame(rows)
    table.to_csv(out / "settings.csv", index=False)
    # the entropy curves: the original and the hybrid (each curve setting) at each temperature
    curves, units = [], {}
    whom = [("original", None)] + [(f"hybrid, {n:g} x {k}", (n, k)) for n, k in settings(a.curve_settings)]
    grid = [(float(x), whom) for x in a.temperatures.split(",")]
    grid += [(float(x), whom[1:]) for x in a.hybrid_temperatures.split(",") if x]
    for t, who_at in grid:
        for who, setting in who_at:
            noise_scale, steps = setting or (0.0, cfg.sample_steps)
            c = replace(cfg, temperature=t, sample_steps=steps)
            ids, _ = draw(bridge if setting else None, c, noise_scale if setting else 0.0)
            units[(who, t)] = per_sample(loaded, ids, stops)
            curves.append({"model": who, "temperature": t} | point(units[(who, t)]))
            print(
                f"curve {who} t={t}: entropy {curves[-1]['entropy']:.3f} Gen.PPL {curves[-1]['gen_ppl']:.1f}",
                flush=True,
            )
    pd.concat([u.assign(model=m, temperature=t) for (m, t), u in units.items()]).to_csv(
        out / "curve_samples.csv", index=False
    )
    readings = {who: readings_of(units, curves, who, a.bootstrap) for who, _ in whom[1:]}
    curves = pd.DataFrame(curves)
    curves.to_csv(out / "curves.csv", index=False)
    result = {
        "bridge": art.id,
        "layer": bridge.layer,
        "model": extract.config["model"],
        "samples": a.samples,  # free running; teacher forced on the first of them held out
        "held_out_rows": len(real),
        "top_p": a.top_p,
        "tokens": tokens,
        "settings": rows,
        "curves": curves.to_dict("records"),
        "matched": readings,
        "seconds": time.time() - started,
    }
    (out / "study.json").write_text(json.dumps(result, indent=2))
    plot(
        positions,
        curves,
        out / "study.png",
        f"{extract.config['model']} bridge {art.id} (layer {bridge.layer})",
    )


def plot(positions: pd.DataFrame, curves: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_position = not positions.empty  # --settings "": the curves alone, one panel
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5)) if per_position else plt.subplots(1, 1, figsize=(6, 4.5))
    axes = list(axes) if per_position else [axes]
    if per_position:
        for (setting, mode), g in positions.groupby(["setting", "mode"], sort=False):
            style = "-" if mode == "free running" else "--"
            axes[0].plot(g.position, g.kl_pq, style, label=f"{setting}, {mode}")
            axes[1].plot(g.position, g.flip, style, label=f"{setting}, {mode}")
        axes[0].set(xlabel="position", ylabel="KL(original || hybrid), nats", yscale="log")
        axes[1].set(xlabel="position", ylabel="share of top-1 flips")
        axes[0].legend(fontsize=6)
    for who, g in curves.groupby("model"):
        g = g.sort_values("entropy")
        axes[-1].plot(g.entropy, g.gen_ppl, "o-", label=who)
    axes[-1].set(xlabel="mean per-sample unigram entropy (nats)", ylabel="Gen.PPL under the original", yscale="log")
    axes[-1].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
