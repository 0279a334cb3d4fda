"""Tagged checkpoint directories as DeepSpeed lays them out: ``<dir>/<tag>/`` holds one save and
``<dir>/latest`` names the newest tag. A save is crash-safe: every rank writes into
``<dir>/.<tag>.partial``, rank 0 fsyncs what was written and renames the folder to ``<dir>/<tag>``
(an older save of the same tag is moved aside to ``<dir>/<tag>.replaced`` first and removed
afterwards), then replaces ``latest`` atomically (a temporary file, fsync, rename, fsync of the
directory). A process killed at any point leaves ``latest`` naming a complete save: killed
between the two renames, ``<tag>`` is missing and ``<tag>.replaced`` complete, so a load of
``<tag>`` takes that copy (find_save) and the next save keeps it until a new ``<tag>`` is in
place.

Tags are plain folder names (checked_tag): a tag that would write outside ``<dir>``, over
``latest`` or over a folder the protocol uses is refused before anything is written.

The functions here run on one rank (begin_save and commit_save do their work on rank 0); the
engine makes each of them a step every rank agrees on (ds_engine.py)."""

import errno
import logging
import os
import shutil

from .. import _capi
from ..errors import Corruption, InvalidArgument, NoSpace, NotFound
from .common import TorchFileWriter, fsync_path, replace_atomically

LATEST = "latest"
MODEL_STATES = "model_states.pt"
_PARTIAL = ".partial"
_REPLACED = ".replaced"
# '.<tag>.partial' must fit in a directory entry (NAME_MAX bytes)
MAX_TAG_BYTES = 255 - len("." + _PARTIAL)
_TAG_RULE = ("allowed: a plain folder name such as 'global_step100': not empty, '.' or '..', "
             "without '/' or NUL, not 'latest' or 'latest.tmp', not starting with '.' nor "
             f"ending with '{_PARTIAL}' or '{_REPLACED}', at most {MAX_TAG_BYTES} bytes")

# the errnos of a full file system (EFBIG: a file over RLIMIT_FSIZE or the file system's limit)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

log = logging.getLogger("zoe.torch")


def fsync_tree(root):
    """fsync of every file and directory below ``root``, then of ``root`` itself."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def write_atomically(path, text):
    """Replaces ``path`` by a file holding ``text`` (replace_atomically)."""
    replace_atomically(path, lambda file: file.write(text.encode("utf-8")))


def _tag_problem(name):
    """Why ``name`` cannot be a tag, or None."""
    if name in ("", ".", ".."):
        return "it names no folder of its own"
    if "/" in name or "\0" in name or (os.altsep and os.altsep in name):
        return "it holds a path separator or NUL"
    if name in (LATEST, LATEST + ".tmp"):
        return "that is the file naming the latest tag"
    if name.startswith("."):
        return "names starting with '.' are the folders of saves being written"
    if name.endswith((_PARTIAL, _REPLACED)):
        return "those names are the folders of saves being written or replaced"
    if len(name.encode("utf-8", "surrogateescape")) > MAX_TAG_BYTES:
        return "it is too long"
    return None


def checked_tag(tag):
    """``tag`` as the folder name it is (str(tag), as DeepSpeed's); InvalidArgument naming the
    rule when it is not a plain folder name of its own."""
    name = str(tag)
    problem = _tag_problem(name)
    if problem is not None:
        raise InvalidArgument(_capi.Status.INVALID_ARGUMENT,
                              f"checkpoint tag {name!r} is not allowed: {problem}; {_TAG_RULE}")
    return name


def partial_directory(save_dir, tag):
    """Where a save of ``tag`` is written before it becomes ``<save_dir>/<tag>``."""
    return os.path.join(save_dir, f".{tag}{_PARTIAL}")


def _check_save_dir(save_dir, save_latest):
    """InvalidArgument, before anything is written, when ``save_dir`` is no folder to save
    into or its ``latest`` (which the save replaces, when ``save_latest``) is no file."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise InvalidArgument(_capi.Status.INVALID_ARGUMENT,
                              f"the checkpoint folder {save_dir!r} is not a folder: save into a "
                              "folder (it is created when missing)")
    latest = os.path.join(save_dir, LATEST)
    if save_latest and os.path.lexists(latest) and not os.path.isfile(latest):
        raise InvalidArgument(_capi.Status.INVALID_ARGUMENT,
                              f"{latest!r} is not a file, and a save replaces it by the file "
                              "naming its tag: move it away, or save with save_latest=False")


def begin_save(save_dir, tag, rank, save_latest=True):
    """Checks ``tag`` (checked_tag) and, on rank 0, the folder (_check_save_dir) before
    anything is written and returns the partial folder every rank writes into; on rank 0 it is
    created empty, after removing what saves that failed or were killed left
    (remove_leftovers)."""
    tag = checked_tag(tag)
    partial = partial_directory(save_dir, tag)
    if rank == 0:
        _check_save_dir(save_dir, save_latest)
        os.makedirs(save_dir, exist_ok=True)
        remove_leftovers(save_dir)
        os.makedirs(partial)
    return partial


def remove_leftovers(save_dir):
    """Removes the partial folders of saves that failed or were killed, and each
    ``<tag>.replaced`` whose ``<tag>`` is in place again; a ``<tag>.replaced`` without its
    ``<tag>`` is the only complete copy of that tag and stays."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(".") and name.endswith(_PARTIAL):
            shutil.rmtree(path, ignore_errors=True)
        elif name.endswith(_REPLACED) and os.path.isdir(path[:-len(_REPLACED)]):
            shutil.rmtree(path, ignore_errors=True)


def commit_save(save_dir, tag, save_latest=True):
    """On rank 0, once every rank wrote its part: makes the save durable, renames it into place
    and points ``latest`` at it; returns its final path."""
    partial = partial_directory(save_dir, tag)
    final = os.path.join(save_dir, tag)
    replaced = final + _REPLACED
    fsync_tree(partial)
    if os.path.exists(final):
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)  # killed from here to the next rename: loads take replaced
    try:
        os.replace(partial, final)
    except BaseException:
        if os.path.isdir(replaced) and not os.path.exists(final):
            os.replace(replaced, final)
        raise
    fsync_path(save_dir)
    if save_latest:
        write_atomically(os.path.join(save_dir, LATEST), tag)
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def abandon_save(save_dir, tag):
    """Removes what a save of ``tag`` that failed wrote (rank 0, once no rank writes into it;
    nothing for a tag checked_tag refuses, which wrote nothing)."""
    if _tag_problem(tag) is None:
        shutil.rmtree(partial_directory(save_dir, tag), ignore_errors=True)


def saves_in(directory):
    """The tags of the complete saves in ``directory`` (folders holding model_states.pt)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(name for name in names if not name.startswith(".")
                  and not name.endswith(_REPLACED)
                  and os.path.isfile(os.path.join(directory, name, MODEL_STATES)))


def listing(directory):
    tags = saves_in(directory)
    return f"its saves: {', '.join(tags)}" if tags else "it holds no save"


def _latest_tag(load_dir):
    """The tag ``<load_dir>/latest`` names; None when there is no such file."""
    latest = os.path.join(load_dir, LATEST)
    if not os.path.lexists(latest):
        return None
    if not os.path.isfile(latest):
        raise Corruption(_capi.Status.CORRUPTION,
                         f"{latest!r} is not the file naming the latest tag ({listing(load_dir)}"
                         "): load a tag explicitly")
    with open(latest, encoding="utf-8", errors="replace") as file:
        tag = file.read().strip()
    if not tag:
        raise Corruption(_capi.Status.CORRUPTION,
                         f"{latest!r} is empty: it names no tag ({listing(load_dir)}); load a "
                         "tag explicitly")
    return tag


def find_save(load_dir, tag):
    """The folder of the save to load: ``<load_dir>/<tag>``, ``tag`` defaulting to the one
    ``<load_dir>/latest`` names; None when ``tag`` is None and there is no ``latest`` (DeepSpeed
    then loads nothing). A ``<tag>`` that a killed save left moved aside is found as
    ``<tag>.replaced``. NotFound when ``load_dir`` or the save does not exist (naming the saves
    that do), InvalidArgument when ``load_dir`` is not a directory or ``tag`` no tag."""
    if not os.path.exists(load_dir):
        raise NotFound(_capi.Status.NOT_FOUND, f"checkpoint directory {load_dir!r} does not exist")
    if not os.path.isdir(load_dir):
        raise InvalidArgument(
            _capi.Status.INVALID_ARGUMENT,
            f"{load_dir!r} is not a directory: load_checkpoint takes the directory "
            "save_checkpoint wrote (holding <tag>/ and latest)")
    named_by = f"{os.path.join(load_dir, LATEST)!r}"
    if tag is None:
        tag = _latest_tag(load_dir)
        if tag is None:
            return None
    else:
        tag, named_by = checked_tag(tag), "the tag asked for"
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + _REPLACED):
        log.warning("checkpoint %r is missing and %r holds the copy a save of the same tag "
                    "was replacing when it stopped: loading that copy", path, path + _REPLACED)
        return path + _REPLACED
    raise NotFound(_capi.Status.NOT_FOUND,
                   f"{load_dir!r} has no save {tag!r} ({named_by}); {listing(load_dir)}")


def _estimated_bytes(value):
    """The bytes of the tensors in ``value`` (dicts, lists and tuples walked): about what
    torch.save writes of it."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return value.element_size() * value.numel()
    if isinstance(value, dict):
        return sum(_estimated_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_estimated_bytes(item) for item in value)
    return 0


def available_bytes(directory):
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def no_space_error(path, needed, available, writing, kept):
    """NoSpace naming the directory ``path`` is written in, what it needed and what to free
    (``writing``: the disk filled while it was written); ``kept`` says what stays as it
    was."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.basename(directory).endswith(_PARTIAL):
        directory = os.path.dirname(directory)  # the save's directory
    if writing:
        happened = (f"out of space in {directory!r} while writing {path!r} (it needs about "
                    f"{needed} bytes; {available} bytes were available)")
    else:
        happened = (f"{path!r} needs about {needed} bytes but only {available} bytes are "
                    f"available in {directory!r}")
    amount = f"at least {needed - available} bytes" if needed > available else "space"
    return NoSpace(_capi.Status.NO_SPACE,
                   f"{happened}: free {amount} there (saves no longer needed? "
                   f"{listing(directory)}) or save elsewhere; {kept}")


def _save_torch(path, value, write, kept):
    """``write(save)``, where ``save(file)`` torch.saves ``value`` into a binary file object
    (TorchFileWriter: a full disk is an error and not an abort of the process, as torch
    1.13's writer throws in a destructor otherwise); NoSpace (_no_space) when the space
    ``value`` needs is not available, or when the disk fills while it is written."""
    needed = _estimated_bytes(value)
    available = available_bytes(os.path.dirname(os.path.abspath(path)))
    if needed > available:
        raise no_space_error(path, needed, available, False, kept)
    try:
        return write(lambda file: TorchFileWriter(file).save(value))
    except OSError as error:
        if error.errno not in DISK_FULL:
            raise
        raise no_space_error(path, needed, available, True, kept) from error


def write_torch_file(directory, name, value):
    """torch.save of ``value`` to ``<directory>/<name>`` in a save's partial folder
    (_save_torch); returns (size, sha256 hex digest) of the file written."""
    path = os.path.join(directory, name)

    def write(save):
        with open(path, "wb") as file:
            return save(file)

    return _save_torch(path, value, write,
                       "this save was removed, the saves before it and latest are unchanged")


def replace_torch_file(path, value):
    """torch.save of ``value`` replacing the file ``path`` atomically (replace_atomically,
    _save_torch)."""
    _save_torch(path, value, lambda save: replace_atomically(path, save),
                "the file there before, if any, is unchanged")
