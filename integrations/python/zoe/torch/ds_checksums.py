"""The checksum record of a tagged save: ``<tag>/zoe_checksums.json`` holds the size and sha256
of every file of the save that zoe's optimizer checkpoints do not checksum themselves:
model_states.pt, a torch optimizer's optimizer.pt, the optimizer's JSON files (hyper-parameters,
the sharded manifest), and each engine checkpoint's LATEST and manifest.json. The state files an
engine checkpoint's manifest lists carry their own xxh3, which zoe verifies as it loads them.

Rank 0 writes the record into the partial folder after every rank wrote its part, so it is made
durable and put in place with the save (ds_checkpoint.commit_save). A load verifies the files it
is about to read before it reads any of them (verify_checksums): a file missing is NotFound, a
file of another size or checksum Corruption, each naming the file. A save written before zoe
recorded checksums has no record; it loads unverified (the engine logs a warning)."""

import hashlib
import json
import os

from .. import _capi
from ..errors import Corruption, NotFound

RECORD = "zoe_checksums.json"
FORMAT = 1
ALGORITHM = "sha256"
_ENGINE_MANIFEST = "manifest.json"
_ENGINE_LATEST = "LATEST"
_READ_BYTES = 4 << 20


def file_digest(path):
    """(size, sha256 hex digest) of the file at ``path``."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while True:
            block = file.read(_READ_BYTES)
            if not block:
                return size, digest.hexdigest()
            digest.update(block)
            size += len(block)


def _self_checked(directory, names):
    """The files of ``directory`` that an engine checkpoint's manifest lists with their own
    xxh3 (``directory`` a version folder beside a LATEST); none when it cannot be read."""
    parent = os.path.dirname(directory)
    if _ENGINE_MANIFEST not in names or not os.path.isfile(os.path.join(parent, _ENGINE_LATEST)):
        return set()
    try:
        with open(os.path.join(directory, _ENGINE_MANIFEST), encoding="utf-8") as file:
            files = json.load(file).get("files", [])
        return {entry["name"] for entry in files if isinstance(entry.get("xxh3"), str)}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return set()


def unchecked_files(root):
    """The files below ``root`` (relative paths, sorted) that no engine manifest checksums."""
    found = []
    for directory, _, names in os.walk(root):
        checked = _self_checked(directory, names)
        found += [os.path.relpath(os.path.join(directory, name), root)
                  for name in names if name not in checked]
    return sorted(path for path in found if path != RECORD)


def record_checksums(root, known=None):
    """Writes the record of the files below ``root`` (unchecked_files), taking the (size,
    digest) of those in ``known`` (relative path -> digest, hashed as they were written) and
    reading the others. Not synced: the save's commit syncs the whole folder."""
    known = known or {}
    files = {}
    for path in unchecked_files(root):
        size, digest = known[path] if path in known else file_digest(os.path.join(root, path))
        files[path] = {"size": size, ALGORITHM: digest}
    with open(os.path.join(root, RECORD), "w", encoding="utf-8") as file:
        json.dump({"format": FORMAT, "algorithm": ALGORITHM, "files": files}, file, indent=1)


def _corrupt(message):
    return Corruption(_capi.Status.CORRUPTION, message)


def _read_record(path):
    try:
        with open(path, encoding="utf-8") as file:
            record = json.load(file)
        files = record["files"]
        if record.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"not a record of {ALGORITHM} checksums")
        return files
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise _corrupt(f"{path!r} is not a checksum record of a zoe save ({error}): it was "
                       "damaged or edited; load another tag") from None


def verify_checksums(root, wanted=lambda path: True):
    """Verifies each file of the record in ``root`` that ``wanted(relative path)`` selects:
    NotFound when it is missing, Corruption when its size or checksum is not the recorded one.
    Returns False when ``root`` has no record (a save of an older zoe), True otherwise."""
    record = os.path.join(root, RECORD)
    if not os.path.exists(record):
        return False
    for name, entry in sorted(_read_record(record).items()):
        if wanted(name):
            _verify_file(root, name, entry, record)
    return True


def _verify_file(root, name, entry, record):
    path = os.path.join(root, name)
    if not isinstance(entry, dict) or "size" not in entry or ALGORITHM not in entry:
        raise _corrupt(f"{record!r}: the entry of {name!r} is not a size and a checksum")
    if not os.path.isfile(path):
        raise NotFound(_capi.Status.NOT_FOUND,
                       f"{path!r} is missing: the save recorded it ({entry['size']} bytes); "
                       "load another tag")
    size, digest = file_digest(path)
    if size != entry["size"]:
        raise _corrupt(f"{path!r} holds {size} bytes; the save recorded {entry['size']}: it was "
                       "truncated or changed after the save; load another tag")
    if digest != entry[ALGORITHM]:
        raise _corrupt(f"{path!r}: checksum mismatch: {ALGORITHM} recorded {entry[ALGORITHM]}, "
                       f"read {digest}: it changed after the save (a damaged disk or an edit); "
                       "load another tag")
