"""The folders above gpuhost's own, each made with an explicit owner and mode whatever root's
umask: on a hardened host (pam_umask and the profile at 077, CIS's advice) ``mkdir -p`` of
/opt/gpuhost/lib would leave /opt/gpuhost 0700, and the model copy user (rrsync, not root)
could not reach the models under it."""

from __future__ import annotations

from typing import Final

from pyinfra.operations import files

#: gpuhost's top folders, owner root:root, mode 0755, made before anything under them
#: (settings.GPUHOST_DIRS lists what lives there).
TOP_FOLDERS: Final = ("/opt/gpuhost", "/var/lib/gpuhost")


def top_folders() -> None:
    """Plan the top folders root:root 0755, before the stage's own folders under them; a
    folder there already only gets its owner and mode."""
    for path in TOP_FOLDERS:
        files.directory(name=f"Folder {path}", path=path, user="root", group="root",
                        mode="755")


def folders_down_to(base: str, path: str) -> list[str]:
    """``base`` and each folder between it and ``path`` (``path`` itself left out): the model
    folder's ``<gpuhost_model_dir>/<owner>`` that ``mkdir -p`` would make under the umask."""
    rest = path.removeprefix(base.rstrip("/") + "/").split("/")[:-1]
    return [base] + [f"{base.rstrip('/')}/{'/'.join(rest[:i + 1])}" for i in range(len(rest))]
