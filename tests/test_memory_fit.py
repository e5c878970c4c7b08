"""The served model against the GPUs' memory, decided while planning
(operations/plans/memory_fit.py): the weights over the ranks inside mem_fraction_static with room
left for a KV cache, the MTP draft outside it, refused in one line naming the keys; unknown sizes
said, never refused. The figures read for it: the Hub's listing (ModelRoom), the copy's stamp
(ModelSnapshot) and the MTP layer's safetensors headers (MtpLayerBytes), as the Stack stage gathers
them."""

from __future__ import annotations

import json
import subprocess

import pytest

from operations.facts.model_facts import MtpLayerBytes, ModelSnapshot
from operations.plans import stack_check
from operations.plans.memory_fit import GIB, Weights
from operations.plans.memory_fit import model_fit as check
from operations.plans.settings import Settings
from operations.files.model_config import WEIGHT_INDEX
from sandbox import hub

#: The reference lab's GPUs: nvidia-smi's memory.total of an RTX PRO 6000 (reference-lab.md).
RTX_PRO_6000_MIB = 97887
TP_CHOICES = (1, 2, 4, 8)


def test_weights_over_the_ranks_with_room_for_a_kv_cache_fit():
    fit = check(Weights(400 * GIB, "the Hub's file listing"), RTX_PRO_6000_MIB, 8, 1, 0.92,
                False, TP_CHOICES)
    assert fit.problem is None
    # 50 GiB a GPU of 87.9 GiB (97887 MiB x 0.92): 37.9 GiB left for the KV cache
    assert fit.notes == ("the model fits in GPU memory: 50.0 GiB of weights a GPU (400.0 GiB "
                         "from the Hub's file listing over 8 rank(s)), at most 37.9 GiB left "
                         "for the KV cache of 87.9 GiB (97887 MiB (nvidia-smi memory.total) x "
                         "gpuhost_mem_fraction_static 0.92)",)


def test_weights_that_leave_no_kv_cache_are_refused_naming_the_keys_and_what_fits():
    fit = check(Weights(400 * GIB, "the Hub's file listing"), RTX_PRO_6000_MIB, 2, 1, 0.92,
                False, TP_CHOICES)
    assert fit.problem == (
        "gpuhost_tensor_parallel_size = 2 and gpuhost_mem_fraction_static = 0.92 do not fit the "
        "model's weights in GPU memory: 200.0 GiB a GPU needed (400.0 GiB from the Hub's file "
        "listing over 2 rank(s)) and a KV cache beside them, 87.9 GiB available (97887 MiB "
        "(nvidia-smi memory.total) x gpuhost_mem_fraction_static 0.92): fits with "
        "gpuhost_tensor_parallel_size 8 (50.0 GiB a GPU)")
    # weights that fill the fraction exactly leave no KV cache: sglang's "Not enough memory"
    exact = check(Weights(int(RTX_PRO_6000_MIB * 2**20 * 0.5) * 8, "s"), RTX_PRO_6000_MIB, 8,
                  1, 0.5, False, TP_CHOICES)
    assert exact.problem.startswith("gpuhost_tensor_parallel_size = 8 and "
                                    "gpuhost_mem_fraction_static = 0.5 do not fit")
    assert exact.problem.endswith("fits with gpuhost_mem_fraction_static 0.501 or more "
                                  "(leaving less for CUDA graphs and activations)")


def test_pipeline_stages_divide_the_weights_too_and_nothing_fitting_is_said():
    fit = check(Weights(2000 * GIB, "the copy's stamp"), RTX_PRO_6000_MIB, 4, 2, 0.92, False,
                (1, 2, 4))
    assert fit.problem.startswith(
        "gpuhost_tensor_parallel_size = 4, gpuhost_pipeline_parallel_size = 2 and "
        "gpuhost_mem_fraction_static = 0.92 do not fit the model's weights in GPU memory: "
        "250.0 GiB a GPU needed (2000.0 GiB from the copy's stamp over 8 rank(s))")
    assert fit.problem.endswith("fits with nothing on these GPUs: more of them (gpuhost_nodes) "
                                "or a smaller checkpoint")


def test_the_mtp_draft_outside_the_fraction_tips_it_over():
    # a 78-layer checkpoint whose MTP layer holds 6 GiB the draft loads (numbers of this test)
    weights = Weights(406 * GIB, "the copy's stamp", layer=6 * GIB, draft=6 * GIB, layers=78)
    off = check(weights, RTX_PRO_6000_MIB, 8, 1, 0.995, False, TP_CHOICES)
    assert off.problem is None  # the target alone fits at 0.995
    on = check(weights, RTX_PRO_6000_MIB, 8, 1, 0.995, True, TP_CHOICES)
    assert on.problem.startswith(
        "gpuhost_speculative_algorithm = 'NEXTN' with gpuhost_mem_fraction_static = 0.995 does "
        "not fit the MTP draft in GPU memory: 768.0 MiB a GPU needed outside the static "
        "fraction (6.0 GiB of the MTP layer's tensors over tensor parallel size 8, its KV cache "
        "up to 592.3 MiB more), 489.4 MiB there (97887 MiB x (1 - 0.995)), before CUDA graphs and "
        "activations: fits with gpuhost_mem_fraction_static 0.992 or less, or "
        "gpuhost_speculative_algorithm = None")
    # at the fraction it names, the draft's weights fit
    fits = check(weights, RTX_PRO_6000_MIB, 8, 1, 0.992, True, TP_CHOICES)
    assert fits.problem is None and fits.notes[1].startswith("the MTP draft's weights fit: ")
    # the target does not count the MTP layer's tensors: it skips them
    assert "50.0 GiB of weights a GPU (400.0 GiB" in fits.notes[0]


@pytest.mark.parametrize(("weights", "memory", "said"), [
    (Weights(None, "the Hub's file listing gives no size of 3 weight file(s)"), 97887,
     "not checked while planning: the Hub's file listing gives no size of 3 weight file(s)"),
    (Weights(400 * GIB, "the Hub's file listing"), None,
     "not checked while planning: nvidia-smi does not answer yet"),
])
def test_unknown_sizes_are_said_and_never_refused(weights, memory, said):
    fit = check(weights, memory, 1, 1, 0.92, True, TP_CHOICES)
    assert fit.problem is None and said in fit.notes[0]


def test_the_draft_not_read_yet_is_said():
    fit = check(Weights(400 * GIB, "the Hub's file listing"), RTX_PRO_6000_MIB, 8, 1, 0.92,
                True, TP_CHOICES)
    assert fit.problem is None
    assert fit.notes[1].startswith("the MTP draft's fit in GPU memory is not checked")


def _write(folder, files):
    for f in files:
        (folder / f.path).write_bytes(f.data)


def test_the_mtp_layer_is_read_from_the_headers_of_the_shards_the_index_names(tmp_path):
    _write(tmp_path, hub.repository(mtp=True))
    # a shard holding the MTP layer's embed_tokens too: the target's, not loaded by the draft
    (tmp_path / "embed.safetensors").write_bytes(
        hub._safetensors("model.layers.2.embed_tokens.weight", 4096))
    shards = ("model-00003-of-00003.safetensors", "embed.safetensors")
    run = subprocess.run(["sh", "-c", MtpLayerBytes().command(str(tmp_path), "model.layers.2.",
                                                              shards)],
                         capture_output=True, text=True, check=True)
    assert MtpLayerBytes().process(run.stdout.splitlines()) == {
        "layer": hub.SHARD_BYTES + 4096, "draft": hub.SHARD_BYTES}
    bad = subprocess.run(["sh", "-c", MtpLayerBytes().command(str(tmp_path), "model.layers.2.",
                                                              ("absent.safetensors",))],
                         capture_output=True, text=True, check=True)
    assert MtpLayerBytes().process(bad.stdout.splitlines())["error"].startswith(
        "FileNotFoundError")


def test_the_stamp_counts_the_weight_files(tmp_path):
    (tmp_path / ".gpuhost-model.json").write_text(json.dumps({
        "repo": "org/m", "revision": "main", "sha": "abc",
        "files": {"config.json": 10, "a.safetensors": 100, "b.safetensors": 23}}))
    run = subprocess.run(["sh", "-c", ModelSnapshot().command(str(tmp_path))],
                         capture_output=True, text=True, check=True)
    assert ModelSnapshot().process(run.stdout.splitlines())["weight_bytes"] == 123


def _gathered(monkeypatch, facts, **settings):
    monkeypatch.setattr(stack_check, "fact", lambda cls, **kw: facts[cls.__name__])
    s = Settings(model="gpuhost-sandbox/tiny-glm-5-mtp", **settings)
    config = next(f.data.decode() for f in hub.repository(mtp=True) if f.path == "config.json")
    return stack_check.model_weights(s, config)


def test_the_sandbox_reference_lab_fits_from_what_planning_reads(monkeypatch):
    """The sandbox hub's stand-in checkpoint on the reference lab's 8 GPUs at its 0.92: the
    Hub's listing before the download, the stamp and the MTP layer's headers after it."""
    repo = hub.repository(mtp=True)
    shards = sum(len(f.data) for f in repo if f.path.endswith(".safetensors"))
    listed = _gathered(monkeypatch, {"ModelSnapshot": {}, "ModelRoom": {
        "need": 1, "free": 1, "weights": shards, "weights_unsized": 0}},
        speculative_algorithm="NEXTN")
    assert listed == Weights(shards, "the Hub's file listing")
    index = next(f.data.decode() for f in repo if f.path == WEIGHT_INDEX)
    stamped = _gathered(monkeypatch, {
        "ModelSnapshot": {"repo": "gpuhost-sandbox/tiny-glm-5-mtp", "revision": "main",
                          "complete": True, "weight_bytes": shards},
        "FileText": index, "MtpLayerBytes": {"layer": 4096, "draft": 2048}},
        speculative_algorithm="NEXTN")
    assert stamped == Weights(shards, "the copy's stamp", 4096, 2048, 2)
    for weights in (listed, stamped):
        fit = check(weights, RTX_PRO_6000_MIB, 8, 1, 0.92, True, TP_CHOICES)
        assert fit.problem is None


def test_a_listing_without_sizes_is_unknown(monkeypatch):
    weights = _gathered(monkeypatch, {"ModelSnapshot": {}, "ModelRoom": {
        "need": 1, "free": 1, "weights": 0, "weights_unsized": 2}})
    assert weights == Weights(None, "the Hub's file listing gives no size of 2 weight file(s)")
    older = _gathered(monkeypatch, {"ModelSnapshot": {}, "ModelRoom": {"need": 1, "free": 1}})
    assert older.total is None
    unread = _gathered(monkeypatch, {"ModelSnapshot": {}, "ModelRoom": {"error": "URLError x"}})
    assert unread.total is None and "was not read (URLError x)" in unread.source


def test_a_fraction_is_said_as_given():
    """0.9999999 is not "1": the line says the value host data holds."""
    weights = Weights(3 * hub.SHARD_BYTES, "the copy's stamp", hub.SHARD_BYTES, hub.SHARD_BYTES, 2)
    fit = check(weights, RTX_PRO_6000_MIB, 8, 1, 0.9999999, True, TP_CHOICES)
    assert fit.problem.startswith("gpuhost_speculative_algorithm = 'NEXTN' with "
                                  "gpuhost_mem_fraction_static = 0.9999999 does not fit")
    assert "fits with gpuhost_mem_fraction_static 0.999 or less" in fit.problem


def test_what_fits_is_rounded_up_past_the_value_given_and_no_memory_is_unchecked():
    """The fraction named is one that fits (weights of 0.8504 of a GPU: 0.851, never "above
    0.850", which 0.8502 would meet without fitting); a GPU
    nvidia-smi says has 0 MiB gets the fit unchecked, said, not a ZeroDivisionError (the
    breaker's findings of 2026-12-07)."""
    tight = check(Weights(int(RTX_PRO_6000_MIB * 2**20 * 0.8504) * 8, "s"), RTX_PRO_6000_MIB, 8,
                  1, 0.85, False, (8,))
    assert "fits with gpuhost_mem_fraction_static 0.851 or more" in tight.problem
    for memory in (0, -1):
        none = check(Weights(400 * 2**30, "s"), memory, 8, 1, 0.85, False, TP_CHOICES)
        assert none.problem is None
        assert none.notes == ("the model's fit in GPU memory is not checked while planning: "
                              f"nvidia-smi says {memory} MiB",)
