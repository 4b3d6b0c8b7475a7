"""The hybrid of docs/method.md section 3 as a `transformers` causal LM (`dihal.load_hybrid`), so the tools
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

generate() is the hybrid's own cached loop (stages/generate.py, the one `dihal generate` runs), behind
GenerationMixin's usual arguments; it is not transformers' generation loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from dihal.artifacts.errors import DihalError
from dihal.stages import generate as gen_stage
from dihal.stages.configs import GenerateConfig
from dihal.stages.lm.capture import hidden_states
from dihal.stages.lm.hybrid import lm_logits, suffix_model
from dihal.stages.lm.models import LoadedModel
from dihal.stages.lm.tokens import start_token
from dihal.stages.parts.bridge import Bridge
from dihal.stages.runtime.progress import NullProgress

STEPS = GenerateConfig.sample_steps  # the bridge's Euler steps, as `dihal generate` takes them


class HybridConfig(PretrainedConfig):
    model_type = "dihal_hybrid"

    def __init__(self, bridge: str = "", layer: int = 0, steps: int = STEPS, seed: int = 0, **kwargs):
        self.bridge, self.layer, self.steps, self.seed = bridge, layer, steps, seed
        super().__init__(**kwargs)


@dataclass
class Generation:
    """What hybrid.generate(prompts) returns: one text and its new token ids per sample (cut at EOS)."""

    prompts: list[str]
    texts: list[str]
    token_ids: list[list[int]]


class HybridForCausalLM(PreTrainedModel, GenerationMixin):
    """A loaded backbone and a trained bridge at its layer l. Built by dihal.load_hybrid, not from_pretrained."""

    config_class = HybridConfig
    base_model_prefix = "hybrid"
    main_input_name = "input_ids"

    def __init__(self, loaded: LoadedModel, bridge: Bridge, bridge_id: str, steps: int = STEPS, seed: int = 0):
        backbone = loaded.model.config
        config = HybridConfig(
            bridge=bridge_id,
            layer=bridge.layer,
            steps=steps,
            seed=seed,
            vocab_size=backbone.vocab_size,
            hidden_size=backbone.hidden_size,
            max_position_embeddings=bridge.net.cfg.max_len + bridge.start,  # beyond, the bridge has no position
            bos_token_id=loaded.tokenizer.bos_token_id,
            eos_token_id=loaded.tokenizer.eos_token_id,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
        super().__init__(config)
        self.backbone, self.denoiser = loaded.model, bridge.net  # registered, so .to() and .device see them
        self.loaded, self.bridge, self.tokenizer = loaded, bridge, loaded.tokenizer
        self.suffix = suffix_model(loaded.model, bridge.layer)
        self.start_id = start_token(loaded.tokenizer)[0]
        noise = bridge.noise(1, config.max_position_embeddings, torch.Generator().manual_seed(seed))[0]
        self.register_buffer("noise", noise, persistent=False)

    @classmethod
    def from_bridge(cls, art, device: str, dtype: str, steps: int = STEPS, seed: int = 0, trust_remote_code=False):
        """The hybrid of a bridge artifact: its backbone loaded as its extract was made (load_model checks
        that the device runs the dtype), the bridge on the same device."""
        from dihal.stages.lineage import backbone_for

        loaded = backbone_for(art, device, dtype, trust_remote_code)
        return cls(loaded, Bridge.load(art, loaded.device), art.id, steps, seed)

    @property
    def positions(self) -> int:
        return self.config.max_position_embeddings

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def get_output_embeddings(self):
        return self.backbone.get_output_embeddings()

    def _init_weights(self, module):  # every weight is trained already: nothing is initialised
        pass

    # -- the teacher-forced forward ----------------------------------------------------------------------
    @torch.no_grad()
    def layer_states(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) ids and their 0/1 mask -> (B, T, D) float32 bridge states at layer l (zeros at pads)."""
        b, t = input_ids.shape
        h0 = hidden_states(self.backbone, input_ids, [0])[0].float()
        out = torch.zeros(b, t, self.config.hidden_size, device=h0.device)
        spans = [mask[r].nonzero()[:, 0] for r in range(b)]
        for length in sorted({len(s) for s in spans} - {0}):
            rows = [r for r in range(b) if len(spans[r]) == length]
            idx = torch.stack([spans[r] for r in rows])  # (n, length) real columns of each row
            cond = torch.stack([h0[r, spans[r]] for r in rows])
            noise = self.noise[: length - self.bridge.start].expand(len(rows), -1, -1)
            states = self.bridge.sample(cond, self.config.steps, noise)
            if self.bridge.start == 1:  # position 0: the exact state of the row's first token
                first = torch.stack([input_ids[r, spans[r][0]] for r in rows])
                other = first != self.start_id
                if other.any():
                    exact = hidden_states(self.backbone, first[other][:, None], [self.bridge.layer])[self.bridge.layer]
                    states[other, 0] = exact[:, 0].float()
            for k, r in enumerate(rows):
                out[r, idx[k]] = states[k]
        return out

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **unused,
    ) -> CausalLMOutputWithPast:
        """Teacher-forced float32 logits (B, T, V), and the mean next-token loss where labels are given
        (-100 ignored, shifted as transformers' causal LMs do)."""
        if input_ids is None or input_ids.dim() != 2:
            raise DihalError("the hybrid reads input_ids of shape (batch, tokens); pass token ids, not embeddings")
        mask = self._mask(input_ids, attention_mask)
        if input_ids.shape[1] > self.positions:
            raise DihalError(
                f"{input_ids.shape[1]} tokens, but the bridge covers {self.positions} positions (its extract's "
                "--seq-len); pass shorter rows (lm-eval: max_length)"
            )
        input_ids = input_ids.to(self.device)
        states = self.layer_states(input_ids, mask)
        position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            hidden = self.suffix.model(
                inputs_embeds=states.to(self.backbone.dtype),
                attention_mask=mask.long(),
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state
            logits = lm_logits(self.backbone, hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).to(logits.device)
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

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

    # -- generation: the hybrid's own cached loop -------------------------------------------------------------
    def generate(
        self,
        inputs: str | list[str] | torch.Tensor | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int = 0,
        num_samples: int = 1,
        batch_size: int = GenerateConfig.batch_size,
        **unused,
    ) -> Generation | torch.Tensor:
        """Prompts (a string or a list) -> Generation, the samples `dihal generate --prompt ... --seed` writes
        (num_samples per prompt, in batches of batch_size); token ids (B, T) -> (B, T + new) ids, as
        GenerationMixin returns them (do_sample=False: greedy; each row its own prompt, new tokens after
        EOS set to the pad id)."""
        ids = input_ids if input_ids is not None else inputs
        if isinstance(ids, torch.Tensor):
            new = max_new_tokens or (max_length - ids.shape[1] if max_length else GenerateConfig.max_new_tokens)
            return self._generate_ids(ids, attention_mask, new, do_sample, temperature, top_p, top_k, seed)
        prompts = [ids] if isinstance(ids, str) else list(ids or [""])
        cfg = self._config(prompts, max_new_tokens, temperature, top_p, top_k, seed, num_samples, batch_size)
        gen_stage.check_length(self.tokenizer, self.bridge, cfg)
        rows = gen_stage.generate_all(self.loaded, self.bridge, cfg, NullProgress())
        return Generation([r["prompt"] for r in rows], [r["text"] for r in rows], [r["token_ids"] for r in rows])

    def _config(self, prompts, max_new_tokens, temperature, top_p, top_k, seed, num_samples, batch_size):
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

    def _generate_ids(self, ids, attention_mask, new, do_sample, temperature, top_p, top_k, seed) -> torch.Tensor:
        greedy = do_sample is False or (do_sample is None and temperature is None)
        cfg = self._config([""], new, 0.0 if greedy else temperature, top_p, top_k, seed, 1, 1)
        mask = self._mask(ids, attention_mask)
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else self.config.eos_token_id
        rows = []
        for r in range(ids.shape[0]):
            prefix = ids[r][mask[r].to(ids.device)][None].to(self.device)
            if prefix.shape[1] + new - 1 > self.positions:
                raise DihalError(
                    f"a prompt of {prefix.shape[1]} tokens plus {new} new ones needs {prefix.shape[1] + new - 1} "
                    f"positions, but the bridge covers {self.positions}; ask for fewer new tokens"
                )
            gen = torch.Generator().manual_seed(seed * 1_000_003 + r)
            out = gen_stage.generate_hybrid(self.loaded, self.bridge, self.suffix, prefix, cfg, gen)[0]
            eos = (out == self.config.eos_token_id).nonzero()
            if len(eos):
                out[int(eos[0]) + 1 :] = pad
            rows.append(out)
        return torch.cat([ids.to(self.device), torch.stack(rows)], dim=1)
