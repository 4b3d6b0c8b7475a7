"""Two arms of bridges, several training seeds each (issue 66): does a lever move the hybrid's free-running Gen.PPL
beyond the spread between training seeds? The unit is the bridge, not the sample: each bridge's reading is its
hybrid / original Gen.PPL at temperature 1 over its pooled draws (scripts/hybrid_pool.py's headline), and the
arms are compared by Student's two-sample t on the log of that ratio (pooled variance over both arms, n_a + n_b - 2
degrees of freedom), with the 90% interval of the ratio of the arms' geometric means. With --paired, the arms hold
the same training seeds in the same order (one initialisation and batch order per pair) and are compared by the
paired t on the per-seed log ratios (n - 1 degrees of freedom).

A bridge is its draws joined by commas (the same seeds for every bridge). With --target T and no --b, arm a alone
is read against T: its geometric mean with the 90% interval over bridges (one-sample t on the log ratio, n_a - 1
degrees of freedom), shown under T where the interval's upper end is, over T where its lower end is.

    H=docs/results/hybrid_study
    python scripts/hybrid_arms.py --a $H/smollm2_full_own_long_256,$H/smollm2_full_own_long_256_seed2 \\
        --b $H/smollm2_more_text3x_256,$H/smollm2_more_text3x_256_seed2 \\
            $H/smollm2_more_text3x_bseed1_256,$H/smollm2_more_text3x_bseed1_256_seed2
    python scripts/hybrid_arms.py --target 2 --a $H/smollm2_main_steps600_256 $H/smollm2_main_steps600_bseed1_256 ...
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
from hybrid_pool import pooled
from hybrid_study import at_one
from scipy import stats


def ratio_at_one(draws: list[Path]) -> float:
    """One bridge's hybrid / original Gen.PPL, both at temperature 1, over its draws pooled."""
    units = pooled(draws)
    hybrids = sorted({m for m, _ in units if m != "original"})
    if len(hybrids) != 1 or (hybrids[0], 1.0) not in units or ("original", 1.0) not in units:
        raise SystemExit(f"error: {draws[0]} holds no one hybrid and original at temperature 1; read a bridge each")
    return at_one(units, hybrids[0], 0)["ratio"]


def between_arms(a: list[float], b: list[float], level: float = 0.90, paired: bool = False) -> dict:
    """Arm b's geometric-mean ratio over arm a's, with its interval over bridges (Student's t, pooled variance; or,
    paired, over the seeds' log ratios), the t statistic and its degrees of freedom."""
    if len(a) < 2 or len(b) < 2:
        raise SystemExit(f"error: {len(a)} and {len(b)} bridges; each arm needs two training seeds or more")
    if paired and len(a) != len(b):
        raise SystemExit(f"error: {len(a)} and {len(b)} bridges; paired arms hold the same seeds, one bridge each")
    la, lb = np.log(a), np.log(b)
    test = stats.ttest_rel(lb, la) if paired else stats.ttest_ind(lb, la)  # unpaired: equal variances, pooled
    ci = test.confidence_interval(level)
    if paired:
        pooled_var = (lb - la).var(ddof=1) / 2  # one bridge's share of a pair's difference
    else:
        pooled_var = ((len(a) - 1) * la.var(ddof=1) + (len(b) - 1) * lb.var(ddof=1)) / test.df
    return {
        "ratio": math.exp(lb.mean() - la.mean()),
        "interval": [math.exp(ci.low), math.exp(ci.high)],
        "t": float(test.statistic),
        "df": int(test.df),
        "spread": math.exp(math.sqrt(pooled_var)),
    }


def one_arm(a: list[float], target: float, level: float = 0.90) -> dict:
    """The arm's geometric-mean ratio with its interval over bridges (one-sample Student's t on the log ratio) and
    where it stands against target: "under", "over", or "not shown either way"."""
    if len(a) < 2:
        raise SystemExit(f"error: {len(a)} bridge; an arm needs two training seeds or more for an interval")
    la = np.log(a)
    ci = stats.ttest_1samp(la, math.log(target)).confidence_interval(level)
    low, high = math.exp(ci.low), math.exp(ci.high)
    verdict = "under" if high < target else "over" if low > target else "not shown either way"
    return {"ratio": math.exp(la.mean()), "interval": [low, high], "df": len(a) - 1, "verdict": verdict}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", nargs="+", required=True, help="arm a's bridges, each its draws joined by commas")
    p.add_argument("--b", nargs="+", default=None, help="arm b's bridges, the same draws")
    p.add_argument("--target", type=float, default=None, help="without --b: arm a's ratio against this one")
    p.add_argument("--paired", action="store_true", help="--a and --b hold the same training seeds, in order")
    a = p.parse_args()
    if (a.b is None) == (a.target is None):
        raise SystemExit("error: give --b (two arms) or --target (arm a alone), one of them")
    arms = {}
    for name, bridges in (("a", a.a), ("b", a.b)) if a.b else (("a", a.a),):
        arms[name] = [ratio_at_one([Path(d) for d in bridge.split(",")]) for bridge in bridges]
        each = ", ".join(f"{r:.3f}x" for r in arms[name])
        geo = math.exp(np.log(arms[name]).mean())
        print(f"arm {name}: {len(arms[name])} bridges, hybrid / original at temperature 1: {each}; mean {geo:.3f}x")
    if a.target is not None:
        r = one_arm(arms["a"], a.target)
        print(
            "arm a: {:.3f}x [{:.3f}, {:.3f}] (90%, over bridges, {} df): {} {:g}x".format(
                r["ratio"], *r["interval"], r["df"], r["verdict"], a.target
            )
        )
        return
    r = between_arms(arms["a"], arms["b"], paired=a.paired)
    print(
        "arm b over arm a: {:.3f}x [{:.3f}, {:.3f}] (90%, over {}), t = {:.2f} on {} df; "
        "one bridge's spread (sd of log, as a factor): {:.3f}x".format(
            r["ratio"], *r["interval"], "seeds, paired" if a.paired else "bridges", r["t"], r["df"], r["spread"]
        )
    )


if __name__ == "__main__":
    main()
