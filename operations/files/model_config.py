"""The architecture a model's config.json names, as sglang reads it (standard library only).

sglang 0.5.9 takes the model's architecture from ``hf_config.architectures[0]``
(sglang/srt/server_args.py), the list transformers writes under ``"architectures"``
(PretrainedConfig.to_dict; GLM-5's config.json: ``"architectures": ["GlmMoeDsaForCausalLM"]``).
Used by the Stack stage on the controller (operations/plans/stack_check.py) and shipped beside
model_fetch.py, which checks a download against ``gpuhost_model_architecture`` before the
server stage writes the unit.
"""

from __future__ import annotations

import json


def architecture(text: str) -> tuple[str | None, str]:
    """The architecture ``text`` (a config.json) names and how it was read: ``(name, "")``
    from a list's first entry; ``(name, note)`` from a string (a one-architecture config
    written by hand; transformers writes a list); ``(None, why)`` where the file is no JSON
    object or ``"architectures"`` is missing, empty or of another type."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        return None, f"is not JSON ({exc})"
    if not isinstance(data, dict):
        return None, "is not a JSON object"
    names = data.get("architectures")
    if names is None:
        return None, 'has no "architectures"'
    if isinstance(names, str):
        if not names:
            return None, 'has an empty "architectures"'
        return names, '"architectures" is a string, not a list as transformers writes it'
    if not isinstance(names, list):
        return None, f'has "architectures" of type {type(names).__name__}, not a list'
    if not names:
        return None, 'has an empty "architectures" list'
    if not isinstance(names[0], str) or not names[0]:
        return None, f'has "architectures"[0] = {names[0]!r}, not a name'
    return names[0], ""


def mismatch(text: str, path: str, wanted: str) -> str | None:
    """Why the config.json at ``path`` (its ``text``) does not fit host data's
    ``gpuhost_model_architecture = wanted``, naming the key and both values; None when it
    names ``wanted``. A config.json that names no architecture is a mismatch too: sglang
    0.5.9 cannot serve it (server_args.py indexes ``hf_config.architectures[0]``;
    models/registry.py's ModelRegistry.resolve_model_cls raises "Model architectures [] are
    not supported for now")."""
    named, note = architecture(text)
    if named is None:
        return (f"the model's {path} {note}: sglang reads the architecture from its "
                f"architectures[0]; host data says gpuhost_model_architecture = {wanted!r}")
    if named == wanted:
        return None
    how = f" ({note})" if note else ""
    return (f"the model's {path} names the architecture {named}{how}, host data says "
            f"gpuhost_model_architecture = {wanted!r}: set it to {named!r}, which the known "
            "behaviour is matched against")


#: The weight index of a sharded safetensors checkpoint (transformers' SAFE_WEIGHTS_INDEX_NAME).
WEIGHT_INDEX = "model.safetensors.index.json"


def mtp_layer(config_text: str) -> int | None:
    """The index of the MTP (NextN) layer sglang loads from a checkpoint with this config.json:
    ``num_hidden_layers``, or 0 for a one-layer model; None where the config has no single
    NextN layer. sglang 0.5.9's sglang/srt/models/deepseek_common/deepseek_weight_loader.py
    (GLM-5's GlmMoeDsaForCausalLM is a DeepseekV2ForCausalLM): ``num_nextn_predict_layers``
    must be 1, ``nextn_layer_id = 0 if num_hidden_layers == 1 else num_hidden_layers``, its
    tensors named ``model.layers.<nextn_layer_id>.*``."""
    try:
        data = json.loads(config_text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("num_nextn_predict_layers") != 1:
        return None
    layers = data.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        return None
    return 0 if layers == 1 else layers


def missing_mtp(config_text: str, index_text: str | None, where: str) -> str | None:
    """Why the checkpoint in folder ``where`` cannot serve MTP (NEXTN): its config.json names
    no single NextN layer, it has no weight index, or the index's ``weight_map`` names no
    tensor of that layer (a quantized checkpoint can drop them while its config still names
    ``num_nextn_predict_layers``: voipmonitor/rtx6kpro models/glm5.md, lukealonso/GLM-5-NVFP4
    against festr2/GLM-5-NVFP4-MTP). None when it has the layer."""
    layer = mtp_layer(config_text)
    if layer is None:
        return (f"{where}/config.json names no MTP layer (num_nextn_predict_layers 1 and "
                "num_hidden_layers, as sglang loads it)")
    if index_text is None:
        return f"{where} has no {WEIGHT_INDEX} to read the MTP layer's tensors from"
    try:
        names = json.loads(index_text).get("weight_map") or {}
    except (ValueError, AttributeError):
        names = {}
    prefix = f"model.layers.{layer}."
    if any(isinstance(n, str) and n.startswith(prefix) for n in names):
        return None
    return (f"{where}/{WEIGHT_INDEX} has no tensor of the MTP layer ({prefix}*: config.json's "
            f"num_hidden_layers is {layer})")
