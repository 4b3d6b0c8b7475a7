"""The steps of scripts/gpu_smoke.sh: dihal at the paper's shapes, each step timed and checked.

For each backbone shape (--models), on a random-weight model of that shape
(scripts/make_random_model.py): extract of every layer, score, train-bridge (cpu-small, then the
paper protocol), evaluate (fidelity), generate (AR hybrid and original), evaluate (Gen.PPL),
train-prior, and parallel generation by rounding and by the bridge; then one QUICK-sized compare on
the first shape (the other shape's model is its evaluator); with two GPUs or more, extract and
train-bridge under torchrun on two ranks.

After each step one line: its wall time, throughput, peak GPU memory, and a check that it ran on
the requested device in the requested precision with finite numbers. The first failed step or check
stops the run (exit 1) with its name and the command's last output. The lines also go to
<root>/smoke.tsv.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = re.compile(r"^(?:done|cache hit): (\w+) (\w{12}) -> ", re.M)


class Failed(Exception):
    pass


def numbers(value, where=""):
    """Every float in a manifest's metrics, with its path."""
    if isinstance(value, float):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from numbers(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from numbers(v, f"{where}[{i}]")


class Smoke:
    def __init__(self, a: argparse.Namespace):
        self.a, self.root = a, Path(a.root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.rows: list[str] = []
        self.tsv = self.root / "smoke.tsv"
        self.tsv.write_text("step\tseconds\tthroughput\tpeak_gpu_gib\tcheck\n")

    def dihal(self, *args: str, ranks: int = 1) -> tuple[subprocess.CompletedProcess, float]:
        env = {**os.environ, "DIHAL_ROOT": str(self.root), "PYTHONUNBUFFERED": "1"}
        head = [sys.executable, "-m", "dihal.cli"]
        if ranks > 1:
            head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "-m", "dihal.cli"]
        start = time.perf_counter()
        proc = subprocess.run([*head, *args], capture_output=True, text=True, env=env, cwd=REPO)
        return proc, time.perf_counter() - start

    def step(self, name: str, command: str, *, stage: str, throughput=None, ranks: int = 1, precision=None):
        """Run one dihal command; check and report the artifact of `stage` it made; return it."""
        from dihal.artifacts.store import ArtifactStore

        proc, seconds = self.dihal(*shlex.split(command), ranks=ranks)
        if proc.returncode != 0:
            raise Failed(f"{name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
        made = [i for s, i in REPORT.findall(proc.stdout) if s == stage]
        if not made:
            raise Failed(f"{name}: no {stage} artifact reported\n{proc.stdout[-2000:]}")
        art = ArtifactStore(self.root).load(stage, made[-1])
        self.check(name, art, precision)
        rate = throughput(art, seconds) if throughput else "-"
        peak = art.manifest.get("peak_gpu_memory_gib")
        peak = f"{peak:.2f}" if peak is not None else "-"
        line = f"{name:<42} {seconds:>8.1f} s  {rate:<28} {peak:>8} GiB  ok"
        print(line, flush=True)
        with open(self.tsv, "a") as fh:
            fh.write(f"{name}\t{seconds:.1f}\t{rate}\t{peak}\tok\n")
        return art

    def check(self, name: str, art, precision) -> None:
        if not art.complete:
            raise Failed(f"{name}: {art.stage} {art.id} is {art.status}")
        env = art.manifest.get("environment", {})
        if not str(env.get("device", "")).startswith(self.a.device):
            raise Failed(f"{name}: ran on {env.get('device')}, not {self.a.device}")
        if self.a.device == "cuda" and not env.get("gpu"):
            raise Failed(f"{name}: its manifest names no GPU")
        want = self.a.dtype if precision is None else precision  # False: a stage without a precision (score)
        got = art.config.get("precision") or art.config.get("dtype") or (art.manifest.get("model") or {}).get("dtype")
        if want is not False and got is not None and got != want:
            raise Failed(f"{name}: precision {got}, not {want}")
        bad = [(k, v) for k, v in numbers(art.manifest.get("metrics", {})) if not math.isfinite(v) and "mauve" not in k]
        if bad:
            raise Failed(f"{name}: non-finite {bad[:5]}")

    def model(self, like: str) -> Path:
        out = self.root / f"random-{like}"
        if not (out / "config.json").exists():
            args = [
                sys.executable,
                str(REPO / "scripts" / "make_random_model.py"),
                "--like",
                like,
                "--layers",
                str(self.a.layers),
                "--out",
                str(out),
                "--device",
                self.a.device,
                *self.a.shrink,
            ]
            if self.a.tokenizer:
                args += ["--tokenizer", self.a.tokenizer]
            start = time.perf_counter()
            proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                raise Failed(f"make_random_model {like}: {proc.stderr[-2000:]}")
            what = f"random {like}"
            print(f"{what:<42} {time.perf_counter() - start:>8.1f} s  (weights drawn and written)")
        return out

    def chain(self, like: str, evaluator: Path | None) -> None:
        a = self.a
        dev = f"--device {a.device} --dtype {a.dtype}"
        model = self.model(like)
        print(f"== {like}: {a.layers} blocks, {a.sequences} sequences of {a.seq_len} tokens, {a.device} {a.dtype}")
        precision = "bfloat16" if a.dtype == "bfloat16" else "float32"  # training: bf16 autocast or float32
        extract = f"extract --model {shlex.quote(str(model))} --max-sequences {a.sequences} --seq-len {a.seq_len} {dev}"
        ex = self.step(f"{like} extract", extract, stage="extract", throughput=tokens_per_s(a.seq_len))
        score = f"score --extract {ex.id} --tokens {a.tokens} --device {a.device}"
        sc = self.step(f"{like} score", score, stage="score", throughput=layers_per_s, precision=False)
        bridge = f"train-bridge --layer {sc.manifest['metrics']['l_star']} --extract {ex.id} {dev}"
        small = self.step(
            f"{like} train-bridge cpu-small",
            f"{bridge} --protocol cpu-small --train-steps {a.steps}",
            stage="bridge",
            throughput=steps_per_s,
            precision=precision,
        )
        paper = self.step(
            f"{like} train-bridge paper",
            f"{bridge} --protocol paper --train-steps {a.paper_steps}",
            stage="bridge",
            throughput=steps_per_s,
            precision=precision,
        )
        fidelity = f"evaluate --bridge {paper.id} --sample-steps 1,8 --limit {a.samples} {dev}"
        self.step(f"{like} evaluate fidelity", fidelity, stage="evaluate", throughput=sequences_per_s)
        ar = f"generate --bridge {paper.id} --num-samples {a.samples} --max-new-tokens {a.seq_len - 1} "
        gen = self.step(
            f"{like} generate AR (hybrid, original)",
            ar + f"--baseline original {dev}",
            stage="generate",
            throughput=hybrid_tokens_per_s,
        )
        self.step(f"{like} evaluate Gen.PPL", f"evaluate --samples {gen.id} {dev}", stage="evaluate")
        prior = self.step(
            f"{like} train-prior",
            f"train-prior --extract {ex.id} --train-steps {a.steps} {dev}",
            stage="prior",
            throughput=steps_per_s,
            precision=precision,
        )
        for recovery, part in (("rounding", ""), ("hidden", f"--bridge {small.id}")):
            parallel = f"generate --mode parallel --prior {prior.id} --recovery {recovery} {part} "
            self.step(
                f"{like} generate parallel {recovery}",
                parallel + f"--num-samples {a.samples} {dev}",
                stage="generate",
                throughput=ms_per_sample,
            )
        if evaluator is not None:
            quick = f"compare --extract {ex.id} --score {sc.id} --seeds 0 --num-samples {min(16, a.samples)} "
            quick += f"--budgets 1 --train-steps 30 --temperatures 0,1 --evaluator {shlex.quote(str(evaluator))} "
            quick += f"--batch-size 16 {dev}"
            self.step(f"{like} compare (QUICK)", quick, stage="compare")
        if a.device == "cuda" and a.ranks > 1:
            self.step(
                f"{like} torchrun extract x{a.ranks}",
                f"{extract} --seed 1",
                stage="extract",
                ranks=a.ranks,
                throughput=tokens_per_s(a.seq_len),
            )
            self.step(
                f"{like} torchrun train-bridge x{a.ranks}",
                f"{bridge} --protocol paper --train-steps {a.paper_steps} --seed 1",
                stage="bridge",
                ranks=a.ranks,
                throughput=steps_per_s,
                precision=precision,
            )


# -- each step's throughput, from its artifact and its wall time -----------------------------------------------
def tokens_per_s(seq_len: int):
    return lambda art, s: f"{art.manifest['metrics']['n_sequences'] * seq_len / s:,.0f} tok/s"


def layers_per_s(art, seconds: float) -> str:
    return f"{len(art.manifest['metrics']['candidates']) / seconds:.2f} layer/s"


def steps_per_s(art, seconds: float) -> str:
    m = art.manifest["metrics"]
    return f"{m['steps'] / art.wall_seconds:.2f} step/s, {m['train_tokens_per_s']:,.0f} tok/s"


def sequences_per_s(art, seconds: float) -> str:
    return f"{art.manifest['metrics']['n_sequences'] / seconds:.1f} seq/s"


def hybrid_tokens_per_s(art, seconds: float) -> str:
    return f"{1000 / art.manifest['metrics']['hybrid']['ms_per_token']:.1f} hybrid tok/s per sequence"


def ms_per_sample(art, seconds: float) -> str:
    return f"{art.manifest['metrics']['ms_per_sample']:.1f} ms/sample"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=os.environ.get("DIHAL_ROOT", "runs/gpu-smoke"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--models", default="llama-3.1-8b,qwen3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sequences", type=int, default=640)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=200, help="cpu-small bridge and prior steps")
    p.add_argument("--paper-steps", type=int, default=200)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096, help="the score's positions")
    p.add_argument("--ranks", type=int, default=0, help="torchrun ranks (default: every GPU, when two or more)")
    p.add_argument("--tokenizer", default=None, help="A tokenizer directory (default: smollm2-135m's)")
    p.add_argument("--shrink", default="", help="make_random_model's shrinking flags, for a CPU rehearsal")
    a = p.parse_args()
    a.shrink = a.shrink.split()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_smoke: torch sees no GPU; rehearse on the CPU with DEVICE=cpu")
    a.ranks = a.ranks or (torch.cuda.device_count() if a.device == "cuda" else 1)
    if a.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(
            f"{torch.cuda.device_count()} x {props.name}, {props.total_memory / 2**30:.0f} GiB; torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}"
        )
    smoke, likes = Smoke(a), a.models.split(",")
    start = time.perf_counter()
    try:
        for i, like in enumerate(likes):
            other = likes[1 - i] if len(likes) > 1 and i == 0 else None
            smoke.chain(like, smoke.model(other) if other else None)
    except Failed as exc:
        print(f"\nFAILED at {exc}", flush=True)
        sys.exit(1)
    print(f"all steps passed in {time.perf_counter() - start:.0f} s; the table is in {smoke.tsv}")


if __name__ == "__main__":
    main()
