"""Tagged checkpoint directories as DeepSpeed lays them out: ``<dir>/<tag>/`` holds one save and
``<dir>/latest`` names the newest tag. A save is crash-safe: every rank writes into
``<dir>/.<tag>.partial``, rank 0 fsyncs what was written and renames the folder to ``<dir>/<tag>``
(an older save of the same tag is moved aside first and removed afterwards), then replaces
``latest`` atomically (a temporary file, fsync, rename, fsync of the directory). A process killed
at any point leaves ``latest`` naming a complete save.

The ranks are kept in step by ``barrier`` (a function; one process passes a no-op)."""

import os
import shutil

from .common import fsync_path, replace_atomically

LATEST = "latest"


def fsync_tree(root):
    """fsync of every file and directory below ``root``, then of ``root`` itself."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def write_atomically(path, text):
    """Replaces ``path`` by a file holding ``text`` (replace_atomically)."""
    replace_atomically(path, lambda file: file.write(text.encode("utf-8")))


def partial_directory(save_dir, tag):
    """Where a save of ``tag`` is written before it becomes ``<save_dir>/<tag>``."""
    return os.path.join(save_dir, f".{tag}.partial")


def begin_save(save_dir, tag, rank, barrier):
    """Prepares an empty partial folder for ``tag`` (rank 0 first removes what saves that
    failed or were killed left, of any tag) and returns it once every rank may write into
    it."""
    partial = partial_directory(save_dir, tag)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        for name in os.listdir(save_dir):
            if name.startswith(".") and name.endswith(".partial"):
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
        os.makedirs(partial)
    barrier()
    return partial


def commit_save(save_dir, tag, rank, barrier, save_latest=True):
    """After every rank wrote its part: rank 0 makes the save durable, renames it into place
    and points ``latest`` at it; returns its final path once every rank may go on."""
    barrier()
    final = os.path.join(save_dir, str(tag))
    if rank == 0:
        partial = partial_directory(save_dir, tag)
        fsync_tree(partial)
        replaced = f"{final}.replaced"
        if os.path.exists(final):
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(partial, final)
        fsync_path(save_dir)
        if save_latest:
            write_atomically(os.path.join(save_dir, LATEST), str(tag))
        shutil.rmtree(replaced, ignore_errors=True)
    barrier()
    return final


def resolve_tag(load_dir, tag):
    """The tag to load: ``tag``, else the one ``<load_dir>/latest`` names; None when neither
    exists (DeepSpeed then loads nothing)."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as file:
        return file.read().strip()
