"""The architecture a model's config.json names, as sglang reads it (standard library only).

sglang 0.5.9 takes the model's architecture from ``hf_config.architectures[0]``
(sglang/srt/server_args.py), the list transformers writes under ``"architectures"``
(PretrainedConfig.to_dict; GLM-5's config.json: ``"architectures": ["GlmMoeDsaForCausalLM"]``).
Used by the Stack stage on the controller (operations/stack_check.py) and shipped beside
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
