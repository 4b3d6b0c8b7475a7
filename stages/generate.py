"""`dihal generate`: autoregressive hybrid generation (METHOD §3, --mode ar); the parallel
mode of METHOD §5 is stages/generate_parallel.py.

Each step: the bridge samples h_l for the new position from its embedding (noise drawn once
per position; with the causal denoiser, earlier positions are cached per sampling step), the
backbone's upper blocks continue with their KV cache, and a token is drawn (temperature,
top-k, top-p). `--baseline original` runs the unmodified backbone through the same loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import torch
from transformers import DynamicCache

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact, ArtifactStore, Job
from dihal.stages.configs import BRIDGE_NOISE, GenerateConfig
from dihal.stages.diffusion import draws
from dihal.stages.lm import decoding, tokens
from dihal.stages.lm.capture import hidden_states
from dihal.stages.lm.hybrid import suffix_model
from dihal.stages.lm.models import LoadedModel, locate, weights_digests
from dihal.stages.lm.tokens import start_token
from dihal.stages.parts.bridge import Bridge
from dihal.stages.runtime import clock, dist
from dihal.stages.runtime.progress import NullProgress, Progress

STAGE = "generate"
# 2: the cached sampler fed the start token's stored state at every position of an unprompted
#    hybrid generation (a start-token-only prefix), so its samples ignored the bridge. Bump whenever
#    the samples a generation writes change (tests/test_golden.py says when). Parallel generation
#    (stages/generate_parallel.py) shares it. 3: a sample ends at any stop id (stages/lm/tokens.py).
CACHE_VERSION = 3


def sample_token(logits: torch.Tensor, cfg: GenerateConfig, gen: torch.Generator) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids, by the one decoding of stages/lm/decoding.py."""
    return decoding.sample(logits, cfg.decoding_temperature, cfg.top_p, cfg.top_k, gen)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The start token (METHOD §0: BOS, else the document separator, else EOS), then the prompt."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    return [start_token(tokenizer)[0]] + ids


def _layer0(model, ids: torch.Tensor) -> torch.Tensor:
    return hidden_states(model, ids, [0])[0].float()


@torch.no_grad()
def generate_hybrid(
    loaded: LoadedModel,
    bridge: Bridge,
    suffix,
    prefix: torch.Tensor,
    cfg: GenerateConfig,
    gen: torch.Generator,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """prefix (B, P) -> (B, max_new_tokens) new ids, hybrid model. noise: (B, covered, D) for the covered
    positions (default: drawn from gen, a fresh draw per sample)."""
    model, batch = loaded.model, prefix.shape[0]
    if noise is None:  # drawn at full scale whatever --bridge-noise, so the tokens' draws that follow are the same
        noise = bridge.noise(batch, prefix.shape[1] + cfg.max_new_tokens, gen) * cfg.bridge_noise
    ids, new = prefix, []
    if cfg.cache:
        sampler, kv = bridge.cached_sampler(cfg.sample_steps, batch), DynamicCache(config=suffix.config)
        h = sampler.extend(_layer0(model, ids), noise[:, : ids.shape[1] - bridge.start])
    for k in range(cfg.max_new_tokens):
        if cfg.cache:
            logits = suffix(inputs_embeds=h.to(_dtype(suffix)), cache=kv, use_cache=True).logits[:, -1]
        else:  # recompute everything from the full prefix (the reference for the cached path)
            h_all = bridge.sample(_layer0(model, ids), cfg.sample_steps, noise)
            logits = suffix(inputs_embeds=h_all.to(_dtype(suffix)), use_cache=False).logits[:, -1]
        token = sample_token(logits, cfg, gen)
        new.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1)
        if cfg.cache and k + 1 < cfg.max_new_tokens:  # the last token is never fed back
            p = ids.shape[1] - 1 - bridge.start
            h = sampler.extend(_layer0(model, token[:, None]), noise[:, p : p + 1])
    return torch.stack(new, dim=1)


@torch.no_grad()
def generate_original(
    loaded: LoadedModel, prefix: torch.Tensor, cfg: GenerateConfig, gen: torch.Generator
) -> torch.Tensor:
    model, new = loaded.model, []
    kv = DynamicCache(config=model.config)
    logits = model(input_ids=prefix, cache=kv, use_cache=True).logits[:, -1]
    for k in range(cfg.max_new_tokens):
        token = sample_token(logits, cfg, gen)
        new.append(token)
        if k + 1 < cfg.max_new_tokens:
            logits = model(input_ids=token[:, None], cache=kv, use_cache=True).logits[:, -1]
    return torch.stack(new, dim=1)


def _dtype(module) -> torch.dtype:
    return next(module.parameters()).dtype


def draw_device(device) -> str:
    """Where a generation draws its bridge noise and its tokens: on a GPU its own generator (nothing goes
    through the host), on the CPU the CPU stream every CPU generation was made with."""
    return "cpu" if torch.device(device).type == "cpu" else str(device)


def noise_key() -> dict:
    """What a stage that runs `dihal generate`'s default AR hybrid (compare's and confirm's rows) hashes of its
    bridge noise: nothing at 1, the scale of every generation made before --bridge-noise existed."""
    return {} if BRIDGE_NOISE == 1.0 else {"ar_bridge_noise": BRIDGE_NOISE}


def generate_key(cfg: GenerateConfig) -> dict:
    """What a generation's id hashes: the flags, with --prompts-from's local files named by their content (an
    edited file is another generation, never the old one served), pydoc by its Python version, and a local
    --model (original-only) by its files."""
    config = {**cfg.hashed(), **weights_digests(model=cfg.model)}  # --model (original-only): a local one by its files
    if draw_device(cfg.device) != "cpu":  # the device's own stream: other tokens than the CPU stream of ids before it
        config["draws"] = "device"
    if cfg.prompts_from is not None:
        from dihal.stages.configs import DataConfig
        from dihal.stages.text.data import hashed_source

        config["prompts_from"], extra = hashed_source(DataConfig(dataset=cfg.prompts_from))
        config.update(extra)
    return config


def corpus_prompts(cfg: GenerateConfig, tokenizer) -> GenerateConfig:
    """cfg with --prompts-from made into prompts: the decoded first --prompt-tokens tokens of the first
    --num-prompts documents of the dataset's train split (the split rule of METHOD §0
    at the default fraction and seed) that are at least twice as long; cfg itself otherwise."""
    if cfg.prompts_from is None:
        return cfg
    from dihal.stages.configs import DataConfig
    from dihal.stages.text.data import documents, is_validation

    data, prompts = DataConfig(dataset=cfg.prompts_from), []
    for index, text in enumerate(documents(data)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not is_validation(index, data.val_fraction, data.seed) and len(ids) >= 2 * cfg.prompt_tokens:
            prompts.append(tokenizer.decode(ids[: cfg.prompt_tokens]))
        if len(prompts) == cfg.num_prompts:
            break
    if len(prompts) < cfg.num_prompts:
        raise DihalError(
            f"dataset '{cfg.prompts_from}' has {len(prompts)} training documents of {2 * cfg.prompt_tokens}+ tokens, "
            f"not --num-prompts {cfg.num_prompts}; ask for fewer"
        )
    return replace(cfg, prompts=tuple(prompts), prompts_from=None)


def jobs(cfg: GenerateConfig) -> list[tuple[str, int]]:
    """(prompt, count) batches: every prompt num_samples times, or BOS alone."""
    prompts = list(cfg.prompts) or [""]
    out = []
    for prompt in prompts:
        left = cfg.num_samples
        while left > 0:
            out.append((prompt, min(left, cfg.batch_size)))
            left -= cfg.batch_size
    return out


def check_length(tokenizer, bridge: Bridge, cfg: GenerateConfig, context: int | None = None) -> None:
    """The start token, the longest prompt and every new token but the last must fit the hybrid's
    positions: a learned-position bridge's (its extract's --seq-len; beyond, it has no position
    embedding), a rotary one's the backbone's context."""
    positions = bridge.positions(context)
    longest = max((len(prompt_ids(tokenizer, p)) for p in cfg.prompts or ("",)), default=1)
    if positions is not None and longest + cfg.max_new_tokens - 1 > positions:
        room = positions - longest + 1
        what = "the bridge covers" if bridge.net.max_positions is not None else "the backbone's context is"
        why = " (its extract's --seq-len; a --positions rotary bridge runs past it)" if "bridge" in what else ""
        raise DihalError(
            f"the start token and prompt ({longest} tokens) plus --max-new-tokens {cfg.max_new_tokens} need "
            f"{longest + cfg.max_new_tokens - 1} positions, but {what} {positions}{why}; "
            + (f"use --max-new-tokens {room} or fewer" if room >= 1 else "shorten the prompt")
        )


def generate_all(loaded: LoadedModel, bridge: Bridge | None, cfg: GenerateConfig, progress: Progress) -> list[dict]:
    """Samples from the hybrid (bridge given) or the original backbone (bridge None)."""
    tok, device = loaded.tokenizer, loaded.device
    suffix = suffix_model(loaded.model, bridge.layer) if bridge is not None else None
    rows = []
    for batch_index, (prompt, count) in enumerate(jobs(cfg)):
        gen = draws.stream(cfg.seed, batch_index, draw_device(device))
        prefix = torch.tensor([prompt_ids(tok, prompt)] * count, device=device)
        start = clock.now(device)
        if bridge is not None:
            new = generate_hybrid(loaded, bridge, suffix, prefix, cfg, gen)
        else:
            new = generate_original(loaded, prefix, cfg, gen)
        seconds = clock.now(device) - start
        for row_ids in new.tolist():
            kept = tokens.truncate(row_ids, loaded.stop_ids)
            rows.append(
                {
                    "prompt": prompt,
                    "text": tok.decode(kept, skip_special_tokens=True),
                    "token_ids": kept,
                    "prompt_ids": prefix[0].tolist(),  # the start token and the prompt, as the model read them
                    "model": "hybrid" if bridge is not None else "original",
                    "n_tokens": len(kept),
                    "batch_seconds": seconds,
                    "ms_per_token": 1000 * seconds / cfg.max_new_tokens,
                    "ms_per_sample": 1000 * seconds / count,
                }
            )
        progress.advance(count)
    return rows


def run(
    cfg: GenerateConfig,
    bridge_art: Artifact,
    store: ArtifactStore,
    loaded: LoadedModel | Callable[[], LoadedModel],
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Artifact:
    """loaded: the backbone, or a function that loads it (called only when there is work to do)."""
    progress = progress or NullProgress()
    if cfg.baseline == "original-only":
        return run_original(cfg, store, loaded, force=force, progress=progress)

    def work(art: Artifact) -> None:
        nonlocal cfg
        model = loaded() if callable(loaded) else loaded
        bridge = Bridge.load(bridge_art, cfg.device)
        cfg = corpus_prompts(cfg, model.tokenizer)
        check_length(model.tokenizer, bridge, cfg, model.max_positions)
        total = len(cfg.prompts or [""]) * cfg.num_samples * (2 if cfg.baseline == "original" else 1)
        progress.start("generate", total, "sample")
        outputs = {"samples.jsonl": generate_all(model, bridge, cfg, progress)}
        if cfg.baseline == "original":
            outputs["samples_original.jsonl"] = generate_all(model, None, cfg, progress)
        progress.stop()
        metrics = {}
        for name, rows in outputs.items():
            art.file(name).write_text("".join(json.dumps(r) + "\n" for r in rows))
            metrics[rows[0]["model"]] = timing(rows)
        art.manifest["metrics"] = metrics
        art.manifest["decoding"] = decoding.describe(cfg.decoding_temperature, cfg.top_p, cfg.top_k)

    extra = {"model": bridge_art.manifest.get("model"), "extract_config": bridge_art.manifest.get("extract_config")}
    parents = {"bridge": bridge_art.id}
    job = Job(STAGE, CACHE_VERSION, generate_key(cfg), parents, work, seed=cfg.seed, device=cfg.device, extra=extra)
    return store.run_stage(job, force=force, progress=progress, group=dist.group())


# -- --batch-size auto: the batch chosen by the memory it needs ------------------------------------------------
CPU_BATCH = GenerateConfig.batch_size  # auto on the CPU and for --mode parallel: the batch of every generation
#                                        before auto existed, so their ids hold
MEMORY_SHARE = 0.8  # of the card's total memory, after the weights; the rest is CUDA's, the allocator's and slack


def shape_of(config) -> dict:
    """What the memory rule reads of a backbone's config (a transformers config or its builtin's recorded shape)."""
    get = lambda k, d=None: getattr(config, k, None) or d
    heads = get("num_attention_heads")
    return {
        "layers": get("num_hidden_layers"),
        "width": get("hidden_size"),
        "heads": heads,
        "kv_heads": get("num_key_value_heads", heads),
        "head_dim": get("head_dim", get("hidden_size") // heads),
        "intermediate": get("intermediate_size"),
        "vocab": get("vocab_size"),
        "tied": bool(get("tie_word_embeddings", False)),
    }


def weight_bytes(shape: dict, dtype_bytes: int) -> int:
    """The backbone's weights (embedding, attention and gated MLP per block; norms left out)."""
    d, hd = shape["width"], shape["head_dim"]
    block = d * hd * (shape["heads"] + 2 * shape["kv_heads"]) + shape["heads"] * hd * d + 3 * d * shape["intermediate"]
    table = shape["vocab"] * d * (1 if shape["tied"] else 2)
    return (table + shape["layers"] * block) * dtype_bytes


def sample_bytes(shape: dict, layer: int, bridge: dict | None, prompt: int, new: int, dtype_bytes: int) -> dict:
    """What one more sample of a batch holds at its peak, by part (bytes). layer: the blocks below it do not
    run (0 for the original); bridge: bridge.json's fields and `steps` (None for the original).
        kv            the KV cache of the blocks that run, at every position fed (the last token never is)
        bridge_cache  the denoiser's key/value cache, one per Euler step, at every covered position (float32)
        noise         the bridge's noise for every covered position (float32)
        decoding      a token's float64 temporaries over the vocabulary (stages/lm/decoding.py: about 8 arrays)
        prefill       the prompt's logits (float32) and one block's attention scores and MLP activations"""
    fed = prompt + new - 1
    parts = {"kv": 2 * (shape["layers"] - layer) * shape["kv_heads"] * shape["head_dim"] * fed * dtype_bytes}
    if bridge is not None:
        den, covered = bridge["denoiser"], fed - bridge["start"]
        parts["bridge_cache"] = bridge["steps"] * den["depth"] * 2 * den["width"] * covered * 4
        parts["noise"] = (prompt + new - bridge["start"]) * den["dim"] * 4
    parts["decoding"] = 8 * shape["vocab"] * 8
    parts["prefill"] = prompt * shape["vocab"] * 4 + (
        shape["heads"] * prompt * prompt * 4 + 3 * prompt * shape["intermediate"] * dtype_bytes
    )
    return parts


def batch_by_memory(cfg: GenerateConfig, need: int, weights: int, total: int) -> int:
    """The largest batch (at most --num-samples) whose samples, at `need` bytes each, fit MEMORY_SHARE of the
    card's `total` bytes beside the `weights`; one line with the sizes where not even one does."""
    room = MEMORY_SHARE * total - weights
    if room < need:
        gib = lambda b: f"{b / 2**30:.1f} GiB"
        raise DihalError(
            f"one sample of {cfg.max_new_tokens} new tokens needs {gib(need)} beside the weights' {gib(weights)}, "
            f"more than {MEMORY_SHARE:.0%} of the device's {gib(total)}; use a smaller --max-new-tokens or --dtype"
        )
    return int(min(cfg.num_samples, room // need))


def auto_batch(cfg: GenerateConfig, bridge_art: Artifact | None, total: int | None = None) -> int:
    """--batch-size auto: CPU_BATCH on the CPU and for --mode parallel; on a GPU the largest batch its memory
    holds (batch_by_memory, over the card's total memory, so one card gives one batch and one id), for the
    hybrid and, with --baseline original, the original too. total: the card's bytes (default: asked of it)."""
    if cfg.mode != "ar" or draw_device(cfg.device) == "cpu":
        return CPU_BATCH
    from dihal.stages.extract import model_config
    from dihal.stages.lineage import origin

    spec = cfg.model if bridge_art is None else origin(bridge_art).model
    shape = shape_of(model_config(spec)[0])
    dtype_bytes = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    # the start token and the prompt, before any tokenizer is loaded: at most a token a byte (byte fallback)
    prompt = 1 + (cfg.prompt_tokens if cfg.prompts_from else max(len(p.encode()) for p in cfg.prompts or ("",)))
    need = 0
    if bridge_art is not None:
        meta = {**json.loads(bridge_art.file("bridge.json").read_text()), "steps": cfg.sample_steps}
        need = sum(sample_bytes(shape, meta["layer"], meta, prompt, cfg.max_new_tokens, dtype_bytes).values())
    if bridge_art is None or cfg.baseline == "original":
        need = max(need, sum(sample_bytes(shape, 0, None, prompt, cfg.max_new_tokens, dtype_bytes).values()))
    total = total if total is not None else torch.cuda.get_device_properties(torch.device(cfg.device)).total_memory
    return batch_by_memory(cfg, need, weight_bytes(shape, dtype_bytes), total)


def timing(rows: list[dict]) -> dict[str, float]:
    """Mean cost and length of one model's samples."""
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    return {
        "ms_per_token": mean("ms_per_token"),
        "ms_per_sample": mean("ms_per_sample"),
        "mean_tokens": mean("n_tokens"),
    }


def run_original(
    cfg: GenerateConfig, store: ArtifactStore, loaded, *, force: bool = False, progress: Progress | None = None
) -> Artifact:
    """--baseline original-only: samples of the unmodified backbone --model alone (no bridge, no
    parent), in samples.jsonl; what `dihal extract --dataset generate:<ID>` reads as the model's text."""
    progress = progress or NullProgress()
    locate(cfg.model)  # a bad --model is one line before anything else

    def work(art: Artifact) -> None:
        nonlocal cfg
        model = loaded() if callable(loaded) else loaded
        art.manifest["model"] = model.identity
        cfg = corpus_prompts(cfg, model.tokenizer)
        longest = max(len(prompt_ids(model.tokenizer, p)) for p in cfg.prompts or ("",))
        if model.max_positions and longest + cfg.max_new_tokens > model.max_positions:
            raise DihalError(
                f"the start token and prompt ({longest} tokens) plus --max-new-tokens {cfg.max_new_tokens} exceed "
                f"the model's context of {model.max_positions}; use a smaller --max-new-tokens"
            )
        progress.start("generate", len(cfg.prompts or [""]) * cfg.num_samples, "sample")
        rows = generate_all(model, None, cfg, progress)
        progress.stop()
        art.file("samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        art.manifest["metrics"] = {"original": timing(rows)}
        art.manifest["decoding"] = decoding.describe(cfg.decoding_temperature, cfg.top_p, cfg.top_k)

    extra = {"extract_config": {"model": cfg.model, "revision": None}}  # what origin() reads
    job = Job(STAGE, CACHE_VERSION, generate_key(cfg), {}, work, seed=cfg.seed, device=cfg.device, extra=extra)
    return store.run_stage(job, force=force, progress=progress, group=dist.group())
