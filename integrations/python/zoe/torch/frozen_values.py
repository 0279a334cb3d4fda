"""The values of the paged parameters no optimizer steps (frozen: requires_grad=False) in a stage
3 checkpoint, beside the optimizer's save in the same folder: VALUES holds their bytes (over
ranks this rank's shards), one parameter after another in the layout's order, and INDEX (JSON,
written after VALUES, each replaced atomically) lists each parameter's layout index, name,
dtype and elements, with the sha256 of VALUES. A save holds one parameter in memory at a time;
a load reads VALUES twice (its checksum first, then the values into the pages), one parameter
at a time, and is checked whole before anything is written."""

import hashlib
import json
import os

import torch

from .. import _capi
from .. import errors as zoe_errors
from .common import replace_atomically
from .ds_checkpoint import DISK_FULL, available_bytes, no_space_error

VALUES = "zoe_frozen_values.bin"
INDEX = "zoe_frozen_values.json"
FORMAT = 1


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _bytes_of(pager, tensor):
    """The bytes of a paged ``tensor`` (a parameter, or a shard), acquired for the copy."""
    with pager.held(tensor, _capi.Access.READ) as memory:
        flat = memory.detach().reshape(-1).cpu().contiguous()
    return flat.view(torch.uint8).numpy().tobytes()


def save_frozen(directory, pager, entries):
    """Writes the values of ``entries`` ((layout index, name, paged tensor) in the layout's
    order) into ``directory`` (VALUES, then INDEX); NoSpace naming the file and the bytes it
    needs when they are not available, or when the disk fills while it is written."""
    path = os.path.join(directory, VALUES)
    needed = sum(tensor.numel() * tensor.element_size() for _, _, tensor in entries)
    available = available_bytes(directory)
    kept = "the frozen parameters' values are as they were"
    if needed > available:
        raise no_space_error(path, needed, available, False, kept)
    try:
        _write_frozen(directory, pager, entries)
    except OSError as error:
        if error.errno not in DISK_FULL:
            raise
        raise no_space_error(path, needed, available, True, kept) from error


def _write_frozen(directory, pager, entries):
    """save_frozen's writes: VALUES one parameter at a time, then INDEX."""
    listed, digest = [], hashlib.sha256()

    def write(file):
        for index, name, tensor in entries:
            data = _bytes_of(pager, tensor)
            file.write(data)
            digest.update(data)
            listed.append({"index": index, "name": name, "dtype": _dtype_name(tensor.dtype),
                           "numel": tensor.numel(), "bytes": len(data)})

    replace_atomically(os.path.join(directory, VALUES), write)
    text = json.dumps({"format": FORMAT, "parameters": listed, "sha256": digest.hexdigest()})
    replace_atomically(os.path.join(directory, INDEX), lambda file: file.write(text.encode()))


def has_frozen(directory):
    """Whether ``directory`` holds frozen values (a save before they were kept holds none)."""
    return os.path.exists(os.path.join(directory, INDEX))


def _corrupt(message):
    return zoe_errors.Corruption(_capi.Status.CORRUPTION, message)


def read_index(directory):
    """The INDEX of ``directory``, its VALUES checked against its sha256 (Corruption when they
    differ or the files are not frozen values; NotFound when there are none)."""
    path = os.path.join(directory, INDEX)
    if not os.path.exists(path):
        raise zoe_errors.NotFound(_capi.Status.NOT_FOUND,
                                  f"{directory!r} holds no frozen parameter values ({INDEX})")
    try:
        with open(path, encoding="utf-8") as file:
            index = json.load(file)
        listed, expected = index["parameters"], index["sha256"]
    except (ValueError, KeyError, TypeError) as error:
        raise _corrupt(f"{path!r} is not an index of frozen values: {error}") from None
    digest, size = hashlib.sha256(), 0
    with open(os.path.join(directory, VALUES), "rb") as file:
        for block in iter(lambda: file.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
    if digest.hexdigest() != expected or size != sum(entry["bytes"] for entry in listed):
        raise _corrupt(f"{os.path.join(directory, VALUES)!r} does not match the sha256 and the "
                       f"sizes {INDEX} records: the file was changed or cut short")
    return index


def check_index(index, entries, where):
    """FailedPrecondition unless the ``index`` (read_index) lists ``entries`` ((layout index,
    name, paged tensor)) with their dtypes and elements."""
    wanted = [(index_, name, _dtype_name(tensor.dtype), tensor.numel())
              for index_, name, tensor in entries]
    found = [(entry["index"], entry["name"], entry["dtype"], entry["numel"])
             for entry in index["parameters"]]
    if found != wanted:
        raise zoe_errors.FailedPrecondition(
            _capi.Status.FAILED_PRECONDITION,
            f"{where} holds the frozen values of {[entry[1] for entry in found]}; this model's "
            f"frozen parameters (those no param group holds) are {[entry[1] for entry in wanted]}"
            ": freeze the same parameters (requires_grad=False) as when it was saved")


def read_values(directory, index):
    """(layout index, flat tensor of its dtype) of each parameter VALUES holds, one at a time."""
    path = os.path.join(directory, VALUES)
    with open(path, "rb") as file:
        for entry in index["parameters"]:
            data = bytearray(file.read(entry["bytes"]))
            if len(data) != entry["bytes"]:
                raise _corrupt(f"{path!r} ends {len(data)} bytes into {entry['name']!r}, of "
                               f"{entry['bytes']} bytes: the file was cut short")
            values = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(
                0, dtype=torch.uint8)
            yield entry["index"], values.view(getattr(torch, entry["dtype"]))


def save_with_frozen(directory, optimizer, pager, entries):
    """A stage 3 save into ``directory``: the optimizer's, and the values of ``entries`` (the
    paged tensors it does not step: save_frozen) beside it."""
    optimizer.save_checkpoint(directory)
    save_frozen(directory, pager, entries)


def load_with_frozen(directory, optimizer, pager, entries, where):
    """Loads what save_with_frozen wrote: the frozen values checked first (their sha256, and
    that they are ``entries``', FailedPrecondition naming ``where`` otherwise), so that a
    failure there changes nothing; then the optimizer and the values (a failure there is
    checkpoint.load_shard's to undo)."""
    index = read_index(directory)
    check_index(index, entries, where)
    optimizer.load_checkpoint(directory)
    load_frozen(directory, index, pager, entries)


@torch.no_grad()
def load_frozen(directory, index, pager, entries):
    """Writes the values VALUES holds (``index``, checked: check_index) into ``entries``'
    paged memory, one parameter at a time."""
    tensors = {index_: tensor for index_, _, tensor in entries}
    for index_, values in read_values(directory, index):
        with pager.held(tensors[index_], _capi.Access.WRITE) as memory:
            memory.copy_(values.view(memory.shape))
