"""The decode loop: prefill, then draft → verify → accept → commit until a stop, with a
trace record per verify step.

KV convention (DESIGN.md): a slot's cache holds every committed token except the root
(the last emitted token). A step feeds [root] + draft at positions ctx_len.., accepts a
prefix of the draft, and commits it by advancing ctx_len past the root and the accepted
drafts; the bonus token becomes the next root. Rejected entries stay in the cache as
garbage past ctx_len and are overwritten by the next step — no recomputation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .drafters.base import Draft, Drafter
from .models.loading import Target
from .sampling import SamplingParams, sample
from .trace import RequestRecord, Step, TraceStore
from .verify import depths, tree_mask, verify
from .workloads import Prompt

STEP_FLUSH = 64  # steps buffered before they are written to the trace store


class PromptError(ValueError):
    pass


@dataclass
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # eos | stop | length
    steps: list[Step] = field(default_factory=list)
    ttft_ms: float = 0.0
    wall_s: float = 0.0

    @property
    def accept_len(self) -> float | None:
        """Tokens emitted per verify step, bonus included (the prefill token is not a step)."""
        if not self.steps:
            return None
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps)

    @property
    def accept_rate(self) -> float | None:
        proposed = sum(s.proposed for s in self.steps)
        return sum(s.accepted for s in self.steps) / proposed if proposed else None

    @property
    def tok_s(self) -> float:
        return len(self.output_ids) / self.wall_s if self.wall_s > 0 else 0.0


def encode_prompt(target: Target, prompt: Prompt | str, chat: bool = True) -> list[int]:
    """Token ids of a prompt; chat prompts go through the tokenizer's chat template."""
    tok = target.tokenizer
    if isinstance(prompt, str):
        prompt = Prompt(id="prompt", text=prompt)
    if prompt.messages is not None:
        messages = prompt.messages
        if not chat:
            raise PromptError(f"prompt {prompt.id} is a chat (messages); --no-chat needs a text prompt")
    else:
        messages = [{"role": "user", "content": prompt.text}]
    if not any((m.get("content") or "").strip() for m in messages):
        raise PromptError(f"prompt {prompt.id} is empty")
    if chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids
    return tok(prompt.text if prompt.text is not None else "\n".join(m["content"] for m in messages)).input_ids


class Engine:
    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        sampling: SamplingParams = SamplingParams(),
        store: TraceStore | None = None,
        run_id: int | None = None,
    ):
        self.target, self.model, self.drafter, self.sampling = target, target.model, drafter, sampling
        self.store, self.run_id = store, run_id
        self.device = self.model.device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(sampling.seed if sampling.seed is not None else 0)
        self.eos = target.eos_ids
        self.free_slots = list(range(self.model.num_slots))

    def generate(
        self, prompts: list[tuple[str, list[int]]], max_new_tokens: int, stop: tuple[str, ...] = ()
    ) -> list[Completion]:
        """prompts: (request id, prompt token ids). One request at a time for now; each
        holds its own slot, so batching requests later changes only this loop."""
        return [self.generate_one(rid, ids, max_new_tokens, stop) for rid, ids in prompts]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate_one(self, request_id: str, prompt_ids: list[int], max_new_tokens: int,
                     stop: tuple[str, ...] = ()) -> Completion:
        if not prompt_ids:
            raise PromptError(f"prompt {request_id} is empty")
        if max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.model.max_seq_len
        if len(prompt_ids) + 1 > limit:
            raise PromptError(
                f"prompt {request_id} has {len(prompt_ids)} tokens; the model's context here is {limit} "
                "(raise --max-seq-len up to the model's maximum, or shorten the prompt)"
            )
        slot = self.free_slots.pop(0)
        comp = Completion(request_id, list(prompt_ids))
        pending: list[Step] = []
        try:
            self._run(comp, slot, max_new_tokens, stop, pending)
            status, error = "ok", None
        except BaseException as e:
            status, error = ("cancelled" if isinstance(e, KeyboardInterrupt) else "error"), str(e)
            raise
        finally:
            self.drafter.end(request_id)
            self.model.reset_slot(slot)
            self.free_slots.append(slot)
            if self.store is not None:
                self.store.add_steps(self.run_id, request_id, pending)
                self.store.add_request(self.run_id, RequestRecord(
                    request_id=request_id, prompt_tokens=len(prompt_ids), output_tokens=len(comp.output_ids),
                    reasoning_tokens=None, ttft_ms=comp.ttft_ms, e2e_ms=comp.wall_s * 1e3,
                    status=status, error=error, prompt_ids=prompt_ids, output_ids=comp.output_ids,
                ))
        return comp

    def _run(self, comp: Completion, slot: int, max_new_tokens: int, stop, pending: list[Step]) -> None:
        model, drafter, device = self.model, self.drafter, self.device
        slots = [slot]
        self._sync()
        t0 = time.perf_counter()
        prompt = torch.tensor([comp.prompt_ids], device=device)
        logits = model(prompt, torch.arange(len(comp.prompt_ids), device=device)[None], slots, last_only=True)
        root = sample(logits[0, -1], self.sampling, self.generator)
        tp = getattr(model, "tp", None)
        if tp is not None:
            tp.take_stats()  # the prefill's collectives are not a verify step's
        comp.ttft_ms = (time.perf_counter() - t0) * 1e3
        drafter.begin(comp.request_id, comp.prompt_ids)
        drafter.observe(comp.request_id, [root])
        ctx_len = len(comp.prompt_ids)  # tokens in the cache: all committed but the root
        comp.output_ids.append(root)
        comp.finish_reason = self._finish(comp, [root], max_new_tokens, stop)
        step = 0
        while not comp.finish_reason:
            t_start = time.perf_counter()
            remaining = max_new_tokens - len(comp.output_ids)
            room = model.max_seq_len - ctx_len - 1  # cache entries left after the root
            budget = min(remaining - 1, room)
            draft = drafter.propose(comp.request_id, budget) if budget > 0 else Draft()
            t_drafted = time.perf_counter()
            n = len(draft)
            tokens = torch.tensor([[root] + draft.tokens], device=device)
            mask = tree_mask(draft, device)
            if mask is None:
                positions = torch.arange(ctx_len, ctx_len + 1 + n, device=device)[None]
            else:
                positions = torch.tensor([[ctx_len] + [ctx_len + d for d in depths(draft)]], device=device)
            logits = model(tokens, positions, slots, tree_mask=mask)
            path, bonus = verify(logits[0], draft, self.sampling, self.generator)
            accepted = len(path)
            if path != list(range(accepted)):
                # Tree nodes were stored in node order after the root; the accepted path
                # must sit at consecutive positions before the next step reads it.
                model.compact_kv(slot, torch.tensor(path, device=device) + ctx_len + 1,
                                 torch.arange(accepted, device=device) + ctx_len + 1)
            t_verified = time.perf_counter()
            emitted = [draft.tokens[i] for i in path] + [bonus]
            step_ctx = ctx_len
            ctx_len += accepted + 1
            root = bonus
            before = len(comp.output_ids)
            comp.output_ids.extend(emitted)
            comp.finish_reason = self._finish(comp, emitted, max_new_tokens, stop)
            kept = len(comp.output_ids) - before
            if kept < len(emitted):
                # Tokens cut at EOS, a stop string or the limit were never emitted: the step
                # counts, and the drafter sees, only what was kept (as a replay would).
                emitted, accepted = emitted[:kept], kept - 1
            if ctx_len + 1 > model.max_seq_len and not comp.finish_reason:
                comp.finish_reason = "length"
            drafter.observe(comp.request_id, emitted)
            t_end = time.perf_counter()
            comm = tp.take_stats() if tp is not None else None
            pending.append(Step(
                step=step, ctx_len=step_ctx, batch=1, proposed=n, accepted=accepted,
                t_draft_ms=(t_drafted - t_start) * 1e3, t_verify_ms=(t_verified - t_drafted) * 1e3,
                t_host_ms=(t_end - t_verified) * 1e3,
                comm_count=comm and comm.count, comm_bytes=comm and comm.bytes, comm_ms=comm and comm.ms,
            ))
            comp.steps.append(pending[-1])
            step += 1
            if self.store is not None and len(pending) >= STEP_FLUSH:
                self.store.add_steps(self.run_id, comp.request_id, pending)
                pending.clear()
        comp.wall_s = time.perf_counter() - t0
        comp.text = self.target.tokenizer.decode(comp.output_ids, skip_special_tokens=True)
        if comp.finish_reason == "stop":
            # The text ends before the stop string, as OpenAI-style servers return it.
            comp.text = comp.text[: min(i for i in (comp.text.find(s) for s in stop) if i >= 0)]

    def _finish(self, comp: Completion, emitted: list[int], max_new_tokens: int, stop) -> str:
        """Cuts the output at EOS or the token limit and names the reason, or returns ''."""
        out = comp.output_ids
        first_new = len(out) - len(emitted)
        for i in range(first_new, len(out)):
            if out[i] in self.eos:
                del out[i + 1 :]
                return "eos"
        if stop:
            text = self.target.tokenizer.decode(out, skip_special_tokens=True)
            if any(s in text for s in stop):
                # Keep the shortest output whose text contains a stop string.
                while len(out) > 1 and any(s in self.target.tokenizer.decode(out[:-1], skip_special_tokens=True) for s in stop):
                    out.pop()
                return "stop"
        if len(out) >= max_new_tokens:
            del out[max_new_tokens:]
            return "length"
        return ""
