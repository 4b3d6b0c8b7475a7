"""scripts/distill_probe.py (issue 66): its loss is the KL hybrid_study.py measures, and it lowers that KL on the
rows it trains on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dihal.artifacts import hidden_states as hs
from dihal.stages.lineage import backbone_for
from dihal.stages.lm.hybrid import suffix_model
from dihal.stages.parts.bridge import Bridge
from tests.conftest import load_script


class Loaded:
    """What compare_rows reads of a loaded backbone: its model."""

    def __init__(self, model):
        self.model = model


@pytest.fixture()
def probe(chain):
    store, extract, art = chain
    group = hs.open_group(extract)
    rows = np.asarray(group["input_ids"])[hs.split_indices(group, "train")]
    loaded = backbone_for(art, "cpu", "float32")
    bridge = Bridge.load(art)
    return load_script("distill_probe"), loaded.model, suffix_model(loaded.model, bridge.layer), bridge, rows


def test_the_probes_loss_is_the_studys_teacher_forced_kl(probe):
    """The mean over positions 1.. of hybrid_study.compare_rows' KL(p || q) at noise 0, computed apart."""
    script, model, suffix, bridge, rows = probe
    ids = torch.as_tensor(rows[:4], dtype=torch.long)
    study = load_script("hybrid_study")
    noise = torch.zeros(len(ids), ids.shape[1] - bridge.start, bridge.net.cfg.dim)
    got = study.compare_rows(Loaded(model), bridge, suffix, ids, noise, 4, set())
    want = float(got["kl_pq"][:, 1:].mean())
    assert want > 1e-3  # a 4-step bridge is far from its backbone: the comparison is not of two zeros
    assert float(script.kl_loss(model, suffix, bridge, ids, 4)) == pytest.approx(want, rel=1e-5)


def test_distillation_lowers_the_kl_of_the_rows_it_trains_on(probe):
    script, model, suffix, bridge, rows = probe
    ids = torch.as_tensor(rows, dtype=torch.long)
    before = float(script.kl_loss(model, suffix, bridge, ids, 4))
    lines = []
    losses = script.distill(
        model, suffix, bridge, rows, steps=30, lr=3e-3, batch=len(rows), sample_steps=4, log=lines.append
    )
    after = float(script.kl_loss(model, suffix, bridge, ids, 4))
    assert losses[0] == pytest.approx(before, rel=1e-5)  # the first step's loss is of the weights it started from
    assert after < 0.7 * before
    assert not bridge.net.training and lines[-1].startswith("step 29: KL")
