"""The hybrid of METHOD §3 as a `transformers` causal LM (`dihal.load_hybrid`), so the tools
that take a `PreTrainedModel` (lm-evaluation-harness's HFLM, a notebook's own loop) can use a trained bridge.

forward(input_ids, attention_mask) is teacher forced: the bridge samples h_l from the tokens' layer-0
states (their embeddings), then the backbone's upper blocks, final norm and LM head give the logits,
exactly as `dihal evaluate`'s fidelity computes them (stages/fidelity.py).

Three choices make it a function of its input alone, as a causal LM must be:
- **Noise.** The bridge is a sampler. Its noise is one fixed draw per position, `bridge.noise(1, P, seed)`
  over the P positions it covers, and every row reads it by its position, so a row's logits depend neither
  on its batch nor on its padding. A position's state does not depend on the later tokens, as the
  denoiser is causal. Fidelity's first sequence (one at a time, seed 0) gets the same draw.
- **Position 0.** The bridge does not cover it: its state is the stored start-token state, as in
  training, and for any other first token it is the original's exact state of that token alone
  (lm-eval starts a context without BOS).
- **Padding.** Either side: each row's real tokens are read as an unpadded row, their positions counted
  from 0.

A real cache. forward(..., cache=..., use_cache=True) returns a `HybridCache`: a transformers
`DynamicCache` for the upper blocks that also holds the bridge's key/value caches (one per Euler step,
per group of rows of one length), so a forward of the next tokens computes only them. transformers'
own generation loop runs on it: `generate(input_ids, ...)` is `GenerationMixin.generate`, every
argument it takes honoured (streamer, stopping criteria, num_return_sequences, a GenerationConfig,
...), and what the hybrid cannot do (beam search, assisted and contrastive decoding, static caches,
attentions and hidden states out) refused in one line naming the argument. Called with prompts (a
string or a list), generate is `dihal generate`'s own loop and returns its samples, token for token.

Length. A learned-position bridge ends at its extract's --seq-len (`positions`); a rotary one
(`train-bridge --positions rotary`) runs to the backbone's context, its noise drawn per position in
blocks of its training length as far as a row reaches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from dihal.artifacts.errors import DihalError
from dihal.artifacts.store import Artifact
from dihal.stages import export
from dihal.stages import generate as gen_stage
from dihal.stages.configs import GenerateConfig
from dihal.stages.diffusion import draws
from dihal.stages.export import Package
from dihal.stages.hybrid_config import HybridConfig
from dihal.stages.lm import tokens
from dihal.stages.lm.capture import hidden_states
from dihal.stages.lm.hybrid import lm_logits, suffix_model
from dihal.stages.lm.models import LoadedModel
from dihal.stages.parts.bridge import Bridge, CachedSampler
from dihal.stages.runtime.progress import NullProgress

STEPS = GenerateConfig.sample_steps  # the bridge's Euler steps, as `dihal generate` takes them

# what generate() refuses, by argument, with why: the rest of GenerationMixin's arguments are honoured
REFUSED = {
    "num_beams": "beam search",
    "num_beam_groups": "group beam search",
    "penalty_alpha": "contrastive search",
    "assistant_model": "assisted decoding",
    "prompt_lookup_num_tokens": "prompt-lookup decoding",
    "assistant_early_exit": "self-speculative decoding",
    "dola_layers": "DoLa decoding",
    "cache_implementation": "static and quantized caches",
    "prefill_chunk_size": "chunked prefill",
    "output_attentions": "attentions out",
    "output_hidden_states": "hidden states out",
    "inputs_embeds": "embeddings in (the bridge reads token ids)",
    "custom_generate": "custom generation code",
    "guidance_scale": "classifier-free guidance",
    "negative_prompt_ids": "classifier-free guidance",
    "constraints": "constrained beam search",
    "force_words_ids": "constrained beam search",
    "use_mtp": "multi-token prediction",
    "speculation_type": "speculative decoding",
    "continuous_batching_config": "continuous batching",
}
NEUTRAL = {"num_beams": 1, "num_beam_groups": 1, "guidance_scale": 1.0}  # a refused argument at its no-op value
MODEL_INPUTS = ("input_ids", "attention_mask", "cache", "past_key_values", "tokenizer", "use_model_defaults")


def generate_arguments() -> frozenset[str]:
    """Every keyword GenerationMixin.generate takes: its own parameters, GenerationConfig's fields, and the
    model inputs the hybrid reads."""
    import inspect

    own = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"}
    return frozenset(own | set(GenerationConfig().to_dict()) | set(MODEL_INPUTS))


OWN_LOOP = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "num_samples", "batch_size")


@dataclass
class Generation:
    """What hybrid.generate(prompts) returns: one text and its new token ids per sample (cut at a stop id)."""

    prompts: list[str]
    texts: list[str]
    token_ids: list[list[int]]


class HybridCache(DynamicCache):
    """The hybrid's cache: the upper blocks' keys and values (this DynamicCache itself, laid out by the
    suffix model's config) and the bridge's, one CachedSampler per group of rows whose real tokens are
    equally many (rows of one length advance together). lengths: each row's real tokens so far."""

    def __init__(self, config, groups: list[tuple[torch.Tensor, CachedSampler]], lengths: torch.Tensor):
        super().__init__(config=config)
        self.groups, self.lengths = groups, lengths


class HybridForCausalLM(PreTrainedModel, GenerationMixin):
    """A loaded backbone and a trained bridge at its layer l. Built by dihal.load_hybrid, not from_pretrained."""

    config_class = HybridConfig
    base_model_prefix = "hybrid"
    main_input_name = "input_ids"

    def __init__(
        self,
        loaded: LoadedModel,
        bridge: Bridge,
        bridge_id: str,
        steps: int = STEPS,
        seed: int = 0,
        source: Artifact | Package | None = None,
    ):
        """source: the bridge artifact or the exported package it came from (what save_pretrained exports)."""
        backbone = loaded.model.config
        own = dict(
            bridge=bridge_id,
            layer=bridge.layer,
            steps=steps,
            seed=seed,
            vocab_size=backbone.vocab_size,
            hidden_size=backbone.hidden_size,
            max_position_embeddings=bridge.positions(loaded.max_positions),  # learned: the extract's --seq-len
            bos_token_id=loaded.tokenizer.bos_token_id,
            eos_token_id=loaded.tokenizer.eos_token_id,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
        exported = source.config if isinstance(source, Package) else {}  # an exported bridge's fields besides
        config = HybridConfig(**{k: v for k, v in exported.items() if k not in {*own, "model_type"}}, **own)
        super().__init__(config)
        self.source = source
        self.backbone, self.denoiser = loaded.model, bridge.net  # registered, so .to() and .device see them
        self.loaded, self.bridge, self.tokenizer = loaded, bridge, loaded.tokenizer
        self.suffix = suffix_model(loaded.model, bridge.layer)
        self.start_id = tokens.start_token(loaded.tokenizer)[0]
        self.generation_config = self._generation_config()
        self.block = bridge.net.cfg.max_len  # covered positions per noise block: the training length
        first = bridge.noise(1, self.block + bridge.start, torch.Generator().manual_seed(seed))[0]
        self.register_buffer("noise", first, persistent=False)  # block 0: the draw fidelity's first row gets

    def _generation_config(self) -> GenerationConfig:
        """The backbone's generation settings, with every stop id (EOS, the document end, its own list) and,
        for a learned-position bridge, max_length at the positions it covers."""
        own = getattr(self.backbone, "generation_config", None)
        out = copy.deepcopy(own) if own is not None else GenerationConfig()
        out.eos_token_id = sorted(self.loaded.stop_ids) or None
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else self.config.eos_token_id
        out.pad_token_id = pad if pad is not None else (out.eos_token_id or [None])[0]
        out.bos_token_id = self.start_id
        if self.bridge.net.max_positions is not None:
            out.max_length = self.positions
        return out

    @classmethod
    def from_bridge(cls, art, device: str, dtype: str, steps: int = STEPS, seed: int = 0, trust_remote_code=False):
        """The hybrid of a bridge artifact: its backbone loaded as its extract was made (load_model checks
        that the device runs the dtype), the bridge on the same device."""
        from dihal.stages.lineage import backbone_for

        loaded = backbone_for(art, device, dtype, trust_remote_code)
        return cls(loaded, Bridge.load(art, loaded.device), art.id, steps, seed, source=art)

    # -- sharing (stages/export.py) ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        base_model=None,
        check_base: bool = True,
        device: str | None = None,
        dtype=None,
        steps: int | None = None,
        seed: int | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        **kwargs,
    ) -> HybridForCausalLM:
        """An exported bridge (a folder or a hub repo id) on its base model: the one its config names (a
        builtin or a hub id), or `base_model` (a --model spec, or a model already loaded, with its tokenizer
        as (model, tokenizer) or a LoadedModel). The base model's weights and tokenizer must hash to the
        package's sha256 unless check_base=False, which the hybrid records (config.base_check).
        AutoModelForCausalLM's own arguments (dtype or torch_dtype, device_map) are read as dtype and
        device; the ones that would change the model (quantization, gguf_file, subfolder) are refused."""
        given = kwargs.pop("config", None)  # AutoModelForCausalLM's: its steps and seed carry steps= and seed=
        if isinstance(given, HybridConfig):
            steps = given.steps if steps is None else steps
            seed = given.seed if seed is None else seed
        device, dtype = _loading_arguments(model_args, kwargs, device, dtype)
        package = export.read(pretrained_model_name_or_path, None if revision in (None, "main") else revision)
        loaded, actual = _base(package, base_model, device, dtype, trust_remote_code, check_base)
        export.check_layer(package, loaded.num_blocks)
        check = export.check_base(package, actual, check_base)
        cfg = package.config
        bridge = Bridge.read(package.meta, package.file(export.WEIGHTS), package.file(export.STATS), loaded.device)
        steps = steps if steps is not None else cfg.get("steps", STEPS)
        seed = seed if seed is not None else cfg.get("seed", 0)
        hybrid = cls(loaded, bridge, cfg["bridge"], steps, seed, source=package)
        hybrid.config.base_check = check
        return hybrid

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        """The bridge alone, exported (stages/export.py): what `dihal export` writes, never a backbone tensor.
        push_to_hub=True (with repo_id=, private=, token=) uploads it too."""
        extra = sorted(set(kwargs) - {"repo_id", "private", "token", "safe_serialization", "is_main_process"})
        if extra:
            raise DihalError(f"save_pretrained() got '{extra[0]}', which a bridge's export does not take; drop it")
        out = Path(save_directory)
        if isinstance(self.source, Artifact):
            from dihal.artifacts.store import ArtifactStore

            results = export.results_for(ArtifactStore(self.source.root), self.source)
            steps, seed = self.config.steps, self.config.seed
            export.write(out, self.source, self.tokenizer, steps=steps, seed=seed, results=results)
        elif isinstance(self.source, Package):
            export.copy(self.source, out, steps=self.config.steps, seed=self.config.seed)
        else:
            raise DihalError("this hybrid was built by hand, not from a bridge artifact or package; nothing to export")
        if push_to_hub:
            repo = kwargs.get("repo_id") or out.name
            export.push(out, repo, private=bool(kwargs.get("private")), token=kwargs.get("token"))

    def push_to_hub(self, repo_id: str, *, private: bool = False, token: str | None = None, **kwargs) -> str:
        """Export into a temporary folder and upload it to the hub repo `repo_id` (created if need be)."""
        import tempfile

        if kwargs:
            raise DihalError(f"push_to_hub() got '{sorted(kwargs)[0]}', which a bridge's upload does not take")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / repo_id.split("/")[-1]
            self.save_pretrained(out)
            return export.push(out, repo_id, private=private, token=token)

    @property
    def positions(self) -> int | None:
        return self.config.max_position_embeddings

    def _prepare_attention_mask_for_generation(self, inputs_tensor, generation_config, model_kwargs):
        """transformers reads a row's pad ids as padding when no mask is given; Qwen3's pad id is its start
        token <|endoftext|>, which is no padding: then every token is real (pass attention_mask to pad)."""
        if generation_config.pad_token_id == self.start_id:
            return torch.ones(inputs_tensor.shape[:2], dtype=torch.long, device=inputs_tensor.device)
        return super()._prepare_attention_mask_for_generation(inputs_tensor, generation_config, model_kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # generate: the forward makes its own HybridCache
        return False

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def get_output_embeddings(self):
        return self.backbone.get_output_embeddings()

    def _init_weights(self, module):  # every weight is trained already: nothing is initialised
        pass

    # -- noise ---------------------------------------------------------------------------------------------
    def noise_for(self, covered: int) -> torch.Tensor:
        """(covered, D) noise of the first `covered` covered positions: block 0 the buffer, block k the
        bridge's draw from draws.noise_block(seed, k), drawn once as a row first reaches it."""
        while self.noise.shape[0] < covered:
            k = self.noise.shape[0] // self.block
            gen = draws.noise_block(self.config.seed, k)
            more = self.bridge.noise(1, self.block + self.bridge.start, gen)[0].to(self.noise.device)
            self.noise = torch.cat([self.noise, more])
        return self.noise[:covered]

    # -- the teacher-forced forward ----------------------------------------------------------------------
    @torch.no_grad()
    def layer_states(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) ids and their 0/1 mask -> (B, T, D) float32 bridge states at layer l (zeros at pads)."""
        return self._states(input_ids, mask, None)[0]

    def _states(self, input_ids: torch.Tensor, mask: torch.Tensor, steps: int | None):
        """States of whole rows (their real tokens read as unpadded rows) and, for steps, the groups of rows
        of one length with each one's CachedSampler (a cache's first forward)."""
        b, t = input_ids.shape
        h0 = hidden_states(self.backbone, input_ids, [0])[0].float()
        out = torch.zeros(b, t, self.config.hidden_size, device=h0.device)
        spans = [mask[r].nonzero()[:, 0] for r in range(b)]
        groups = []
        for length in sorted({len(s) for s in spans} - {0}):
            rows = [r for r in range(b) if len(spans[r]) == length]
            idx = torch.stack([spans[r] for r in rows])  # (n, length) real columns of each row
            cond = torch.stack([h0[r, spans[r]] for r in rows])
            noise = self.noise_for(length - self.bridge.start).expand(len(rows), -1, -1)
            if steps is None:
                states = self.bridge.sample(cond, self.config.steps, noise)
            else:
                sampler = self.bridge.cached_sampler(steps, len(rows))
                states = sampler.extend(cond, noise)
                groups.append((torch.tensor(rows, device=h0.device), sampler))
            if self.bridge.start == 1:  # position 0: the exact state of the row's first token
                first = torch.stack([input_ids[r, spans[r][0]] for r in rows])
                other = first != self.start_id
                if other.any():
                    exact = hidden_states(self.backbone, first[other][:, None], [self.bridge.layer])[self.bridge.layer]
                    states[other, 0] = exact[:, 0].float()
            for k, r in enumerate(rows):
                out[r, idx[k]] = states[k]
        return out, groups

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: HybridCache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values: HybridCache | None = None,
        **ignored,
    ) -> CausalLMOutputWithPast:
        """Teacher-forced float32 logits (B, T, V), and the mean next-token loss where labels are given
        (-100 ignored, shifted as transformers' causal LMs do). With use_cache (or a cache), the logits of
        these tokens after the cache's, and the cache extended by them (`past_key_values` is the old name
        of `cache`). position_ids and the like are ignored: positions follow from the mask and the cache."""
        if ignored.get("inputs_embeds") is not None or input_ids is None or input_ids.dim() != 2:
            raise DihalError("the hybrid reads input_ids of shape (batch, tokens); pass token ids, not embeddings")
        cache = cache if cache is not None else past_key_values
        if cache is not None and not isinstance(cache, HybridCache):
            raise DihalError(
                f"the hybrid continues only a HybridCache it returned, not a {type(cache).__name__}; pass "
                "use_cache=True and feed back output.cache"
            )
        input_ids = input_ids.to(self.device)
        if cache is not None or use_cache:
            logits, cache = self._cached(input_ids, attention_mask, cache, logits_to_keep)
        else:
            mask = self._mask(input_ids, attention_mask)
            self._check_length(input_ids.shape[1])
            states = self.layer_states(input_ids, mask)
            position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
            with torch.no_grad():
                hidden = self.suffix.model(
                    inputs_embeds=states.to(self.backbone.dtype),
                    attention_mask=mask.long(),
                    position_ids=position_ids,
                    use_cache=False,
                ).last_hidden_state
                logits = lm_logits(self.backbone, hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).to(logits.device)
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    @torch.no_grad()
    def _cached(self, input_ids: torch.Tensor, attention_mask, cache: HybridCache | None, keep: int = 0):
        """(float32 logits of these tokens, the extended cache). The first forward takes left-padded rows;
        after it every row gains these tokens."""
        b, n = input_ids.shape
        if cache is None:
            mask = self._mask(input_ids, attention_mask)
            if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
                raise DihalError("a cached forward takes rows padded on the left only; pad on the left")
            lengths = mask.sum(1)
            self._check_length(int(lengths.max()))
            states, groups = self._states(input_ids, mask, self.config.steps)
            cache = HybridCache(self.suffix.config, groups, lengths)
            position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
            full_mask = mask.long()
        else:
            before = cache.lengths
            self._check_length(int(before.max()) + n)
            h0 = hidden_states(self.backbone, input_ids, [0])[0].float()
            states = torch.zeros(b, n, self.config.hidden_size, device=h0.device)
            for rows, sampler in cache.groups:
                p = int(before[rows[0]]) - self.bridge.start  # the group's next covered position
                noise = self.noise_for(p + n)[p:].expand(len(rows), -1, -1)
                states[rows] = sampler.extend(h0[rows], noise)
            cache.lengths = before + n
            position_ids = before[:, None] + torch.arange(n, device=before.device)[None]
            past = cache.get_seq_length()
            full_mask = (
                attention_mask.to(self.device).long()
                if attention_mask is not None and attention_mask.shape[1] == past + n
                else torch.ones(b, past + n, dtype=torch.long, device=self.device)
            )
        hidden = self.suffix.model(
            inputs_embeds=states.to(self.backbone.dtype),
            attention_mask=full_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        ).last_hidden_state
        return lm_logits(self.backbone, hidden[:, -keep:] if keep else hidden), cache

    def _check_length(self, tokens: int) -> None:
        if self.positions is not None and tokens > self.positions:
            raise DihalError(
                f"{tokens} tokens, but the bridge covers {self.positions} positions (its extract's --seq-len); "
                "pass shorter rows (lm-eval: max_length), or train it with --positions rotary to run past it"
            )

    def _mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The 0/1 mask on the model's device; each row's ones one contiguous run (padding on either side)."""
        if attention_mask is None:
            return torch.ones_like(input_ids, dtype=torch.bool, device=self.device)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise DihalError(
                f"attention_mask has shape {tuple(attention_mask.shape)} and input_ids {tuple(input_ids.shape)}; "
                "give one 0/1 entry per token"
            )
        mask = attention_mask.to(self.device) != 0
        runs = (mask[:, 1:] != mask[:, :-1]).sum(1) + mask[:, 0].long() + mask[:, -1].long()
        if bool((runs > 2).any()):
            raise DihalError("attention_mask has a gap inside a row; pad on the left or the right only")
        return mask

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, inputs: str | list[str] | torch.Tensor | None = None, **kwargs):
        """Token ids (inputs or input_ids, with attention_mask) -> transformers' GenerationMixin.generate on the
        hybrid's cache, every argument it takes honoured and the ones the hybrid cannot do refused in one line.
        Prompts (a string or a list) -> Generation, the samples `dihal generate --prompt ... --seed` writes
        (its own loop: max_new_tokens, temperature, top_p, top_k, seed, num_samples, batch_size)."""
        if isinstance(inputs, str) or (isinstance(inputs, list) and all(isinstance(x, str) for x in inputs)):
            return self._own_loop(inputs, **kwargs)
        if inputs is None and kwargs.get("input_ids") is None:
            return self._own_loop([""], **kwargs)
        unknown = sorted(set(kwargs) - generate_arguments())
        if unknown:
            raise DihalError(
                f"generate() got '{unknown[0]}', which neither transformers' generate nor the hybrid takes; drop it"
            )
        config = kwargs.get("generation_config")
        for name, what in REFUSED.items():
            given = kwargs.get(name, getattr(config, name, None) if config is not None else None)
            if given is not None and given is not False and given != NEUTRAL.get(name, None):
                raise DihalError(f"generate() got {name}={given!r}: the hybrid does not do {what}; leave it out")
        return super().generate(inputs, **kwargs)

    def _own_loop(self, prompts, **kwargs) -> Generation:
        unknown = sorted(set(kwargs) - set(OWN_LOOP))
        if unknown:
            raise DihalError(
                f"generate(prompts) got '{unknown[0]}', which the prompts' loop does not take ({', '.join(OWN_LOOP)}); "
                "pass token ids (input_ids) for transformers' generation arguments"
            )
        prompts = [prompts] if isinstance(prompts, str) else list(prompts or [""])
        cfg = self._config(prompts, **kwargs)
        gen_stage.check_length(self.tokenizer, self.bridge, cfg, self.loaded.max_positions)
        rows = gen_stage.generate_all(self.loaded, self.bridge, cfg, NullProgress())
        return Generation([r["prompt"] for r in rows], [r["text"] for r in rows], [r["token_ids"] for r in rows])

    def _config(
        self,
        prompts,
        max_new_tokens=None,
        temperature=None,
        top_p=None,
        top_k=None,
        seed=0,
        num_samples=1,
        batch_size=GenerateConfig.batch_size,
    ) -> GenerateConfig:
        defaults = GenerateConfig()
        return GenerateConfig(
            prompts=tuple(prompts) if any(prompts) else (),
            num_samples=num_samples,
            max_new_tokens=max_new_tokens or defaults.max_new_tokens,
            temperature=temperature,
            top_p=defaults.top_p if top_p is None else top_p,
            top_k=defaults.top_k if top_k is None else top_k,
            sample_steps=self.config.steps,
            batch_size=batch_size,
            seed=seed,
            device=str(self.device.type),
        )


# -- from_pretrained's arguments ----------------------------------------------------------------------------
IGNORED_IF_EMPTY = ("gguf_file", "quantization_config", "subfolder", "tp_plan", "load_in_8bit", "load_in_4bit")
HUB_ARGUMENTS = ("cache_dir", "token", "local_files_only", "force_download", "proxies", "low_cpu_mem_usage", "config")
AUTO_ARGUMENTS = ("_from_auto", "_from_pipeline", "_commit_hash", "adapter_kwargs", "attn_implementation")


def _loading_arguments(model_args, kwargs: dict, device, dtype) -> tuple[str, str]:
    """(device, dtype) from from_pretrained's own and transformers' arguments, or one line for the rest."""
    import torch

    if model_args:
        raise DihalError("from_pretrained takes the bridge's folder or hub id and keywords only")
    for name in IGNORED_IF_EMPTY:
        if kwargs.pop(name, None):
            raise DihalError(
                f"from_pretrained(..., {name}=...): a dihal bridge loads its base model itself; leave it out"
            )
    for name in HUB_ARGUMENTS + AUTO_ARGUMENTS:  # where the package and its base model come from: dihal's own
        kwargs.pop(name, None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else torch_dtype
    device_map = kwargs.pop("device_map", None)
    kwargs = {k: v for k, v in kwargs.items() if v is not None and v != {}}  # what callers pass unset (HFLM)
    if kwargs:
        raise DihalError(f"from_pretrained() got '{sorted(kwargs)[0]}', which a dihal bridge does not take; drop it")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device is None and device_map is not None:
        if not isinstance(device_map, (str, int, torch.device)):
            raise DihalError("device_map: a dihal hybrid runs on one device; give device='cuda:0' (or cpu)")
        device = "auto" if device_map == "auto" else str(torch.device(device_map))
    return device or "cpu", dtype or "float32"


def _base(package: Package, base_model, device: str, dtype: str, trust_remote_code: bool, check: bool):
    """(the base model loaded, the sha256 of its weights and tokenizer) for a package."""
    from dihal.stages.lm.models import load_model, wrap_model

    if base_model is None or isinstance(base_model, (str, Path)):
        spec = export.default_base(package) if base_model is None else str(base_model)
        revision = package.config["base"].get("revision") if base_model is None else None
        loaded = load_model(spec, device, dtype, revision, trust_remote_code)  # a hub model is cached after it
        return loaded, export.spec_sha256(spec, loaded.identity.get("revision")) if check else "unchecked"
    if isinstance(base_model, LoadedModel):
        loaded = base_model
    elif isinstance(base_model, tuple) and len(base_model) == 2:
        model, tokenizer = base_model
        name = str(getattr(model, "name_or_path", ""))
        loaded = wrap_model(model.eval(), tokenizer, {"name": name, "source": "memory"})
    else:
        raise DihalError(
            "base_model: give a --model spec (a path, builtin or hub id), a LoadedModel, or (model, tokenizer)"
        )
    return loaded, export.loaded_sha256(loaded.model) if check else "unchecked"
