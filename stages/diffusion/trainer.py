"""One training loop for every trained part: the bridge, the prior, the decoder and the autoencoder.

The loop knows nothing of bridges. A stage hands it a Task:

    task.n_train                      how many training sequences there are
    task.chunk                        sequences per storage chunk (reads are grouped by chunk)
    task.read(positions, alloc)       arrays for those training sequences as stored (float16 layers stay
                                      float16), read into alloc's reused buffers where it can
                                      (stages/diffusion/feed.py's `stored`)
    task.loss(net, batch, draws, dev) given those arrays' rows of this step as tensors on the device (a
                                      stored layer made float32 there by feed.as_float), the SUM over
                                      the batch's items of each item's mean loss;
                                      its randomness (t, noise) from `draws` (stages/diffusion/draws.py)
    task.validate(net)                one deterministic number (lower is better)

and the loop owns the rest, once for every task:

- **Epochs.** An epoch visits every training sequence exactly once, in a seeded order: the
  storage chunks are permuted, then sequences are shuffled within windows of
  `shuffle_window` sequences (so reads stay chunk-local while the order is random). Epoch e's
  order depends only on (seed, e). `steps` (or `epochs` x ceil(n_train / batch)) steps run;
  a step takes the next `batch_size` sequences of the order, crossing epochs as needed.
- **Randomness.** Item j of step s draws from a stream determined by (seed, s, j), so a run
  resumed at step s, or split over ranks, draws exactly what one uninterrupted process would; on a
  GPU the draws are made on the device (stages/diffusion/draws.py).
- **Data-parallel.** Under torchrun (a process group is initialized), rank r takes items
  r, r+W, ... of each global batch, reads only those, and gradients are all-reduced by DDP
  (buffers are not broadcast: the decoder's frozen V x D table is one, 2 GB at 8B). A task that
  reads stored layers (`task.stored`) deals chunks instead: the k-th chunk of each shuffle window
  belongs to rank k mod W, and a rank takes the items of its own chunks, so it reads about 1/W of
  the window's bytes, not nearly all of them (issue 64); the global batch is the same, its share
  per rank varies from step to step (a rank with none that step takes item 0 at weight 0).
  The loss is scaled so that the all-reduced gradient equals the single-process gradient of
  the same global batch. Rank 0 validates, checkpoints and logs.
- **Schedules that fit the run.** Warm-up is at most a tenth of the run and a run checkpoints
  at least five times: warmup = min(warmup, steps // 10), checkpoint_every =
  min(checkpoint_every, max(1, steps // 5)). A clamp is announced and recorded in the
  metrics (effective_warmup, effective_checkpoint_every); the last step always evaluates.
- **EMA, checkpoints, resume.** AdamW, gradient clipping, EMA with decay
  min(ema, (1 + step) / (10 + step)). Every checkpoint_every steps the network, optimizer,
  EMA and log go to state.safetensors (no pickle); the same command resumes from it.
- **What a complete part keeps** (keep_weights). final+ema: the final and the EMA weights,
  float32; ema: the EMA weights alone (what every stage samples with, as an imported part);
  ema-bfloat16: those rounded to bfloat16, a quarter of final+ema's bytes, and the last
  validation is of the rounded weights. The resume state goes once the part is complete.
- **Precision.** precision "bfloat16" runs the forward pass under bf16 autocast, on CUDA and
  on CPU alike; weights, optimizer and EMA stay float32.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dihal.artifacts import files
from dihal.artifacts import hidden_states as hs
from dihal.artifacts.errors import DihalError
from dihal.stages.configs import LoopConfig
from dihal.stages.diffusion import draws
from dihal.stages.diffusion.draws import Draws
from dihal.stages.diffusion.feed import Staging
from dihal.stages.runtime import clock, trackers
from dihal.stages.runtime.dist import barrier, distributed
from dihal.stages.runtime.progress import Progress


def loop_config(cfg) -> LoopConfig:
    """The loop's settings out of a part's config (bridge, prior or decoder), by field name."""
    return LoopConfig(**{f.name: getattr(cfg, f.name) for f in fields(LoopConfig)})


class Task(Protocol):
    n_train: int
    chunk: int
    tokens_per_item: int  # for the throughput figure
    stored: bool  # reads stored layers (not --states model): ranks take the items of their own chunks

    def read(self, positions: np.ndarray, alloc=None) -> dict[str, np.ndarray]: ...

    def loss(
        self, net: nn.Module, batch: dict[str, torch.Tensor], draws: Draws, device: torch.device
    ) -> torch.Tensor: ...

    def validate(self, net: nn.Module) -> float: ...


def take_split(task, group, val_sequences: int, start: int = 1, fix: str = "--val-fraction > 0") -> np.ndarray:
    """A Task's data from an extract's split: sets its train_seqs, n_train, chunk and tokens_per_item (positions
    start..T-1 of a sequence) and returns the first val_sequences validation sequences, refusing an extract
    that has none in one line (`fix`: what to extract with)."""
    task.train_seqs = hs.split_indices(group, "train")
    task.n_train, task.chunk = len(task.train_seqs), int(group.attrs["chunk_seqs"])
    task.tokens_per_item = group["input_ids"].shape[1] - start
    val = hs.split_indices(group, "validation")[:val_sequences]
    if val.size == 0:
        raise DihalError(f"the extract has no validation sequences; extract with {fix}")
    return val


# -- the order of the data ------------------------------------------------------------------------------------
def epoch_order(n: int, chunk: int, window: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of 0..n-1: storage chunks in a random order, sequences shuffled within
    windows of about `window` sequences. Depends only on (n, chunk, window, seed, epoch)."""
    rng = np.random.default_rng([seed, epoch, 17])
    chunks = rng.permutation(math.ceil(n / chunk))
    per_window = max(1, window // chunk)
    pieces = []
    for first in range(0, len(chunks), per_window):
        seqs = np.concatenate(
            [np.arange(c * chunk, min((c + 1) * chunk, n)) for c in chunks[first : first + per_window]]
        )
        pieces.append(rng.permutation(seqs))
    return np.concatenate(pieces)


def window_places(n: int, chunk: int, window: int, seed: int, epoch: int) -> np.ndarray:
    """Per chunk of training positions, its place within its shuffle window in epoch_order's order (the same
    permutation: the same generator's first draw)."""
    chunks = np.random.default_rng([seed, epoch, 17]).permutation(math.ceil(n / chunk))
    places = np.empty_like(chunks)
    places[chunks] = np.arange(len(chunks)) % max(1, window // chunk)
    return places


class Schedule:
    """Which training sequences step s uses, over every rank."""

    def __init__(self, n_train: int, chunk: int, cfg: LoopConfig):
        if n_train < 1:
            raise DihalError("there are no training sequences; extract more with --max-sequences")
        self.n, self.chunk, self.cfg = n_train, chunk, cfg
        self.batch = min(cfg.batch_size, n_train)
        self.per_epoch = math.ceil(n_train / self.batch)
        self.total = cfg.steps if cfg.steps is not None else cfg.epochs * self.per_epoch
        self._orders: dict[int, np.ndarray] = {}
        self._places: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)  # the loader's thread asks too: keep one epoch, never fail
        if order is None:
            order = epoch_order(self.n, self.chunk, self.cfg.shuffle_window, self.cfg.seed, epoch)
            self._orders = {epoch: order}
        return order

    def items(self, step: int) -> np.ndarray:
        """The global batch of step `step`: positions into the training sequences."""
        epoch, k = divmod(step, self.per_epoch)
        return self._order(epoch)[k * self.batch : (k + 1) * self.batch]

    def owners(self, step: int, world: int) -> np.ndarray:
        """The rank of each item of step `step` when chunks are dealt: the place of its chunk in its window,
        modulo the world."""
        epoch = step // self.per_epoch
        places = self._places.get(epoch)
        if places is None:
            places = window_places(self.n, self.chunk, self.cfg.shuffle_window, self.cfg.seed, epoch)
            self._places = {epoch: places}
        return places[self.items(step) // self.chunk] % world


class Loader:
    """Reads this rank's items for blocks of steps at once (contiguous reads of the chunks that hold them, as
    stored) and stages them on the device (stages/diffusion/feed.py), the next block on a background thread
    while the current one trains; each step's rows are gathered on the device."""

    def __init__(self, task: Task, schedule: Schedule, rank: int, world: int, first_step: int, device="cpu"):
        self.task, self.schedule, self.rank, self.world = task, schedule, rank, world
        self.by_chunk = world > 1 and getattr(task, "stored", False)  # ranks take their own chunks' items
        self._last: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=int))
        self.block = max(1, schedule.cfg.shuffle_window // schedule.batch)
        self.staging = Staging(torch.device(device))
        self.pool = ThreadPoolExecutor(1)
        self.pending: dict[int, object] = {}
        self.current: tuple[int, dict] | None = None
        self.waited = 0.0  # seconds the main thread waited for a block that was not read yet
        self._submit(first_step // self.block)

    def slots(self, step: int) -> np.ndarray:
        """This rank's slots in the global batch of `step`: r, r + W, ..., or those of its own chunks (the last
        step's kept: the training step asks for its weight and its batch in turn)."""
        last = self._last
        if last[0] == step:
            return last[1]
        if self.by_chunk:
            slots = np.flatnonzero(self.schedule.owners(step, self.world) == self.rank)
        else:
            slots = np.arange(len(self.schedule.items(step)))[self.rank :: self.world]
        self._last = (step, slots)  # one assignment: the Loader's thread asks too
        return slots

    def weight(self, step: int) -> float:
        """1, or 0 for a rank without items at `step` (it still runs item 0, so that DDP's all-reduce meets)."""
        return 1.0 if self.slots(step).size else 0.0

    def mine(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(slots in the global batch, training positions) of this rank's items at `step`. A rank
        left without items (a last batch smaller than the world, or none of its chunks) takes item 0 at
        weight 0."""
        items, slots = self.schedule.items(step), self.slots(step)
        if slots.size == 0:
            slots = np.zeros(1, dtype=int)
        return slots, items[slots]

    def _read_block(self, block: int) -> dict:
        steps = range(block * self.block, min((block + 1) * self.block, self.schedule.total))
        wanted = np.unique(np.concatenate([self.mine(s)[1] for s in steps] or [np.zeros(0, int)]))
        alloc = self.staging.slot()
        staged = self.staging.put(self.task.read(wanted, alloc) if wanted.size else {}, alloc)
        return {"positions": wanted, **staged}

    def _submit(self, block: int) -> None:
        if block * self.block < self.schedule.total and block not in self.pending:
            self.pending[block] = self.pool.submit(self._read_block, block)

    def batch(self, step: int) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        block = step // self.block
        if self.current is None or self.current[0] != block:
            self._submit(block)
            began = time.perf_counter()
            read = self.pending.pop(block).result()
            self.waited += time.perf_counter() - began
            self.current = (block, {"positions": read["positions"], "arrays": self.staging.ready(read)})
            self._submit(block + 1)
        data = self.current[1]
        slots, positions = self.mine(step)
        if not data["arrays"]:
            return slots, {}
        rows = torch.as_tensor(np.searchsorted(data["positions"], positions))
        rows = rows.to(next(iter(data["arrays"].values())).device, non_blocking=True)
        return slots, {k: v.index_select(0, rows) for k, v in data["arrays"].items()}

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# -- the schedule of the optimizer -----------------------------------------------------------------------------
FIT_RULES = {
    "warmup": "is more than a tenth of a run",
    "checkpoint_every": "leaves fewer than five checkpoints in a run",
}


def fitted(cfg: LoopConfig, total: int) -> dict[str, int]:
    """Warm-up (at most a tenth of the run) and checkpoint interval (at least five a run)."""
    return {"warmup": min(cfg.warmup, total // 10), "checkpoint_every": min(cfg.checkpoint_every, max(1, total // 5))}


def lr_at(step: int, total: int, lr: float, warmup: int, schedule: str) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    progress = (step - warmup) / max(1, total - warmup)
    return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class EMA:
    def __init__(self, net: nn.Module, decay: float):
        self.decay = decay
        self.params = {k: v.detach().clone() for k, v in net.state_dict().items()}

    @torch.no_grad()
    def update(self, net: nn.Module, step: int) -> None:
        """ema = d ema + (1 - d) w over every tensor in two foreach kernels (issue 64: a Python loop launched two
        per tensor); elementwise the same operations, so the same bits."""
        d = min(self.decay, (1 + step) / (10 + step))
        state = net.state_dict()
        mine = [self.params[k] for k in state]
        torch._foreach_mul_(mine, d)
        torch._foreach_add_(mine, [v.detach() for v in state.values()], alpha=1 - d)


def kept(params: dict[str, torch.Tensor], keep_weights: str) -> dict[str, torch.Tensor]:
    """The EMA weights as a complete part keeps them: float32, or rounded to bfloat16 (ema-bfloat16)."""
    if keep_weights != "ema-bfloat16":
        return params
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in params.items()}


def ema_validate(task: Task, net: nn.Module, ema: EMA, keep_weights: str = "final+ema") -> float:
    """The validation loss of the EMA weights, as the part will keep them (the last validation of ema-bfloat16:
    rounded; load_state_dict puts them back into the float32 network)."""
    raw = {k: v.clone() for k, v in net.state_dict().items()}
    net.load_state_dict(kept(ema.params, keep_weights))
    try:
        return task.validate(net.eval())
    finally:
        net.load_state_dict(raw)
        net.train()


def autocast(precision: str, device: torch.device):
    if precision == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


FLUSH_EVERY = {"cuda": 16}  # steps between host reads of the losses, by device type (1 elsewhere)


# -- the loop ---------------------------------------------------------------------------------------------------
def train(task: Task, net: nn.Module, cfg: LoopConfig, directory: Path, progress: Progress, name: str) -> dict:
    """Train (or resume) `net` on `task`; rank 0 writes state, metrics and final weights into
    `directory`. Returns metrics (on every rank) and leaves the EMA weights in the result."""
    fit = Fit(task, net, cfg, directory, progress, name)
    try:
        for step in range(fit.first_step, fit.total):
            fit.record(step, fit.step(step))
    finally:
        fit.loader.close()
    return fit.finish()


def optimizer(net: nn.Module, cfg: LoopConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; on a GPU its fused kernel (one launch for every parameter; other rounding than the CPU's
    per-tensor loop, so a GPU config hashes it: configs.Recipe.hashed)."""
    fused = torch.device(device).type == "cuda" or None
    return torch.optim.AdamW(net.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, fused=fused)


class Fit:
    """One run of the loop: `step` trains one global batch, `record` logs, validates and checkpoints it
    (rank 0), `save` and `resume` are the checkpoint's two sides, `finish` writes the weights."""

    def __init__(self, task: Task, net: nn.Module, cfg: LoopConfig, directory: Path, progress: Progress, name: str):
        self.task, self.cfg, self.directory, self.progress, self.name = task, cfg, directory, progress, name
        self.rank, self.world = distributed()
        self.device = torch.device(cfg.device)
        self.schedule = Schedule(task.n_train, task.chunk, cfg)
        self.total, self.fit = self.schedule.total, fitted(cfg, self.schedule.total)
        if self.rank == 0:
            for key, value in self.fit.items():
                if value != getattr(cfg, key):
                    progress.log(
                        f"{name}: {key.replace('_', ' ')} {getattr(cfg, key)} {FIT_RULES[key]} of {self.total} steps; "
                        f"using {value}"
                    )
        self.net = net.to(self.device)
        self.optimizer = optimizer(self.net, cfg, self.device)
        self.ema = EMA(self.net, cfg.ema)
        self.metrics_path = directory / "metrics.jsonl"
        self.first_step, self.log = self.resume()
        self.report = trackers.current()  # --report-to's trackers (rank 0 only; none by default)
        self.report.resume(self.first_step)
        if self.rank == 0:  # metrics.jsonl holds the checkpoint's steps: once each, in order, whatever was killed when
            files.write_jsonl(self.metrics_path, self.log)
            if self.first_step:
                progress.log(f"resuming {name} training at step {self.first_step} of {self.total}")
        self.model = nn.parallel.DistributedDataParallel(net, broadcast_buffers=False) if self.world > 1 else net
        if cfg.compile:  # the step's forward and backward compiled (the EMA, validation and weights use net itself)
            self.model = torch.compile(self.model)
        self.loader = Loader(task, self.schedule, self.rank, self.world, self.first_step, self.device)
        if self.rank == 0:
            progress.start(name, self.total - self.first_step, "step")
        self.start, self.tokens = clock.now(self.device), 0
        # losses stay on the device and reach the host every flush_every steps (and at each validation and
        # checkpoint): on a GPU a read per step would make the host wait for every step; on the CPU it costs
        # nothing, and every step's row is logged as it ends
        self.pending: list[dict] = []
        self.flush_every = FLUSH_EVERY.get(self.device.type, 1)

    def step(self, step: int) -> dict:
        """One optimizer step on the global batch of `step`; its row of metrics.jsonl."""
        cfg, device = self.cfg, self.device
        slots, batch = self.loader.batch(step)
        global_size = len(self.schedule.items(step))
        weight = self.loader.weight(step)
        lr = lr_at(step, self.total, cfg.lr, self.fit["warmup"], cfg.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with autocast(cfg.precision, device):
            summed = self.task.loss(
                self.model, batch, draws.for_step(cfg.seed, step, slots, global_size, device), device
            )
        # DDP averages gradients over ranks; scaling by world / global size makes the result the
        # gradient of the global batch's mean loss, as one process would compute it
        loss = summed.float() * (weight * self.world / global_size)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        logged = summed.detach().float() * weight
        if self.world > 1:
            dist.all_reduce(logged)  # queued on the device like the gradients' (no host wait)
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_(self.net.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.ema.update(self.net, step)
        self.tokens += self.task.tokens_per_item * global_size
        return {"step": step + 1, "summed": logged, "global_size": global_size, "lr": lr}

    def record(self, step: int, row: dict) -> None:
        """Keep the step's row; where a flush is due (every rank at the same steps), read the kept rows' losses
        in one host read, fail on a non-finite one, and on rank 0 log them (metrics.jsonl, trackers, progress),
        with the validation loss and the checkpoint where due (the last one: a kill after it redoes nothing)."""
        self.pending.append(row)
        last = step + 1 == self.total
        validate = (step + 1) % self.cfg.eval_every == 0 or last
        checkpoint = (step + 1) % self.fit["checkpoint_every"] == 0 or last
        if not (validate or checkpoint or len(self.pending) >= self.flush_every):
            return
        rows = self.flush()
        if self.rank != 0:
            return
        if validate:
            kept_as = self.cfg.keep_weights if last else "final+ema"  # rounded only where the part keeps it so
            rows[-1]["val_loss"] = ema_validate(self.task, self.net, self.ema, kept_as)
        for row in rows:
            self.log.append(row)
            files.append_jsonl(self.metrics_path, row)
            self.report.log(row["step"], row)
            if row is rows[-1] and checkpoint:
                self.save(row["step"])
            info = {"val_loss": row["val_loss"]} if "val_loss" in row else {}
            self.progress.advance(1, loss=row["train_loss"], tokens_per_s=row["tokens_per_s"], **info)

    def flush(self) -> list[dict]:
        """The kept rows with their losses read from the device (one synchronisation for all of them) and the
        throughput so far; a non-finite loss is an error naming its step, before anything of it is saved."""
        rows, self.pending = self.pending, []
        summed = torch.stack([row["summed"] for row in rows]).tolist()
        losses = [value / row["global_size"] for row, value in zip(rows, summed, strict=True)]
        for row, value in zip(rows, losses, strict=True):
            if not math.isfinite(value):
                kept = files.load_state(self.directory)
                where = f"step {kept['step']}" if kept else "none yet"
                raise DihalError(
                    f"{self.name} loss became {value} at step {row['step'] - 1} (last good checkpoint: {where}); "
                    "lower --lr or raise --warmup, then rerun to resume"
                )
        rate = self.tokens / max(clock.now(self.device) - self.start, 1e-9)  # the device has just finished
        return [
            {"step": row["step"], "train_loss": loss, "lr": row["lr"], "tokens_per_s": rate}
            for row, loss in zip(rows, losses, strict=True)
        ]

    def save(self, step: int) -> None:
        """The resume state after `step` steps (no pickle: files.save_state); resume() reads it back."""
        state = {"step": step, "model": self.net.state_dict(), "optimizer": self.optimizer.state_dict()}
        files.save_state(self.directory, {**state, "ema": self.ema.params, "log": self.log})

    def resume(self) -> tuple[int, list[dict]]:
        """(first step, log so far) from the state save() wrote, loaded into net, optimizer and EMA; (0, [])
        without one. A state at the last step (a kill before completion) leaves no step to run."""
        state = files.load_state(self.directory)
        if state is None:
            return 0, []
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.ema.params = {k: v.to(self.device) for k, v in state["ema"].items()}  # mixed with the net's by updates
        return state["step"], state["log"]

    def finish(self) -> dict:
        """Rank 0 writes the final and EMA weights; every rank returns the run's metrics."""
        if self.rank == 0:
            self.progress.stop()
            if self.cfg.keep_weights == "final+ema":
                files.save_tensors(self.directory / "weights.safetensors", self.net.state_dict())
            files.save_tensors(self.directory / "weights_ema.safetensors", kept(self.ema.params, self.cfg.keep_weights))
        barrier()  # the resume state goes once the artifact is complete (store.Artifact.finish)
        log = self.log
        return {
            "steps": self.total,
            "epochs_seen": self.total / self.schedule.per_epoch,
            "steps_per_epoch": self.schedule.per_epoch,
            "global_batch": self.schedule.batch,
            "world_size": self.world,
            **{f"effective_{k}": v for k, v in self.fit.items()},
            "val_loss": log[-1].get("val_loss") if log else None,
            "final_train_loss": log[-1]["train_loss"] if log else None,
            "train_tokens_per_s": log[-1]["tokens_per_s"] if log else None,
            # the main thread's wait for blocks the Loader had not read yet (rank 0's; the share of the run spent
            # waiting for data, against the run's time at tokens_per_s)
            "data_wait_seconds": round(self.loader.waited, 3),
            "log": log,
        }


def write_trained(
    store, stage: str, version: int, config: dict, parents: dict, extract, cfg, train_fn, *, force: bool, progress
):
    """The artifact of a trained part under one or many ranks (store.run_stage): rank 0 owns it (lock,
    manifest, files) while every rank runs train_fn(artifact, progress) -> metrics; others get a NullProgress."""
    from dihal.artifacts.store import Job
    from dihal.stages.runtime.dist import group
    from dihal.stages.runtime.progress import NullProgress

    def work(art) -> None:
        rank = distributed()[0]
        with trackers.run(stage, art.id, art.config, art.path, rank) as report:
            metrics = train_fn(art, progress if rank == 0 else NullProgress())
            if rank == 0:
                art.manifest["metrics"] = metrics
                curve = art.path / "loss_curve.png"
                report.finish(metrics, curve if curve.is_file() else None)

    extra = {"model": extract.manifest.get("model"), "extract_config": extract.config}
    job = Job(stage, version, config, parents, work, seed=cfg.seed, device=cfg.device, extra=extra, every_rank=True)
    return store.run_stage(job, force=force, progress=progress, group=group())
