"""`eval/tau_sim`: acceptance length predicted from the held-out responses, without the target's
verify passes.

The held-out responses were written by the target itself (greedy), so along a response the
draft-verify loop of decode/loop.py would see exactly these tokens: the target's greedy
choice at position p is the data token at p. Replaying the loop on the data gives the loop's
acceptance with no target forward beyond one tapped pass over each held-out sequence (computed
once, then cached):

    pos = P (the first response token: the prefill's output, slot 0 of the first block)
    each cycle: block [ids[pos], MASK x q-1], q = min(block_size, tokens left + 1), over the
                context features < pos; drafts d_1..d_q-1 (argmax, as the decode loop drafts);
                a = leading k with d_k == ids[pos+k]; produced = min(a + 1, tokens left),
                cut after a stop id among the produced tokens; pos += produced

Per response tau = mean produced per cycle; the figure is the mean over responses with at least
one cycle: the aggregation of measured tau (eval/metrics.py), with the same max_new_tokens
clipping and stop ids. It differs from measured tau only where the data are not the target's
greedy output in the evaluation dtype (text re-tokenised, another dtype at generation time,
responses cut at data.max_length or the generation limit: a response that runs out of data ends
at its last known token).

Unlike `drafter/accept_len` (an average over anchor positions of the last training batch, in
sample after the first epoch), this is measured on held-out responses and aggregated per cycle,
then per response, so it predicts what serving measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash_trainer.decode.draft import Drafter, accepted, commit, draft_block
from dflash_trainer.models.target import TargetModel
from dflash_trainer.observe.progress import showing_progress


@dataclass
class SimResult:
    tau: float  # mean over responses of mean tokens per cycle
    per_response: list[float]  # per response with at least one cycle
    acceptance_lengths: list[list[int]]  # per response, per cycle
    cycles: int
    keys: list[str]  # per response: its example key (acceptance_lengths' order)


def mean_tau(acceptance_lengths: Sequence[Sequence[int]]) -> float:
    """Mean over responses with at least one cycle of mean tokens per cycle (1.0 if none): the
    aggregation of measured tau (eval/metrics.py)."""
    per = [sum(x) / len(x) for x in acceptance_lengths if x]
    return sum(per) / len(per) if per else 1.0


@torch.no_grad()
def simulate_response(
    drafter: Drafter,
    embed_weight: torch.Tensor,
    lm_head: nn.Module,
    features: torch.Tensor,
    ids: Sequence[int],
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    stop_ids: Sequence[int] = (),
) -> list[int]:
    """Tokens committed per cycle along one response. `features` [1, S, n*H] are the tapped
    target features of `ids` (length S); `ids[prompt_len:]` is the response. Each cycle is the
    decode loop's draft-and-accept step (decode/draft.py) with the data as the target's
    choices."""
    stop = set(int(s) for s in stop_ids)
    end = len(ids)
    if prompt_len >= end or max_new_tokens <= 0 or ids[prompt_len] in stop:
        return []  # the decode loop: the prefill's token ends it, no cycle runs
    cache = drafter.new_cache()
    pos, committed, out = prompt_len, 1, []
    while committed < max_new_tokens:
        remaining = max_new_tokens - committed
        q = min(block_size, remaining + 1)
        a = 0
        if q > 1:
            last = torch.tensor([int(ids[pos])], device=features.device)
            ctx = features[:, cache.length : pos]
            block = draft_block(drafter, embed_weight, lm_head, last, pos, ctx, cache, q, q - 1)
            a = accepted(block[0, 1:].tolist(), list(ids[pos + 1 : pos + q]))
        if pos + 1 + a >= end:  # the data end here: no label for the bonus token
            if min(a, remaining) > 0:
                out.append(min(a, remaining))
            break
        new, stopped = commit(list(ids[pos + 1 : pos + 2 + a]), remaining, stop)
        out.append(len(new))
        committed += len(new)
        pos += len(new)
        if stopped:
            break
    return out


class TauSim:
    """tau_sim over a fixed set of held-out sequences; target features computed once, cached.

    `target`: the TargetModel evaluation decodes with (its dtype is the features').
    `examples`: (key, full token ids, prompt length) per held-out response.
    """

    def __init__(self, target: TargetModel, examples: Sequence[tuple[str, Sequence[int], int]]):
        self.target = target
        self.examples = [(k, list(map(int, ids)), int(p)) for k, ids, p in examples]
        self._features: dict[str, torch.Tensor] = {}

    def features(self, key: str, ids: list[int]) -> torch.Tensor:
        """[1, S, n*H] on the target's device. Cached in host memory on GPU (a long held-out
        set of a large target would not fit beside it), on the device otherwise."""
        device = self.target.device
        f = self._features.get(key)
        if f is None:
            t = torch.tensor([ids], dtype=torch.long, device=device)
            f = self.target.features(t)
            self._features[key] = f.cpu() if device.type == "cuda" else f
        return f.to(device, non_blocking=True)

    @torch.no_grad()
    def run(
        self,
        drafter,
        max_new_tokens: int,
        block_size: int,
        keys: Sequence[str] | None = None,
        progress: bool = True,
    ) -> SimResult:
        """Replay every example (those in `keys` when given). `progress`: a bar over the
        replayed prompts (observe/progress.py; drawn only when stderr is a terminal)."""
        drafter = getattr(drafter, "module", drafter)
        wanted = None if keys is None else set(keys)
        todo = [e for e in self.examples if wanted is None or e[0] in wanted]
        was = drafter.training
        drafter.eval()
        try:
            lens = []
            with showing_progress(
                len(todo), desc="tau_sim", unit="prompt", enabled=progress
            ) as bar:
                for key, ids, p in todo:
                    lens.append(
                        simulate_response(
                            drafter,
                            self.target.embed_weight,
                            self.target.lm_head,
                            self.features(key, ids),
                            ids,
                            p,
                            max_new_tokens,
                            block_size,
                            self.target.eos_token_ids,
                        )
                    )
                    bar.update(1)
        finally:
            drafter.train(was)
        return SimResult(
            tau=mean_tau(lens),
            per_response=[sum(x) / len(x) for x in lens if x],
            acceptance_lengths=lens,
            cycles=sum(len(x) for x in lens),
            keys=[key for key, _, _ in todo],
        )
