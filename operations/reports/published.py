"""Published decode figures the bench's report sets beside its own: data, each with its source.

One row per published table: the card, the model, the tensor parallel size, speculative
decoding on or off, the launch and the stack it ran on, and its figures per concurrency level.
:func:`match` finds the row for what a bench served; operations/reports/bench_figures.py sets its
figure beside the level's own decode throughput.

Source of every row here: voipmonitor/rtx6kpro, models/glm5.md, "Benchmark Results" (commit
b13bf21 of 2026-03-30, "Update GLM-5 page: comprehensive benchmarks ..."; read at 29f3863):
8 x RTX PRO 6000 Blackwell, TP 8, GLM-5-NVFP4, SGLang in the page's ``voipmonitor/sglang:cu130``
image (PyTorch 2.11 cu130, CUDA 13), ``--kv-cache-dtype bf16`` (the page: "Mandatory on SM120
-- fp8_e4m3 produces garbled output"), ``--attention-backend flashinfer``. Its tables are
"Decode throughput" matrices, context length by concurrency (``ctx\\conc``), aggregate output
tok/s of decode alone; the row kept here is context 0 (a short prompt). The page names neither
its tool nor its output length; its matrices are in the layout of ``llm_decode_bench.py``, the
tool the same wiki names for its other decode matrices (benchmarks/inference-throughput/
README.md: "Benchmark tool llm_decode_bench.py", "Max tokens 512 per request";
models/kimi-k26-prometheus-benchmark-refresh-2026-04-25.md: "``llm_decode_bench.py
--skip-prefill``, 10 seconds per cell", decode tokens counted over the window from the server's
generation counters), so prefill is left out: a bench whose throughput counts prefill reads
lower (docs/bench.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

PAGE: Final = "https://github.com/voipmonitor/rtx6kpro/blob/main/models/glm5.md"
#: The page's GLM-5 checkpoints: festr2's is lukealonso's NVFP4 quantisation with the MTP layer
#: restored from the BF16 checkpoint (the page's "MTP model checkpoint"); without MTP both
#: decode with the same weights.
GLM5_NVFP4: Final = ("lukealonso/GLM-5-NVFP4", "festr2/GLM-5-NVFP4-MTP")
#: nvidia-smi's names of the card (``name``): Server, Workstation and Max-Q Editions.
RTX_PRO_6000: Final = "RTX PRO 6000 Blackwell"


@dataclass(frozen=True)
class Published:
    """One published table: ``tok_s`` per concurrency level; ``speculative`` the algorithm
    (None: off); ``card`` a piece of nvidia-smi's GPU name; ``where`` the table on its page."""

    card: str
    compute_capability: str
    models: tuple[str, ...]
    tensor_parallel_size: int
    speculative: str | None
    launch: str
    stack: str
    where: str
    tok_s: dict[int, float] = field(default_factory=dict)
    source: str = PAGE
    measured: str = ("decode throughput at context 0, prefill left out (the page's "
                     "\"Decode throughput\" matrix)")


_STACK: Final = ("SGLang in voipmonitor/sglang:cu130 (PyTorch 2.11 cu130, CUDA 13), March "
                 "2026")
_BACKENDS: Final = "--kv-cache-dtype bf16, --attention-backend flashinfer"

PUBLISHED: Final[tuple[Published, ...]] = (
    Published(
        card=RTX_PRO_6000, compute_capability="12.0", models=GLM5_NVFP4,
        tensor_parallel_size=8, speculative=None,
        launch=f"--moe-runner-backend cutlass, {_BACKENDS}, no MTP", stack=_STACK,
        where="Decode throughput - MTP OFF, 8x RTX PRO 6000, TP=8: cutlass, ctx 0",
        tok_s={1: 50.4, 2: 95.2, 4: 164.2, 8: 276.9, 16: 427.4, 32: 659.7, 64: 1010.6}),
    Published(
        card=RTX_PRO_6000, compute_capability="12.0", models=GLM5_NVFP4,
        tensor_parallel_size=8, speculative="NEXTN",
        launch=(f"--moe-runner-backend flashinfer_cutedsl (in TP only the same "
                f"cutlass_moe_fp4 kernel as cutlass, the page says), {_BACKENDS}, MTP: "
                "--speculative-algorithm NEXTN, 4 steps, 6 draft tokens, topk 1, "
                "SGLANG_ENABLE_SPEC_V2=True"), stack=_STACK,
        where=("Decode throughput - MTP ON, 8x RTX PRO 6000, TP=8 (March 2026): cutlass run 2, "
               "ctx 0 (the page's summary takes its 64-user 1425 from this run)"),
        tok_s={1: 93.7, 2: 156.9, 4: 243.9, 8: 392.4, 16: 590.1, 32: 994.5, 64: 1424.6}),
)


@dataclass(frozen=True)
class Served:
    """What a bench served, as the report matches it: the GPU's nvidia-smi name and compute
    capability, the model (a repository id, or a folder ending in one), the tensor parallel
    size and the speculative algorithm (None: off)."""

    gpu: str | None
    compute_capability: str | None
    model: str | None
    tensor_parallel_size: int | None
    speculative: str | None


def _same_model(model: str | None, models: tuple[str, ...]) -> bool:
    return model is not None and any(model == m or model.endswith("/" + m) for m in models)


def match(served: Served, concurrency: int,
          table: tuple[Published, ...] = PUBLISHED) -> tuple[Published, float] | None:
    """The published row for what was served, and its figure at ``concurrency``; None where no
    row has that card (name and compute capability), model, tensor parallel size and
    speculative decoding on or off (any algorithm's name matched as is, case aside), or no
    figure at that level."""
    wanted = (served.speculative or "").upper() or None
    for row in table:
        if (served.gpu is not None and row.card in served.gpu
                and served.compute_capability == row.compute_capability
                and _same_model(served.model, row.models)
                and served.tensor_parallel_size == row.tensor_parallel_size
                and wanted == row.speculative and concurrency in row.tok_s):
            return row, row.tok_s[concurrency]
    return None
