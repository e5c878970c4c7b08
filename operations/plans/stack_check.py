"""Planning: the stack's known behaviour (operations/plans/stack_facts.py) and the backends left to
sglang (operations/plans/sglang_choices.py), printed for each host; a certain failure refuses it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pyinfra import host, logger
from pyinfra.api import deploy

from operations.facts.gpu import NvidiaDriver
from operations.facts.host import FileText
from operations.facts.model_facts import ModelSnapshot, MtpLayerBytes, model_download
from operations.plans import memory_fit
from operations.plans.launch_profiles import report
from operations.plans.lock import LockError, read_lock
from operations.plans.model_revision import fleet_commit
from operations.plans.plan import fact, is_dry_run, refuse
from operations.plans.settings import PREFIX, Settings, profile_choice
from operations.plans.sglang import FlagError, ParserSpec, flags_named, load_parser_spec
from operations.plans.sglang_choices import left_to_sglang
from operations.plans.stack_facts import Target, applicable, brief, describe
from operations.files.model_config import (WEIGHT_INDEX, architecture, mismatch, missing_mtp,
                                           mtp_layer)


def expert_parallel(extra_args: list[str], spec: ParserSpec) -> bool:
    """Whether ``gpuhost_server_extra_args`` turn on expert parallelism
    (``--expert-parallel-size`` above 1, in any spelling argparse takes) or a MoE all-to-all
    backend other than none (``--moe-a2a-backend``): then the server is not tensor parallel
    only."""
    for i, token in enumerate(extra_args):
        if not token.startswith("--"):
            continue
        try:
            ((_, arg),) = flags_named([token], spec)
        except FlagError:
            continue  # refused with the flags while the settings were read
        _, eq, inline = token.partition("=")
        value = inline if eq else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
        if arg.flags[0] == "--expert-parallel-size" and value.strip() not in ("", "1"):
            return True
        if arg.flags[0] == "--moe-a2a-backend" and value.strip() not in ("", "none"):
            return True
    return False


def capabilities(settings: Settings) -> tuple[list[str], str]:
    """The GPUs' compute capabilities and where they come from: nvidia-smi when the driver
    answers, else host data (``gpuhost_compute_capability``)."""
    driver = fact(NvidiaDriver)
    if driver.status == "ok" and driver.gpus:
        return sorted({g.compute_capability for g in driver.gpus}), "nvidia-smi"
    return [settings.compute_capability], "gpuhost_compute_capability"


def model_architecture(config_text: str | None) -> str | None:
    """The architecture a model's ``config.json`` names (``architectures[0]``, as sglang reads
    it: ``hf_config.architectures[0]`` in server_args.py; a string taken whole,
    operations/files/model_config.py); None where there is no such file yet (the weights are
    downloaded by the server stage, whose download checks it) or it names none."""
    return None if config_text is None else architecture(config_text)[0]


def stack_line(settings: Settings, versions: Mapping[str, str], data: Mapping[str, Any]) -> str:
    """The host's CUDA stack in one line: the toolkit (gpuhost_cuda_toolkit), the lock and
    whether gpuhost_lock named it or it is the toolkit's (settings.CUDA_TOOLKITS), and the
    lock's sglang, torch and flashinfer."""
    how = (f"{PREFIX}lock" if f"{PREFIX}lock" in data
           else f"the lock of CUDA {settings.cuda_toolkit}'s stack")
    pins = ", ".join(f"{name} {versions[name]}" for name in
                     ("sglang", "torch", "flashinfer-python", "flash-attn") if name in versions)
    return (f"CUDA {settings.cuda_toolkit} ({PREFIX}cuda_toolkit: {settings.cuda_home}), lock "
            f"{settings.lock} ({how}): {pins}")


def gpu_memory_mib() -> int | None:
    """The smallest GPU's memory.total (nvidia-smi, MiB), None where the driver does not
    answer yet (a first deploy installs it)."""
    driver = fact(NvidiaDriver)
    if driver.status != "ok" or not driver.gpus:
        return None
    return min(g.memory_mib for g in driver.gpus)


def tp_choices(settings: Settings) -> tuple[int, ...]:
    """The tensor parallel sizes host data allows (settings_checks.py, _check_tensor_parallel): on
    one host the divisors of the GPUs a pipeline stage has; across nodes the one it has."""
    if settings.nodes:
        return (settings.tensor_parallel_size,)
    per_stage = settings.gpu_count // (settings.pipeline_parallel_size or 1)
    return tuple(n for n in range(1, per_stage + 1) if per_stage % n == 0)


def model_weights(settings: Settings, config_text: str | None) -> memory_fit.Weights:
    """The served checkpoint's weight bytes as read while planning (no reading of its own but
    the MTP layer's headers): the Hub's file listing where the run downloads it (ModelRoom,
    the preflight's reading), else the copy's stamp (ModelSnapshot); with MTP on and the
    weight index on the host, the MTP layer's tensors (MtpLayerBytes)."""
    if settings.model_is_local:
        return memory_fit.Weights(None, f"the weights of a local model folder ({settings.model}) "
                                        "are not counted")
    room = model_download(fact, settings, fleet_commit(settings))
    if room is not None:
        if "error" in room:
            return memory_fit.Weights(None, "the Hub's file listing was not read "
                                            f"({room['error']})")
        if room.get("weights_unsized") or "weights" not in room:
            return memory_fit.Weights(None, f"the Hub's file listing gives no size of "
                                            f"{room.get('weights_unsized', 'its')} weight "
                                            "file(s)")
        return memory_fit.Weights(room["weights"], "the Hub's file listing")
    total = fact(ModelSnapshot, path=settings.model_path).get("weight_bytes")
    if total is None:
        return memory_fit.Weights(None, "the copy's stamp holds no file sizes")
    weights = memory_fit.Weights(total, "the copy's stamp")
    layer = None if config_text is None else mtp_layer(config_text)
    if settings.speculative_algorithm is None or layer is None:
        return weights
    index = fact(FileText, path=f"{settings.model_path}/{WEIGHT_INDEX}")
    try:
        names = json.loads(index or "{}").get("weight_map") or {}
    except (ValueError, AttributeError):
        return weights
    prefix = f"model.layers.{layer}."
    shards = tuple(sorted({f for n, f in names.items() if str(n).startswith(prefix)}))
    if not shards:
        return weights  # no MTP layer: refused above
    read = fact(MtpLayerBytes, path=settings.model_path, prefix=prefix, shards=shards)
    if "error" in read:
        logger.warning(f"{host.print_prefix}Stack: the MTP layer's tensors were not read "
                       f"({read['error']})")
        return weights
    return memory_fit.Weights(total, "the copy's stamp", read["layer"], read["draft"],
                              json.loads(config_text)["num_hidden_layers"])


@deploy("Stack")
def known_behaviour(settings: Settings) -> None:
    """Name the host's launch profile (operations/plans/launch_profiles.py), its source and what it
    sets (in --dry each value with its reason). Print each row of the stack's known behaviour
    that applies to this host (the locked versions, the GPUs' compute capability, the
    settings), one line each with its source; a row that refuses takes the host out while
    planning (operations.plans.plan), naming the setting to change and its alternatives. On compute
    capability 12.x, also warn about each backend setting left ``auto`` or unset, naming what sglang
    would choose. Where the weights are already on the host, their ``config.json`` must name
    ``gpuhost_model_architecture``, and with MTP on (``gpuhost_speculative_algorithm``) their weight
    index must name the MTP layer's tensors, or the host is refused (a download checks both:
    model_fetch.py). The model's weights must fit the GPUs' memory, and with MTP on the draft's too
    (operations/plans/memory_fit.py, from :func:`model_weights` and nvidia-smi's memory.total):
    else the host is refused, naming the keys; where a figure is unknown the plan says so."""
    try:
        lock = read_lock(settings.lock_path)
    except LockError:
        return  # refused while the settings were read
    versions = lock.versions()
    logger.info(f"{host.print_prefix}Stack: {stack_line(settings, versions, host.data.dict())}")
    choice = profile_choice(host.name, host.data.dict())
    for line in report(choice.profile, choice.given, choice.passed_over, choice.sglang,
                       choice.named, whole=is_dry_run(), cuda=settings.cuda_toolkit):
        logger.info(f"{host.print_prefix}Stack: {line}")
    sglang = versions.get("sglang", "")
    try:
        ep = expert_parallel(list(settings.server_extra_args), load_parser_spec(sglang))
    except FlagError:
        ep = False
    config = f"{settings.model_path}/config.json"
    config_text = fact(FileText, path=config)
    wrong = None if config_text is None else mismatch(config_text, config,
                                                      settings.model_architecture)
    if wrong is not None:
        refuse("Stack", wrong)
    if settings.speculative_algorithm is not None and config_text is not None:
        no_mtp = missing_mtp(config_text,
                             fact(FileText, path=f"{settings.model_path}/{WEIGHT_INDEX}"),
                             settings.model_path)
        if no_mtp is not None:
            refuse("Stack", f"{PREFIX}speculative_algorithm = {settings.speculative_algorithm!r} "
                   f"is not allowed for {settings.model}: None, or a checkpoint with its MTP "
                   f"layer (for GLM-5-NVFP4: festr2/GLM-5-NVFP4-MTP): {no_mtp}")
    too_big, notes = memory_fit.model_fit(
        model_weights(settings, config_text), gpu_memory_mib(), settings.tensor_parallel_size,
        settings.pipeline_parallel_size or 1, settings.mem_fraction_static,
        settings.speculative_algorithm is not None, tp_choices(settings))
    for note in notes:
        logger.info(f"{host.print_prefix}Stack: {note}")
    if too_big is not None:
        refuse("Stack", too_big)
    found, origin = capabilities(settings)
    for capability in found:
        target = Target(versions, capability, settings, ep)
        rows = applicable(target)
        for row in rows:
            line = describe(row, target)
            if row.verdict == "refuse":
                refuse("Stack", line)
            else:  # whole in --dry; a short line on every real run, a no-op's too
                logger.warning(f"{host.print_prefix}Stack: warn: "
                               f"{line if is_dry_run() else brief(row, target)}")
        for warning in left_to_sglang(settings, capability, sglang):
            logger.warning(f"{host.print_prefix}Stack: warn: {warning}")
        logger.info(f"{host.print_prefix}Stack: compute capability {capability} (from "
                    f"{origin}), model architecture {settings.model_architecture}: "
                    f"{len(rows)} known behaviour(s) apply")
