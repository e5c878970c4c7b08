"""Whether the served model fits the GPUs' memory: a decision from figures read while planning.

sglang 0.5.9 sizes its memory this way (read from the wheel):

- ``model_executor/model_runner.py``: ``init_torch_distributed`` measures the memory free on
  each GPU (the smallest over the ranks) before the weights are loaded;
  ``model_runner_kv_cache_mixin.py``'s ``profile_max_num_token`` then gives the KV cache
  ``rest_memory = available_after_weights - free_before_weights * (1 - mem_fraction_static)``,
  and ``init_memory_pool`` raises ``Not enough memory. Please try to increase
  --mem-fraction-static`` where that leaves no token (``max_total_num_tokens <= 0``). So the
  target model's weights on one GPU and its KV cache share ``mem_fraction_static`` of the
  GPU's memory; the rest is for CUDA graphs and activations (server_args.py,
  ``_handle_gpu_memory_settings``: ``mem_fraction_static`` is "(model weights + KV cache pool)
  / GPU memory capacity").
- With NEXTN, the draft worker (``speculative/eagle_worker_v2.py``, a TpModelWorker with
  ``is_draft_worker``) is built after the target's pool: its weights, the MTP layer's tensors
  but ``embed_tokens`` and ``shared_head.head`` (shared with the target:
  ``models/deepseek_common/deepseek_weight_loader.py``), and its own KV pool of the target's
  token count for its one layer (``draft_runner_cache_size``) come out of the memory outside
  ``mem_fraction_static``. The target skips those tensors (layers from ``num_hidden_layers``
  on). The draft's weights must fit there; its KV pool is said beside them (from the KV
  cache's upper bound below, so not a certain need). When sglang picks
  ``mem_fraction_static`` itself it keeps 2 GiB more outside it for
  "eagle draft models and cuda graphs" (server_args.py); a value set in host data keeps
  nothing.

The memory here is an upper bound of what sglang finds: nvidia-smi's ``memory.total`` (the
smallest GPU's) stands for the memory free before the weights (the CUDA context and NCCL take
some). A GPU's share of the weights is a lower bound: their bytes over the ranks (tensor x
pipeline parallel size; replicated tensors make it larger), with one overcount: with MTP off
the MTP layer's tensors are not read, and count in the target's (one layer of
``num_hidden_layers``). So a refusal is a failure sglang would meet. The KV cache required is
more than nothing (sglang's own condition, above); the most it could have is said. Where a
figure is unknown (a listing without sizes, a driver not installed yet) the plan says so and
nothing is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from operations.plans.settings import PREFIX

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Weights:
    """A checkpoint's weights as read while planning, in bytes.

    + total: its ``*.safetensors`` files' bytes; None where unknown
    + source: where ``total`` was read (the Hub's file listing, the copy's stamp)
    + layer: the MTP layer's tensors (``model.layers.<num_hidden_layers>.*``, all of them:
      the target skips them); None where not read (then counted in the target's)
    + draft: of those, what the draft loads (without ``embed_tokens`` and
      ``shared_head.head``); None where unknown
    + layers: the config's ``num_hidden_layers`` (the draft's KV cache is the target's over
      its layers); None where unknown
    """

    total: int | None
    source: str
    layer: int | None = None
    draft: int | None = None
    layers: int | None = None


class Fit(NamedTuple):
    """The decision: ``problem`` (one line naming the keys, or None) and the plan's lines."""

    problem: str | None
    notes: tuple[str, ...]


def gib(n: float) -> str:
    """Bytes as a room line says them (operations/stages/venvs.py size_text): MiB below 1 GiB."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def model_fit(weights: Weights, memory_mib: int | None, tp: int, pp: int, fraction: float,
              nextn: bool, tp_choices: tuple[int, ...]) -> Fit:
    """Whether ``weights`` fit GPUs of ``memory_mib`` (nvidia-smi's memory.total, the smallest)
    at tensor parallel size ``tp``, pipeline parallel size ``pp`` and ``mem_fraction_static``
    ``fraction``, with the MTP draft where ``nextn``. ``tp_choices``: the tensor parallel sizes
    host data allows (what would fit is named among them)."""
    unchecked = "the model's fit in GPU memory is not checked while planning: "
    if memory_mib is None or memory_mib <= 0:
        return Fit(None, (unchecked + ("nvidia-smi does not answer yet" if memory_mib is None
                                       else f"nvidia-smi says {memory_mib} MiB"),))
    if weights.total is None:
        return Fit(None, (unchecked + weights.source,))
    memory = memory_mib * MIB
    target = weights.total - (weights.layer or 0)
    per_gpu = math.ceil(target / (tp * pp))
    budget = memory * fraction
    kv = budget - per_gpu
    where = (f"{memory_mib} MiB (nvidia-smi memory.total) x {PREFIX}mem_fraction_static "
             f"{fraction}")
    if kv <= 0:
        return Fit(_no_room(weights, target, per_gpu, budget, where, memory, tp, pp, fraction,
                            tp_choices), ())
    notes = [f"the model fits in GPU memory: {gib(per_gpu)} of weights a GPU ({gib(target)} "
             f"from {weights.source} over {tp * pp} rank(s)), at most {gib(kv)} left for the "
             f"KV cache of {gib(budget)} ({where})"]
    if not nextn:
        return Fit(None, tuple(notes))
    if weights.draft is None:
        notes.append("the MTP draft's fit in GPU memory is not checked while planning: its "
                     "layer's tensors were not read (the weight index is not on the host yet)")
        return Fit(None, tuple(notes))
    draft = math.ceil(weights.draft / tp)
    outside = memory * (1 - fraction)
    # the draft's KV pool: the target's token count for its one layer (an upper bound, as the
    # target's KV cache here is: said, not refused on)
    draft_kv = f", its KV cache up to {gib(kv * pp / weights.layers)} more" \
        if weights.layers else ""
    if draft < outside:
        notes.append(f"the MTP draft's weights fit: {gib(draft)} a GPU of the {gib(outside)} "
                     f"outside {PREFIX}mem_fraction_static{draft_kv}, before CUDA graphs and "
                     "activations")
        return Fit(None, tuple(notes))
    return Fit(_no_draft_room(weights, draft, draft_kv, outside, per_gpu, memory, memory_mib,
                              tp, fraction), tuple(notes))


def _no_draft_room(weights: Weights, draft: int, draft_kv: str, outside: float, per_gpu: int,
                   memory: int, memory_mib: int, tp: int, fraction: float) -> str:
    """The refusal where the MTP draft's weights do not fit outside the static fraction, with
    the largest fraction at which they do (where the target's weights still fit in it)."""
    best = math.floor((1 - draft / memory) * 1000) / 1000
    fits = (f"{PREFIX}mem_fraction_static {best:g} or less" if best * memory > per_gpu
            else f"no {PREFIX}mem_fraction_static with these weights")
    return (f"{PREFIX}speculative_algorithm = 'NEXTN' with {PREFIX}mem_fraction_static = "
            f"{fraction} does not fit the MTP draft in GPU memory: {gib(draft)} a GPU needed "
            f"outside the static fraction ({gib(weights.draft)} of the MTP layer's tensors over "
            f"tensor parallel size {tp}{draft_kv}), {gib(outside)} there ({memory_mib} MiB x "
            f"(1 - {fraction})), before CUDA graphs and activations: fits with {fits}, or "
            f"{PREFIX}speculative_algorithm = None")


def _no_room(weights: Weights, target: int, per_gpu: int, budget: float, where: str,
             memory: int, tp: int, pp: int, fraction: float, tp_choices: tuple[int, ...]) -> str:
    """The refusal where the target's weights leave no KV cache, with what would fit."""
    fitting = [n for n in sorted(tp_choices) if n > tp and math.ceil(target / (n * pp)) < budget]
    least = per_gpu / memory
    fits = []
    if fitting:
        fits.append(f"{PREFIX}tensor_parallel_size {fitting[0]} "
                    f"({gib(math.ceil(target / (fitting[0] * pp)))} a GPU)")
    if least < 1:
        fits.append(f"{PREFIX}mem_fraction_static {math.floor(least * 1000 + 1) / 1000:.3f} "
                    "or more (leaving less for CUDA graphs and activations)")
    what = (" or ".join(fits) if fits else
            f"nothing on these GPUs: more of them ({PREFIX}nodes) or a smaller checkpoint")
    stages = f", {PREFIX}pipeline_parallel_size = {pp}" if pp > 1 else ""
    return (f"{PREFIX}tensor_parallel_size = {tp}{stages} and {PREFIX}mem_fraction_static = "
            f"{fraction} do not fit the model's weights in GPU memory: {gib(per_gpu)} a GPU "
            f"needed ({gib(target)} from {weights.source} over {tp * pp} rank(s)) and a KV "
            f"cache beside them, {gib(budget)} available ({where}): fits with {what}")
