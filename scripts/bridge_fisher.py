"""Where a bridge's error costs KL: the upper blocks' sensitivity to each normalised coordinate (issue 66).

For held-out rows of the bridge's extract, the backbone's own samples apart from the corpus (as
`hybrid_study.py --by-source` divides them), teacher forced with the bridge's mean path (noise 0, 8 Euler steps):

    e_d   the bridge's error in its normalised coordinates, (h_hat - h_l) / sigma_y, per dimension d
    F_d   the diagonal of the Fisher information of the original's next-token distribution p in those
          coordinates: E over y ~ p of (d log p(y) / d y_norm_d)^2, two draws of y per position
    KL    KL(original || hybrid), measured

and prints how concentrated F is (its largest dimension over the mean, the share of the top 10 and 64), the
correlation of F_d with E[e_d^2], and the second-order account 0.5 * sum_d F_d E[e_d^2] beside the measured KL.

    python scripts/bridge_fisher.py --bridge ID --root runs/full-own-gemma3 --rows 24 --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hybrid_study import own_rows

from dihal.artifacts import hidden_states as hs
from dihal.artifacts.store import ArtifactStore
from dihal.stages.diffusion import draws
from dihal.stages.lineage import backbone_for
from dihal.stages.lm.capture import hidden_states
from dihal.stages.lm.hybrid import lm_logits, suffix_hidden, suffix_model
from dihal.stages.parts.bridge import Bridge

DRAWS = 2  # y ~ p per position for the Fisher diagonal
ROWS = 4  # sequences per forward


def log_probs(suffix, h: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(lm_logits(suffix, suffix_hidden(suffix, h)).float(), -1)


def measure(loaded, bridge: Bridge, suffix, rows: torch.Tensor) -> dict:
    sigma = bridge.norm.sigma_y
    fisher, err2, kls = torch.zeros_like(sigma), torch.zeros_like(sigma), []
    blocks = [rows[s : s + ROWS] for s in range(0, len(rows), ROWS)]
    for x in blocks:
        with torch.no_grad():
            states = hidden_states(loaded.model, x, [0, bridge.layer])  # one forward for both layers
            h0, h = states[0].float(), states[bridge.layer].float()
            h_hat = bridge.sample(h0, 8, bridge.noise(len(x), x.shape[1], draws.stream(0, 0)) * 0.0)
            lp, lq = log_probs(suffix, h), log_probs(suffix, h_hat)
            kls.append(float((lp.exp() * (lp - lq)).sum(-1)[:, 1:].mean()))  # position 0 is exact in both
        err2 += (((h_hat - h)[:, 1:] / sigma) ** 2).mean((0, 1))
        for _ in range(DRAWS):
            state = h.clone().requires_grad_(True)
            lpg = log_probs(suffix, state)
            y = torch.multinomial(lpg.detach().exp().reshape(-1, lpg.shape[-1]), 1).reshape(lpg.shape[:-1])
            lpg.gather(-1, y[..., None]).sum().backward()
            fisher += ((state.grad[:, 1:] * sigma) ** 2).mean((0, 1)) / DRAWS
    fisher, err2 = fisher / len(blocks), err2 / len(blocks)
    ranked, cost = fisher.sort(descending=True).values, (fisher * err2).sort(descending=True).values
    return {
        "rows": len(rows),
        "kl": float(np.mean(kls)),
        "second_order_kl": float(0.5 * (fisher * err2).sum()),
        "mse_normalised": float(err2.mean()),
        "fisher_max_over_mean": float(ranked[0] / ranked.mean()),
        "fisher_top10_share": float(ranked[:10].sum() / ranked.sum()),
        "fisher_top64_share": float(ranked[:64].sum() / ranked.sum()),
        "cost_top10_share": float(cost[:10].sum() / cost.sum()),
        "corr_fisher_error": float(np.corrcoef(fisher.numpy(), err2.numpy())[0, 1]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bridge", required=True)
    p.add_argument("--root", default="runs")
    p.add_argument("--rows", type=int, default=24, help="held-out rows of each source")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    store = ArtifactStore(a.root)
    art = store.load("bridge", a.bridge)
    extract = store.load("extract", art.manifest["parents"]["extract"])
    loaded, bridge = backbone_for(art, "cpu", "float32"), Bridge.load(art)
    suffix = suffix_model(loaded.model, bridge.layer)
    suffix.requires_grad_(False)
    group = hs.open_group(extract)
    ids, split = np.asarray(group["input_ids"]), np.asarray(group["split"])
    own = own_rows(store, extract, ids)
    result = {"bridge": art.id, "layer": bridge.layer, "model": extract.config["model"]}
    for source, mask in (("own samples", own), ("corpus", ~own)):
        rows = torch.tensor(ids[(split == 1) & mask][: a.rows], dtype=torch.long)
        result[source] = measure(loaded, bridge, suffix, rows)
        print(source, json.dumps({k: round(v, 3) for k, v in result[source].items()}), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fisher.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
