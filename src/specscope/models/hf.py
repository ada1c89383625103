"""The transformers fallback backend: any AutoModelForCausalLM architecture behind the
native model's forward interface. Slow (dynamic cache, eager), but it runs models the
native backend does not implement. Rollback crops the slot's DynamicCache."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache


class HFModel(torch.nn.Module):
    def __init__(self, hf_model, num_slots: int, max_seq_len: int):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.caches: list[DynamicCache | None] = [None] * num_slots

    @classmethod
    def build(cls, config, state, dtype, device, seed, num_slots, max_seq_len):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
        if state is not None:
            missing, unexpected = hf.load_state_dict(state, strict=False)
            # Tied heads have no lm_head tensor in the checkpoint.
            missing = [m for m in missing if m != "lm_head.weight" or not config.tie_word_embeddings]
            if missing or unexpected:
                raise ValueError(f"checkpoint does not fit {type(hf).__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}")
            if getattr(config, "tie_word_embeddings", False):
                hf.tie_weights()
        return cls(hf, num_slots, max_seq_len)

    @property
    def device(self):
        return self.hf.device

    @property
    def dtype(self):
        return self.hf.dtype

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    def reset_slot(self, slot: int) -> None:
        self.caches[slot] = None

    @torch.inference_mode()
    def forward(self, tokens, positions, slots, tree_mask=None, taps=None, last_only=False):
        if tree_mask is not None:
            raise ValueError("tree drafts need the native backend (--backend native); the hf backend verifies chains only")
        slots = slots.tolist() if torch.is_tensor(slots) else list(slots)
        if len(slots) != 1:
            raise ValueError("the hf backend runs one request at a time (batch 1)")
        slot = slots[0]
        start = int(positions[0, 0])
        if start + tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"context of {start + tokens.shape[1]} tokens exceeds the cache ({self.max_seq_len})")
        cache = self.caches[slot]
        if cache is None or start == 0:
            cache = self.caches[slot] = DynamicCache(config=self.config)
        stale = cache.get_seq_length() - start
        if stale > 0:
            cache.crop(-stale)  # negative: number of tokens to drop (all transformers 5.x)
        elif stale < 0:
            raise ValueError(f"slot {slot} holds {cache.get_seq_length()} tokens; cannot continue at position {start}")
        out = self.hf(
            input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True,
            output_hidden_states=bool(taps), logits_to_keep=1 if last_only else 0,
        )
        logits = out.logits.float()
        if taps:
            return logits, [out.hidden_states[i + 1] for i in taps]
        return logits
