"""Checkpoint files of zoe.torch beside the engines' own checkpoints: an unsharded optimizer's
param groups (save_param_groups), and the sharded checkpoints of zoe's ZeRO optimizers and
pagers: every rank saves its shard to dir/rank-<r>/save-<n> and, once every rank succeeded, rank
0 replaces the manifest (world size, stage, shard layout, the parameters' shapes,
hyper-parameters, and each rank's save) atomically: ranks killed during a save all load the
previous checkpoint (save_sharded). Every step that one rank can fail is agreed
(TorchCollectives.agreed): every rank raises zoe's error naming the failing rank, the ranks stay
paired, a failed save keeps the previous checkpoint and a failed load changes no rank's state
(load_shard)."""

import json
import os
import re
import shutil
import tempfile

import torch

from .. import _capi
from .. import errors as zoe_errors
from .._collective_ops import gather_objects
from .common import fsync_path, replace_atomically

PARAM_GROUPS = "zoe_torch_param_groups.json"  # an unsharded optimizer's hyper-parameters
MANIFEST = "zoe_sharded_manifest.json"
MANIFEST_FORMAT = 2  # 1 (no "format"): the shards in rank-<r>, overwritten by every save
_SAVE_NAME = re.compile(r"save-(\d+)")  # a rank's save folder: save-<n>


def _shard_path(rank, version):
    """Where rank's shard of save ``version`` lies, relative to the checkpoint directory."""
    return os.path.join(f"rank-{rank}", f"save-{version:06d}")


def _latest_of(engine_dir):
    """The version an engine checkpoint directory's LATEST names ("v000001")."""
    with open(os.path.join(engine_dir, "LATEST"), encoding="utf-8") as file:
        return file.read().strip()


def read_manifest(directory):
    """The manifest of the sharded checkpoint in ``directory``; NotFound when there is none,
    Corruption when it is not one."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise zoe_errors.NotFound(
            _capi.Status.NOT_FOUND, f"{directory!r} holds no sharded zoe checkpoint"
        )
    try:
        with open(path, encoding="utf-8") as file:
            manifest = json.load(file)
    except ValueError as error:
        raise zoe_errors.Corruption(
            _capi.Status.CORRUPTION, f"{path!r} is not a sharded zoe manifest: {error}"
        ) from None
    if not isinstance(manifest, dict) or "world_size" not in manifest or "groups" not in manifest:
        raise zoe_errors.Corruption(
            _capi.Status.CORRUPTION, f"{path!r} is not a sharded zoe manifest (no world_size or "
            "groups)"
        )
    return manifest


def shard_directory(directory, manifest, rank):
    """The engine checkpoint of rank's shard that ``manifest`` names, checked to be the one it
    recorded (Corruption when another save replaced it)."""
    if "shards" not in manifest:  # format 1
        return os.path.join(directory, f"rank-{rank}")
    entry = manifest["shards"][rank]
    path = os.path.join(directory, entry["path"])
    try:
        found = _latest_of(path)
    except OSError as error:
        found = f"nothing ({error.strerror})"
    if found != entry["engine_version"]:
        raise zoe_errors.Corruption(
            _capi.Status.CORRUPTION,
            f"rank {rank}'s shard {path!r} holds {found}; the manifest of {directory!r} names "
            f"{entry['engine_version']}: the shard was changed after the manifest was written",
        )
    return path


def save_sharded(directory, comm, save_shard, manifest):
    """The sharded checkpoint protocol: one step after another, each agreed
    (TorchCollectives.agreed: a step that fails on any rank raises on every rank, naming it,
    and the ranks stay paired for their next collective):

    1. save n is one more than every save the live manifest or any rank's folder names;
    2. every rank calls ``save_shard(path)`` on a fresh ``directory``/rank-<r>/save-<n> (after a
       failure on any rank, every rank removes its save n: no manifest names it);
    3. rank 0 replaces the manifest (``manifest`` plus the format, n, the world size and each
       rank's shard with the engine version its LATEST names) atomically;
    4. each rank removes its other saves.

    A rank killed or failing anywhere before step 3's rename leaves the previous manifest, which
    names the previous save of every rank, still on disk: loaders never mix two saves, and a
    failed save loses nothing saved before it."""
    where = f"the sharded checkpoint in {directory!r}"
    version = _next_version(directory, comm, where)
    try:
        latest = comm.agreed(f"saving the shards of {where}",
                             lambda: _write_shard(directory, comm.rank, version, save_shard))
    except Exception:
        _remove_quietly(os.path.join(directory, _shard_path(comm.rank, version)))
        raise
    engine_versions = gather_objects(latest, comm.group, f"the shards' versions of {where}")
    manifest = dict(manifest, format=MANIFEST_FORMAT, version=version, world_size=comm.world_size)
    manifest["shards"] = [{"path": _shard_path(rank, version), "engine_version": found}
                          for rank, found in enumerate(engine_versions)]
    comm.agreed(f"publishing the manifest of {where}",
                lambda: _publish_manifest(directory, manifest) if comm.rank == 0 else None)
    _remove_old_saves(directory, comm.rank, version)


def _next_version(directory, comm, where):
    """Save n, the same on every rank: one more than the save the live manifest names (as rank
    0 reads it; none when it cannot be read) and than every rank's save-<m> folders, so that no
    save is ever written over one a manifest may name."""
    highest = comm.agreed(f"numbering the new save of {where}",
                          lambda: _highest_save(directory, comm.rank))
    numbers = torch.zeros(comm.world_size, dtype=torch.float64)
    numbers[comm.rank] = highest
    comm.all_reduce(numbers, f"numbering the new save of {where}")
    return int(numbers.max().item()) + 1


def _highest_save(directory, rank):
    """The highest save number in rank's folder and, on rank 0, the live manifest's (0: none)."""
    highest = _manifest_version(directory) if rank == 0 else 0
    rank_dir = os.path.join(directory, f"rank-{rank}")
    names = os.listdir(rank_dir) if os.path.isdir(rank_dir) else []
    found = (_SAVE_NAME.fullmatch(name) for name in names)
    return max([highest] + [int(match.group(1)) for match in found if match])


def _manifest_version(directory):
    """The save number the live manifest names; 0 when there is none or it cannot be read."""
    try:
        return int(read_manifest(directory).get("version", 0))
    except (OSError, ValueError, TypeError, zoe_errors.Error):
        return 0


def _write_shard(directory, rank, version, save_shard):
    """Rank's shard of save ``version``, written by ``save_shard`` into a fresh folder; returns
    the engine version its LATEST names."""
    path = os.path.join(directory, _shard_path(rank, version))
    _fresh_directory(path)
    save_shard(path)
    return _latest_of(path)


def _fresh_directory(path):
    """``path`` created empty (a save killed earlier may have left one of the same name: no
    manifest names it)."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)


def _publish_manifest(directory, manifest):
    """Replaces the manifest: written to a temporary file, fsynced, renamed over the live one
    and the directory fsynced, so a reader sees the old one or the new one, whole."""
    temporary = os.path.join(directory, f".{MANIFEST}.tmp")
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(manifest, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, os.path.join(directory, MANIFEST))
    fsync_path(directory)


def _remove_old_saves(directory, rank, version):
    """Removes everything in rank's folder but save ``version`` (best effort: a later save
    removes what stays behind)."""
    rank_dir = os.path.join(directory, f"rank-{rank}")
    keep = os.path.basename(_shard_path(rank, version))
    try:
        names = os.listdir(rank_dir)
    except OSError:
        return
    for name in names:
        if name != keep:
            _remove_quietly(os.path.join(rank_dir, name))


def _remove_quietly(path):
    """Removes a file or a folder tree, ignoring failures."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass


class OneProcess:
    """The collectives of one process, for load_shard: each step is its own agreement."""

    @staticmethod
    def agreed(what, step):
        del what  # the step's own error says what failed
        return step()


def load_shard(comm, what, shard_dir, save, load):
    """``load(shard_dir)`` as an agreed step that leaves every rank as it was when it failed on
    any rank: first each rank saves its state as it is with ``save(folder)`` (an agreed step of
    its own) into a scratch folder beside its shard; every rank that started its load loads that
    back when any rank's failed (its own, which may have changed part of the state, included).
    The scratch folder is removed either way. ``comm``: TorchCollectives, or OneProcess."""
    before = comm.agreed(f"saving the state as it is before {what}",
                         lambda: _save_scratch(os.path.dirname(shard_dir), save))
    started = False

    def load_mine():
        nonlocal started
        started = True
        load(shard_dir)

    try:
        comm.agreed(what, load_mine)
    except Exception:
        if started:  # back to the state before the load
            load(before)
        raise
    finally:
        _remove_quietly(before)


def _save_scratch(parent, save):
    """``save(folder)`` into a fresh scratch folder in ``parent`` (removed when it fails)."""
    folder = tempfile.mkdtemp(prefix=".before-load-", dir=parent)
    try:
        save(folder)
    except BaseException:
        _remove_quietly(folder)
        raise
    return folder


def save_param_groups(directory, name, param_groups, kind_name):
    """Writes an unsharded optimizer's name, its kind's name ("AdamW", "Lion", ...) and its param
    groups' hyper-parameters (JSON) beside its engine checkpoint in ``directory``, atomically
    (common.replace_atomically)."""
    text = json.dumps({"name": name, "optimizer": kind_name, "param_groups": param_groups})
    replace_atomically(os.path.join(directory, PARAM_GROUPS),
                       lambda file: file.write(text.encode("utf-8")))


def saved_param_groups(directory, sharded):
    """(the param groups' hyper-parameters, the optimizer kind's name or None) of the zoe
    optimizer checkpoint in ``directory``: a sharded one's manifest (``sharded``: ZeRO stages 1
    and 2, and stage 3's pager over ranks), else an unsharded optimizer's (load_param_groups)."""
    if not sharded:
        return load_param_groups(directory)
    manifest = read_manifest(directory)
    return manifest.get("param_groups", []), manifest.get("optimizer")


def load_param_groups(directory):
    """(the param groups' hyper-parameters, the optimizer kind's name or None for a file written
    before it was kept) as save_param_groups wrote them in ``directory``; NotFound when it holds
    no zoe optimizer checkpoint, Corruption naming the file when it is not one."""
    path = os.path.join(directory, PARAM_GROUPS)
    if not os.path.exists(path):
        raise zoe_errors.NotFound(
            _capi.Status.NOT_FOUND, f"{directory!r} holds no zoe optimizer checkpoint"
        )
    try:
        with open(path, encoding="utf-8") as file:
            saved = json.load(file)
        return saved["param_groups"], saved.get("optimizer")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise zoe_errors.Corruption(
            _capi.Status.CORRUPTION,
            f"{path!r} is not a zoe optimizer's param groups ({type(error).__name__}: {error})"
        ) from None
