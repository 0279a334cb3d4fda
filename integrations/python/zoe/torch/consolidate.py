"""Consolidation of a sharded zoe checkpoint without the ranks: the shards that ``save_checkpoint``
of a sharded zoe.torch optimizer wrote (one engine checkpoint per rank and the manifest naming
them) become one state dict in torch's layout of the optimizer's kind, the dict a sharded
optimizer's ``state_dict()`` returns on the live ranks. A sharded (or unsharded) optimizer of any
world size loads it with ``load_state_dict``: the way to move training to another world size.

Streaming: one rank's shard at a time is loaded into an engine of this process (its checksums
verified as on the ranks) and copied into the output. The memory is the output (the whole state,
as any state dict holds it) plus that engine's: with ``scratch_dir`` the engine keeps the shard
in swap files there and holds its pipeline buffers in DRAM, a few chunks of the size the ranks
used (their sub_group_size: a sub_group_size as large as the shard makes a chunk the whole
shard); without, it holds one rank's shard state (master and moments) in DRAM.

A stage 3 checkpoint (``pager.save_checkpoint``: parameter shards, each rank's optimizer over its
shards, and the values of the shards no param group holds) becomes {"model": the full parameters,
frozen ones too, "optimizer": the state dict above, over the parameters of its param groups}, the
same streaming, one rank at a time.

    python3 -m zoe.consolidate [--scratch-dir DIR] CHECKPOINT_DIR OUT.pt

``zoe.torch.consolidate_checkpoint(directory, out_path)`` does the same from Python.
"""

import argparse
import json
import os
import sys

import torch

from .. import _capi
from .. import errors as zoe_errors
from ..engine import BufferView, Engine
from .checkpoint import MANIFEST, _latest_of, read_manifest, shard_directory
from .ds_checkpoint import LATEST, find_save
from .ds_load import OPTIMIZER_DIR
from .config import engine_config
from .frozen_values import read_index, read_values
from .optim_kinds import kind_named
from .state_layout import unstepped_entry


def _kind_of(manifest):
    """The optimizer kind a manifest names (one written before Adagrad and Lion: AdamW's
    layout, which Adam shares)."""
    return _known_kind(manifest.get("optimizer", "AdamW"), "the manifest's optimizer")


def _known_kind(name, where):
    """The kind named ``name``; Corruption naming ``where`` for a name no kind has."""
    kind = kind_named(name)
    if kind is None:
        raise _corrupt(f"{where} is {name!r}, which is no optimizer zoe steps")
    return kind


def _corrupt(message):
    return zoe_errors.Corruption(_capi.Status.CORRUPTION, message)


class _GroupOutput:
    """One param group's consolidated state being filled: flat slots and per-parameter steps."""

    def __init__(self, layout, params, kind):
        self.count = layout["count"]
        self.shards = layout["shards"]
        self.shapes = [tuple(param["shape"]) for param in params]
        self.dtypes = [getattr(torch, param["dtype"]) for param in params]
        self.numels = [_numel(shape) for shape in self.shapes]
        self.offsets = [sum(self.numels[:index]) for index in range(len(params))]
        if sum(self.numels) != self.count:
            raise _corrupt(f"group {layout['name']!r}: its parameters hold {sum(self.numels)} "
                           f"elements, the manifest's count is {self.count}")
        self.kind = kind
        self.wanted = kind.slots(any(dtype != torch.float32 for dtype in self.dtypes))
        self.slots = {key: torch.empty(self.count, dtype=torch.float32)
                      for key, _ in self.wanted}
        self.steps = [0] * len(params)

    def take_steps(self, rank, segment_steps):
        """The step count of each parameter whose first element lies in rank's shard."""
        begin, end = self.shards[rank]
        if len(segment_steps) != len(self.numels):
            raise _corrupt(f"rank {rank}'s shard has {len(segment_steps)} segment step counts; "
                           f"the group has {len(self.numels)} parameters")
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels)):
            if numel > 0 and begin <= offset < end:
                self.steps[index] = int(segment_steps[index])

    def entries(self):
        """[per-parameter state], views of the flat slots (never stepped: unstepped_entry)."""
        result = []
        for index, (offset, numel, shape) in enumerate(zip(self.offsets, self.numels,
                                                            self.shapes)):
            if self.steps[index] == 0:
                result.append(unstepped_entry(self.kind, shape))
                continue
            entry = {"step": torch.tensor(float(self.steps[index]))}
            for key, values in self.slots.items():
                if key != "master_param" or self.dtypes[index] != torch.float32:
                    entry[key] = values[offset : offset + numel].view(shape)
            result.append(entry)
        return result


def _numel(shape):
    count = 1
    for size in shape:
        count *= size
    return count


def _engine_manifest(shard_dir):
    """The metadata of a rank's engine checkpoint: (group identities, per file name its
    metadata)."""
    path = os.path.join(shard_dir, _latest_of(shard_dir), "manifest.json")
    with open(path, encoding="utf-8") as file:
        manifest = json.load(file)
    files = {entry["name"]: entry.get("metadata", {}) for entry in manifest["files"]}
    return manifest["metadata"]["groups"], files


class _LoadedShard:
    """One rank's engine checkpoint loaded into an engine of this process (state in
    ``scratch_dir`` when given, else in DRAM): ``groups`` in the checkpoint's order, with their
    ``identities`` and per group its file's metadata (``segments``, ``segment_steps``)."""

    def __init__(self, shard_dir, scratch_dir):
        self.identities, files = _engine_manifest(shard_dir)
        self.files = [files[identity["name"] + ".state"] for identity in self.identities]
        config = engine_config("nvme" if scratch_dir else "cpu", nvme_path=scratch_dir)
        config["zero_optimization"]["sub_group_size"] = max(
            [identity["chunk_elements"] for identity in self.identities] + [1])
        self.engine = Engine(config)
        try:
            self.groups = [self._group(identity, meta)
                           for identity, meta in zip(self.identities, self.files)]
            self.engine.load_checkpoint(shard_dir)
        except BaseException:
            self.engine.close()
            raise

    def _group(self, identity, meta):
        # zeros: the load replaces them (a large one is mapped zero pages, not resident)
        seed = torch.zeros(identity["count"], dtype=torch.float32)
        return self.engine.optimizer_group(
            identity["name"], [BufferView(seed.data_ptr(), _capi.DType.FLOAT32, seed.numel())],
            type=_known_kind(identity["kind"], f"group {identity['name']!r}'s kind").name,
            moment_dtype=identity["state_dtype"],
            segments=meta["segments"],
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.engine.close()


def _read_shard(directory, manifest, rank, outputs, scratch_dir):
    """Loads rank's shard (_LoadedShard) and copies it into ``outputs``."""
    shard_dir = shard_directory(directory, manifest, rank)
    with _LoadedShard(shard_dir, scratch_dir) as shard:
        names = [identity["name"] for identity in shard.identities]
        if names != [g["name"] for g in manifest["groups"]]:
            raise _corrupt(f"rank {rank}'s shard {shard_dir!r} holds the groups {names}; the "
                           f"manifest names {[g['name'] for g in manifest['groups']]}")
        for identity, meta, output, group in zip(shard.identities, shard.files, outputs,
                                                 shard.groups):
            begin, end = output.shards[rank]
            if identity["count"] != end - begin:
                raise _corrupt(f"rank {rank}'s shard of {identity['name']!r} holds "
                               f"{identity['count']} elements; the manifest gives {end - begin}")
            for key, slot in output.wanted:
                if end > begin:
                    group.read_state(slot, 0, end - begin, output.slots[key][begin:].data_ptr())
            output.take_steps(rank, meta["segment_steps"])


# --- stage 3 -------------------------------------------------------------------------------


def _group_parameters(manifest):
    """Per param group, the indices into manifest["parameters"] of the parameters it holds, in
    its order (a manifest that does not list them: one group of every parameter)."""
    return manifest.get("group_parameters", [list(range(len(manifest["parameters"])))])


def _read_stage3_shard(directory, manifest, rank, full, steps, scratch_dir):
    """Copies rank's parameter shards (master weights, moments, step counts) into ``full`` (per
    slot key, per parameter a flat fp32 tensor) and ``steps``. The rank's optimizer stepped its
    non-empty shards group by group, in each group's order, one segment each."""
    shard_dir = shard_directory(directory, manifest, rank)
    params = manifest["parameters"]
    held = [index for group in _group_parameters(manifest) for index in group
            if params[index]["counts"][rank] > 0]
    with _LoadedShard(shard_dir, scratch_dir) as shard:
        pieces = [(group, offset, length, step)
                  for group, meta in zip(shard.groups, shard.files)
                  for offset, length, step in zip(_starts(meta["segments"]), meta["segments"],
                                                  meta["segment_steps"])]
        if [length for _, _, length, _ in pieces] != [params[i]["counts"][rank] for i in held]:
            raise zoe_errors.FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"rank {rank}'s optimizer in {shard_dir!r} holds segments of "
                f"{[length for _, _, length, _ in pieces]} elements; its parameter shards are "
                f"{[params[i]['counts'][rank] for i in held]}: allowed: an optimizer over "
                "pager.shard_parameters() or over some of them, its param groups as the "
                "manifest lists them",
            )
        for index, (group, offset, length, step) in zip(held, pieces):
            begin = sum(params[index]["counts"][:rank])
            for key, slot in _kind_of(manifest).slots(with_master=True):
                group.read_state(slot, offset, length, full[key][index][begin:].data_ptr())
            if step > 0:
                steps[index] = int(step)


def _frozen_values(directory, manifest):
    """{name: full values} of the parameters no param group held (``frozen_parameters``), from
    each rank's frozen values (frozen_values.py, checked against their sha256)."""
    params = manifest["parameters"]
    frozen = manifest.get("frozen_parameters", [])
    values = {index: torch.empty(_numel(params[index]["shape"]),
                                 dtype=getattr(torch, params[index]["dtype"]))
              for index in frozen}
    for rank in range(manifest["world_size"] if frozen else 0):
        shard_dir = shard_directory(directory, manifest, rank)
        held = [index for index in frozen if params[index]["counts"][rank] > 0]
        index = read_index(shard_dir)
        found = [(entry["index"], entry["numel"]) for entry in index["parameters"]]
        if found != [(i, params[i]["counts"][rank]) for i in held]:
            raise _corrupt(f"rank {rank}'s frozen values in {shard_dir!r} are of the "
                           f"parameters {found} (index, elements); the manifest's frozen "
                           f"parameters on that rank are {held}")
        for number, flat in read_values(shard_dir, index):
            begin = sum(params[number]["counts"][:rank])
            values[number][begin:begin + flat.numel()] = flat
    return {params[index]["name"]: tensor.view(tuple(params[index]["shape"]))
            for index, tensor in values.items()}


def _starts(lengths):
    starts, offset = [], 0
    for length in lengths:
        starts.append(offset)
        offset += length
    return starts


def _check_stage3_groups(directory, manifest):
    """FailedPrecondition unless the manifest's param groups are listed with their parameters
    (or, written before it listed them, there is one)."""
    groups = manifest.get("param_groups", [])
    listed = manifest.get("group_parameters")
    if (listed is None and len(groups) == 1) or (listed is not None
                                                 and len(listed) == len(groups)):
        return
    raise zoe_errors.FailedPrecondition(
        _capi.Status.FAILED_PRECONDITION,
        f"the stage 3 manifest of {directory!r} names {len(groups)} param groups and lists the "
        f"parameters of {'none' if listed is None else len(listed)}; allowed: a manifest "
        "pager.save_checkpoint wrote (one group, or each group with its parameters)",
    )


def _stage3_param_state(kind, param, full, index, step):
    """Torch's state of the parameter at ``index`` (None: never stepped, and the kind keeps
    nothing for it)."""
    shape, dtype = tuple(param["shape"]), getattr(torch, param["dtype"])
    if step == 0:
        return unstepped_entry(kind, shape)
    entry = {"step": torch.tensor(float(step))}
    entry.update({key: full[key][index].view(shape) for key, _ in kind.moments})
    if dtype != torch.float32:
        entry["master_param"] = full["master_param"][index].view(shape)
    return entry


def _stage3_state_dict(directory, manifest, scratch_dir):
    """A stage 3 checkpoint as {"model": {name: full parameter} (every name of a tied
    parameter), "optimizer": torch's layout of the optimizer's kind over its param groups, the
    parameters numbered group after group in each group's order (one group: the model's
    order)}."""
    _check_stage3_groups(directory, manifest)
    params = manifest["parameters"]
    kind = _kind_of(manifest)
    grouped = {index for group in _group_parameters(manifest) for index in group}
    full = {key: [torch.zeros(_numel(param["shape"]) if index in grouped else 0,
                              dtype=torch.float32) for index, param in enumerate(params)]
            for key, _ in kind.slots(with_master=True)}
    steps = [0] * len(params)
    for rank in range(manifest["world_size"]):
        _read_stage3_shard(directory, manifest, rank, full, steps, scratch_dir)
    model = {param["name"]: full["master_param"][index].view(tuple(param["shape"]))
             .to(getattr(torch, param["dtype"])) for index, param in enumerate(params)
             if index in grouped}
    model.update(_frozen_values(directory, manifest))
    for alias, name in manifest.get("tied", {}).items():
        model[alias] = model[name]
    state, groups, number = {}, [], 0
    for saved, members in zip(manifest["param_groups"], _group_parameters(manifest)):
        group = kind.normalized(dict(saved))
        group["params"] = list(range(number, number + len(members)))
        groups.append(group)
        for position, index in zip(group["params"], members):
            entry = _stage3_param_state(kind, params[index], full, index, steps[index])
            if entry is not None:
                state[position] = entry
        number += len(members)
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}}


def consolidated_state_dict(directory, scratch_dir=None):
    """The sharded checkpoint in ``directory`` as one state dict in torch's layout of the
    optimizer's kind (per parameter 'step' and its moments, for AdamW 'exp_avg' and 'exp_avg_sq',
    and 'master_param' for parameters that are not float32; the param groups' hyper-parameters),
    without the ranks. ``scratch_dir``: a directory for the swap files of the engine that loads
    each shard (see the module docstring); None keeps a shard in DRAM. A stage 3 checkpoint
    (pager.save_checkpoint) gives {"model": the full parameters by name, "optimizer": that state
    dict over the parameters in the model's order}: the model's state_dict() and the optimizer's of
    one process."""
    directory = _sharded_directory(directory)
    manifest = read_manifest(directory)
    if manifest.get("zero_stage") == 3:
        return _stage3_state_dict(directory, manifest, scratch_dir)
    if "params" not in manifest:
        raise zoe_errors.FailedPrecondition(
            _capi.Status.FAILED_PRECONDITION,
            f"the manifest of {directory!r} does not name the parameters' shapes (written by an "
            "older zoe); load it on its ranks and call the optimizer's state_dict() instead",
        )
    outputs = [_GroupOutput(layout, params, _kind_of(manifest))
               for layout, params in zip(manifest["groups"], manifest["params"])]
    for rank in range(manifest["world_size"]):
        _read_shard(directory, manifest, rank, outputs, scratch_dir)
    packed_groups, state, next_index = [], {}, 0
    for output, saved in zip(outputs, manifest["param_groups"]):
        packed = _kind_of(manifest).normalized(dict(saved))
        packed["params"] = list(range(next_index, next_index + len(output.numels)))
        packed_groups.append(packed)
        for offset, entry in enumerate(output.entries()):
            if entry is not None:
                state[next_index + offset] = entry
        next_index += len(output.numels)
    return {"state": state, "param_groups": packed_groups}


def _sharded_directory(directory):
    """``directory`` when it holds a sharded checkpoint; else, as DeepSpeed's zero_to_fp32
    takes the folder of a save, the optimizer folder of the save that initialize's engine
    wrote there: ``<directory>/optimizer`` of a tag's folder, or of the tag that
    ``<directory>/latest`` names."""
    if os.path.exists(os.path.join(directory, MANIFEST)):
        return directory
    if os.path.isdir(os.path.join(directory, OPTIMIZER_DIR)):
        return os.path.join(directory, OPTIMIZER_DIR)
    if os.path.isfile(os.path.join(directory, LATEST)):
        return os.path.join(find_save(directory, None), OPTIMIZER_DIR)
    return directory


def consolidate_checkpoint(directory, out_path, scratch_dir=None):
    """Writes consolidated_state_dict(directory, scratch_dir) to ``out_path`` with torch.save
    (through a temporary file renamed into place); returns the number of parameters with state."""
    state_dict = consolidated_state_dict(directory, scratch_dir)
    temporary = f"{out_path}.tmp"
    torch.save(state_dict, temporary)
    os.replace(temporary, out_path)
    return len(state_dict.get("optimizer", state_dict)["state"])


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python3 -m zoe.consolidate",
        description="Consolidates a sharded zoe checkpoint into one torch state dict "
        "(torch's layout of the optimizer's kind), without launching the ranks.",
    )
    parser.add_argument("checkpoint", help="the directory save_checkpoint wrote (the engine's: "
                        "its latest save, or a tag's folder in it; or a pager's or sharded "
                        "optimizer's)")
    parser.add_argument("out", help="the file to write (torch.save)")
    parser.add_argument("--scratch-dir", help="a directory for the swap files of the engine that "
                        "loads each rank's shard (default: the shard is held in DRAM)")
    args = parser.parse_args(argv)
    try:
        count = consolidate_checkpoint(args.checkpoint, args.out, args.scratch_dir)
    except (zoe_errors.Error, OSError) as error:
        print(f"zoe.consolidate: {error}", file=sys.stderr)
        return 1
    print(f"zoe.consolidate: {args.out}: the state of {count} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
