"""What a host holds of the served model and what a download of it needs: its local copy
(complete or not, at which commit), the room on its file system, the MTP layer's bytes."""

from __future__ import annotations

import json
import shlex
from typing import Final, TypedDict

from pyinfra.api import FactBase
from typing_extensions import override

from operations import REPO_ROOT


#: Written by operations/files/model_fetch.py once a download is complete.
STAMP: Final = ".gpuhost-model.json"

_SNAPSHOT_SCRIPT: Final = """
import json, os, sys
d = sys.argv[1]
try:
    s = json.load(open(os.path.join(d, "STAMP_NAME")))
except Exception:
    print("{}"); sys.exit(0)
files = s.pop("files", {})
weights = [z for n, z in files.items() if n.endswith(".safetensors")]
s["weight_bytes"] = sum(weights) if files else None
bad = sorted(n for n, z in files.items() if os.path.islink(os.path.join(d, n))
             or not os.path.isfile(os.path.join(d, n)) or os.path.getsize(os.path.join(d, n)) != z)
extra = []
for top, dirs, names in os.walk(d):
    rel = os.path.relpath(top, d)
    if rel == ".":
        dirs[:] = [x for x in dirs if x != ".cache" or os.path.islink(os.path.join(d, x))]
    for n in names + [x for x in dirs if os.path.islink(os.path.join(top, x))]:
        p = n if rel == "." else rel + "/" + n
        if (p not in files or os.path.islink(os.path.join(top, n))) and not p.startswith("STAMP_NAME"):
            extra.append(p)
s["complete"], s["wrong"], s["file_count"] = not bad and not extra, bad, len(files)
s["extra"] = sorted(extra)[:20]
print(json.dumps(s))
""".replace("STAMP_NAME", STAMP)


class JsonObjectFact(FactBase[dict]):
    """A fact read by a ``python3 -c`` program that prints one JSON object on its last line: that
    object, else ``{"error": "<said_by> said ..."}`` with the program's last two lines (a subclass
    names the program in ``said_by`` and gives ``command``)."""

    said_by = "the program"

    @override
    def requires_command(self, **kwargs) -> str:
        return "python3"

    @override
    def default(self) -> dict:
        return {"error": "python3 is missing"}

    @override
    def process(self, output) -> dict:
        try:
            found = json.loads(output[-1])
        except (IndexError, ValueError):
            return {"error": f"{self.said_by} said {list(output)[-2:]!r}"}
        return found if isinstance(found, dict) else {"error": f"{self.said_by} said no object"}


class Snapshot(TypedDict, total=False):
    repo: str
    revision: str
    sha: str
    complete: bool
    wrong: list[str]
    extra: list[str]
    file_count: int
    weight_bytes: int | None


class ModelSnapshot(FactBase[Snapshot]):
    """The local copy of a model repository, from its stamp (written after a complete
    download), the files' sizes now, and what else is in the folder: ``extra``, the first 20
    symbolic links and files the revision does not list (the Hub client's ``.cache`` folder
    and the stamp aside), which make a copy incomplete (model_fetch.py removes them):

    .. code:: python

        {"repo": "lukealonso/GLM-5-NVFP4", "revision": "main",
         "sha": "4f3c...", "complete": True, "wrong": [], "extra": [], "file_count": 93,
         "weight_bytes": 454634000000}

    ``weight_bytes``: the stamp's sizes of the ``*.safetensors`` files (the Hub's, as
    downloaded), for the GPU memory check (operations/plans/memory_fit.py); None where the stamp
    lists no files.

    ``{}`` when there is no stamp (nothing downloaded, or a download that did not finish).
    """

    @override
    def requires_command(self, path: str) -> str:
        return "python3"

    @override
    def command(self, path: str) -> str:
        return f"python3 -c {shlex.quote(_SNAPSHOT_SCRIPT)} {shlex.quote(path)}"

    @override
    def default(self) -> Snapshot:
        return {}

    @override
    def process(self, output) -> Snapshot:
        try:
            data = json.loads("\n".join(output))
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}


def is_current(snapshot: Snapshot, repo: str, revision: str, commit: str | None = None) -> bool:
    """Whether a snapshot is a complete copy of ``repo`` at ``revision`` (the branch or tag it
    was downloaded for, or its commit sha); with ``commit`` (the fleet's:
    operations/plans/model_revision.py), a copy of that commit alone."""
    return (snapshot.get("repo") == repo and snapshot.get("complete") is True
            and (snapshot.get("sha") == commit if commit
                 else revision in (snapshot.get("revision"), snapshot.get("sha"))))


#: GiB that must stay free on the model's file system after a download (the server stage's
#: DISK_HEADROOM_GIB, which model_fetch.py --check-room is given at run time).
ROOM_HEADROOM_GIB: Final = 1.0
_ROOM_SCRIPT: Final = (REPO_ROOT / "operations" / "files" / "model_room.py").read_text()


class ModelRoom(JsonObjectFact):
    """What a download of ``repo`` at ``revision`` into ``dest`` still needs and the room there
    (operations/files/model_room.py, which says where each figure comes from), in bytes:

    .. code:: python

        {"need": 1577149, "free": 2147483648, "mount": "/opt", "folder": "/opt", "unsized": 0}

    ``{"error": "..."}`` where the Hub did not answer (said, and the run's own check at the
    download still stands).
    """

    #: the Hub, from the host: through the host's proxy (operations/plans/proxy.py)
    reaches_outside = True
    said_by = "model_room.py"

    @override
    def command(self, endpoint: str, repo: str, revision: str, dest: str,
                token_file: str | None) -> str:
        return " ".join(shlex.quote(a) for a in ("python3", "-c", _ROOM_SCRIPT, endpoint, repo,
                                                  revision, dest, token_file or ""))


#: The most a safetensors header may hold (safetensors' MAX_HEADER_SIZE, 100 MB: lib.rs).
_HEADER_MAX: Final = 100_000_000
_LAYER_SCRIPT: Final = """
import json, os, sys
d, prefix = sys.argv[1], sys.argv[2]
layer = draft = 0
try:
    for shard in sys.argv[3:]:
        with open(os.path.join(d, shard), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > HEADER_MAX:
                raise ValueError(f"{shard}: a header of {n} bytes")
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name.startswith(prefix) and name != "__metadata__":
                begin, end = t["data_offsets"]
                layer += end - begin
                if "shared_head.head" not in name and "embed_tokens" not in name:
                    draft += end - begin
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__} {str(exc)[:200]}"})); sys.exit(0)
print(json.dumps({"layer": layer, "draft": draft}))
""".replace("HEADER_MAX", str(_HEADER_MAX))


class MtpLayerBytes(JsonObjectFact):
    """The bytes of the MTP layer's tensors in a local checkpoint, from the safetensors headers
    of the ``shards`` its weight index maps them to (the format: an 8-byte little-endian header
    length, then a JSON header whose ``data_offsets`` bound each tensor's bytes; huggingface/
    safetensors README). ``layer``: every tensor named ``prefix*`` (``model.layers.<n>.``),
    which the target skips; ``draft``: those the draft loads, without ``embed_tokens`` and
    ``shared_head.head`` (the target's, shared: sglang 0.5.9's deepseek_weight_loader.py):

    .. code:: python

        {"layer": 9930000000, "draft": 6100000000}

    ``{"error": "..."}`` where a shard cannot be read (said; nothing refused on it).
    """

    said_by = "the header reading"

    @override
    def command(self, path: str, prefix: str, shards: tuple[str, ...]) -> str:
        return shlex.join(["python3", "-c", _LAYER_SCRIPT, path, prefix, *shards])


def model_download(fact, settings, commit: str | None = None) -> dict | None:
    """The :class:`ModelRoom` fact where the run will download the model (a Hub repository not
    yet complete in gpuhost_model_dir, at ``commit``: the fleet's,
    operations/plans/model_revision.py, where known), else None; read while planning (``fact``:
    operations.plans.plan.fact, one reading for every stage that asks: the preflight's room check,
    and the ML venv's where the venv shares the model's file system)."""
    if settings.model_is_local or is_current(fact(ModelSnapshot, path=settings.model_path),
                                             settings.model, settings.model_revision, commit):
        return None
    return fact(ModelRoom, endpoint=settings.hf_endpoint, repo=settings.model,
                revision=commit or settings.model_revision, dest=settings.model_path,
                token_file=settings.hf_token_file)
