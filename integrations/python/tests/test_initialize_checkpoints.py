"""zoe.torch.initialize's checkpoints as users break them: a bad tag is refused before anything is
written; a full disk (a write failing with ENOSPC, a file over RLIMIT_FSIZE, too little space
up front) is zoe.NoSpace and removes the save; every file zoe's optimizer does not checksum
itself is checksummed, and a changed byte is Corruption naming the file before anything loads;
a save killed between its two renames loads the copy it was replacing; a load that fails (a
damaged file, another optimizer, world size, stage or shape, a schedule the save lacks) changes
nothing and training continues exactly; a wrong load_dir or tag is an error naming it; a save
between micro-batches warns. On 2 ranks a save failing on one rank (beginning, the module's
state, the optimizer's, the commit) raises on both naming it, keeps the saves before it, and
training and later saves go on; a load failing on one rank changes no rank; a warm start at
stages 1 and 2 into an engine that stepped trains on."""

import copy
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import ACCUMULATION, MICRO, ds_config, make_model, module_values, \
    assert_same_state, train_engine
from test_initialize_api import HOWS, warm_start, warm_start_reference
from zoe.torch import ds_checkpoint, ds_checksums
from zoe.torch.common import TorchFileWriter

JOIN_SECONDS = 240
TESTS = os.path.dirname(os.path.abspath(__file__))


def start(stage=0, seed=0, world=1, model=None, **config_changes):
    """An engine over make_model(seed) (or ``model``) at ``stage``, the optimizer state in DRAM."""
    config = ds_config(stage, "cpu" if stage else "none", None, world,
                       "cpu" if stage == 3 else None)
    for key, value in config_changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    model = make_model(seed) if model is None else model
    engine, _, _, _ = zoe.torch.initialize(model=model, config=config)
    return engine


def snapshot(engine):
    """What a load may change: the module, the optimizer's state and hyper-parameters, the
    counters, the learning rate and the schedule."""
    return {"module": module_values(engine),
            "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
            "counters": (engine.global_steps, engine.global_samples, engine.micro_steps,
                         engine.skipped_steps),
            "lr": engine.get_lr(),
            "schedule": (None if engine.lr_scheduler is None
                         else copy.deepcopy(engine.lr_scheduler.state_dict()))}


def assert_equal(found, expected, where="state"):
    """Nested dicts, lists and tensors equal, bit for bit."""
    if torch.is_tensor(expected):
        assert torch.equal(found, expected), where
    elif isinstance(expected, dict):
        assert found.keys() == expected.keys(), where
        for key in expected:
            assert_equal(found[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(found) == len(expected), where
        for index, (a, b) in enumerate(zip(found, expected)):
            assert_equal(a, b, f"{where}[{index}]")
    else:
        assert found == expected, where


def assert_continues_exactly(engine, good, step, rank=0, world=1):
    """Optimizer step ``step`` from the engine's state, and again from ``good`` (a save of
    that state) loaded: the same parameters, bit for bit."""
    train_engine(engine, step, step + 1, rank, world)
    after = module_values(engine)
    engine.load_checkpoint(good)
    train_engine(engine, step, step + 1, rank, world)
    assert_same_state(module_values(engine), after, atol=0)


def flip(path, offset=None):
    """Flips a bit of the byte at ``offset`` (default: the middle) of the file ``path``."""
    offset = os.path.getsize(path) // 2 if offset is None else offset
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x40]))


def listing(directory):
    return sorted(os.listdir(directory))


# --- tags ----------------------------------------------------------------------------------------

BAD_TAGS = ["latest", "latest.tmp", "../escaped", "a/b", "/abs", "", ".", "..", ".hidden",
            "t.partial", "t.replaced", "a\0b", "x" * 300]


def test_a_bad_tag_is_refused_before_anything_is_written(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    engine = start()
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(ckpt, tag="good")
    before = (listing(ckpt), listing(tmp_path))
    for tag in BAD_TAGS:
        with pytest.raises(zoe.InvalidArgument, match="checkpoint tag .* is not allowed"):
            engine.save_checkpoint(ckpt, tag=tag)
        assert (listing(ckpt), listing(tmp_path)) == before, tag
        assert open(os.path.join(ckpt, "latest")).read() == "good"
    with pytest.raises(zoe.InvalidArgument, match="'../escaped' is not allowed"):
        engine.load_checkpoint(ckpt, tag="../escaped")
    engine.save_checkpoint(ckpt, tag=7)  # DeepSpeed's str(tag)
    assert engine.load_checkpoint(ckpt)[0] == os.path.join(ckpt, "7")
    engine.close()


def test_a_save_into_a_file_or_over_a_latest_folder_is_refused_before_anything_is_written(
        tmp_path):
    engine = start()
    train_engine(engine, 0, 1, 0, 1)
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    with pytest.raises(zoe.InvalidArgument, match=f"'{a_file}' is not a folder: save into a "):
        engine.save_checkpoint(str(a_file))
    assert a_file.read_text() == "kept"
    ckpt = tmp_path / "ckpt"
    (ckpt / "latest").mkdir(parents=True)
    (ckpt / "latest" / "mine").write_text("kept")
    with pytest.raises(zoe.InvalidArgument, match="latest' is not a file, and a save replaces "
                                                  "it .* or save with save_latest=False"):
        engine.save_checkpoint(str(ckpt), tag="t")
    assert listing(ckpt) == ["latest"] and listing(ckpt / "latest") == ["mine"]
    engine.save_checkpoint(str(ckpt), tag="t", save_latest=False)
    assert listing(ckpt) == ["latest", "t"]
    assert engine.load_checkpoint(str(ckpt), tag="t")[0] == str(ckpt / "t")
    engine.close()


# --- a full disk ---------------------------------------------------------------------------------

class FullDisk(TorchFileWriter):
    """A file that fills after ``room`` bytes: its writes then fail with ENOSPC."""

    room = 1024

    def __init__(self, file):
        super().__init__(_Filling(file, self.room))


class _Filling:
    def __init__(self, file, room):
        self._file, self._room = file, room

    def write(self, data):
        self._room -= memoryview(data).nbytes
        if self._room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._file.write(data)

    def flush(self):
        self._file.flush()


def test_a_disk_that_fills_while_model_states_is_written_is_no_space(tmp_path, monkeypatch):
    """torch's zip writer meets the ENOSPC of a file object (it used to abort the process:
    torch 1.13 throws in a destructor) and the save is NoSpace naming the directory."""
    ckpt = str(tmp_path / "ckpt")
    engine = start()
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(ckpt)
    saved = snapshot(engine)
    train_engine(engine, 1, 2, 0, 1)
    before = snapshot(engine)
    monkeypatch.setattr(ds_checkpoint, "TorchFileWriter", FullDisk)
    with pytest.raises(zoe.NoSpace, match=f"out of space in '{ckpt}' while writing .*"
                                          "model_states.pt.*free space there .*global_step1"):
        engine.save_checkpoint(ckpt, client_state={"blob": torch.zeros(10000)})
    with pytest.raises(zoe.NoSpace, match="out of space .* the file there before, if any, is "
                                          "unchanged"):
        engine.save_16bit_model(str(tmp_path), "model.bin")
    monkeypatch.undo()
    assert listing(ckpt) == ["global_step1", "latest"]  # the partial save removed
    assert listing(tmp_path) == ["ckpt"]
    assert_equal(snapshot(engine), before)
    train_engine(engine, 2, 3, 0, 1)
    engine.save_checkpoint(ckpt)  # once there is room again
    engine.load_checkpoint(ckpt, tag="global_step1")
    assert_equal(snapshot(engine), saved)
    engine.close()


def test_a_save_that_does_not_fit_is_refused_up_front(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    engine = start()
    train_engine(engine, 0, 1, 0, 1)
    monkeypatch.setattr(ds_checkpoint, "available_bytes", lambda directory: 1000)
    with pytest.raises(zoe.NoSpace, match=r"model_states.pt' needs about \d+ bytes but only "
                                          r"1000 bytes are available .* free at least"):
        engine.save_checkpoint(ckpt, client_state={"blob": torch.zeros(10000)})
    assert listing(ckpt) == []
    monkeypatch.undo()
    engine.save_checkpoint(ckpt)
    engine.close()


RLIMIT_SCRIPT = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, zoe, zoe.torch
    from initialize_script import ds_config, make_model, train_engine
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=ds_config())
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint({ckpt!r})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18))
    try:
        engine.save_checkpoint({ckpt!r}, client_state={{"blob": torch.zeros(1 << 18)}})
    except zoe.NoSpace as error:
        print("NoSpace:", error)
    engine.close()
""")


def test_a_file_over_the_size_limit_is_no_space_not_an_abort(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse model_states.pt's writes (EFBIG) part way: the
    process lives on and the save is NoSpace."""
    ckpt = str(tmp_path / "ckpt")
    script = RLIMIT_SCRIPT.format(tests=TESTS, ckpt=ckpt)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NoSpace: out of space in" in done.stdout and "model_states.pt" in done.stdout
    assert listing(ckpt) == ["global_step1", "latest"]


# --- checksums -----------------------------------------------------------------------------------

def saved_engine(ckpt, torch_optimizer=False, **config_changes):
    """An engine that stepped once and saved to ``ckpt`` (global_step1), then stepped again."""
    engine = engine_like(0, torch_optimizer=torch_optimizer, **config_changes)
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(ckpt)
    train_engine(engine, 1, 2, 0, 1)
    return engine


def wider_model():
    """make_model() with 32 hidden units instead of 16."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def engine_like(seed=1, model=None, torch_optimizer=False, **config_changes):
    """start(seed), over wider_model() for ``model="wider"``, or with a torch AdamW given to
    initialize for ``torch_optimizer``."""
    if model == "wider":
        return start(seed=seed, model=wider_model(), **config_changes)
    if torch_optimizer:
        model = make_model(seed)
        engine, _, _, _ = zoe.torch.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01),
            config=_without(ds_config(), "optimizer", "scheduler"))
        return engine
    return start(seed=seed, **config_changes)


def _without(config, *keys):
    """``config`` without ``keys``."""
    return {key: value for key, value in config.items() if key not in keys}


def test_the_checksum_record_covers_what_zoes_optimizer_does_not(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved_engine(ckpt).close()
    record = json.load(open(os.path.join(ckpt, "global_step1", ds_checksums.RECORD)))
    assert sorted(record["files"]) == ["model_states.pt", "optimizer/LATEST",
                                       "optimizer/v000001/manifest.json",
                                       "optimizer/zoe_torch_param_groups.json"]
    entry = record["files"]["model_states.pt"]
    path = os.path.join(ckpt, "global_step1", "model_states.pt")
    assert (entry["size"], entry["sha256"]) == ds_checksums.file_digest(path)


# (file to damage, how, the load's arguments, the engine's optimizer is torch's)
DAMAGES = {
    "module flipped": ("model_states.pt", flip, {}, False),
    "module flipped, module only": ("model_states.pt", flip, {"load_module_only": True}, False),
    "module truncated": ("model_states.pt", lambda path: os.truncate(path, 100), {}, False),
    "hyper-parameters edited": ("optimizer/zoe_torch_param_groups.json",
                                lambda path: open(path, "a").write(" "), {}, False),
    "torch optimizer flipped": ("optimizer.pt", flip, {}, True),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_changed_byte_is_corruption_naming_the_file_and_nothing_loads(damage, tmp_path):
    name, change, how, torch_optimizer = DAMAGES[damage]
    ckpt = str(tmp_path / "ckpt")
    engine = saved_engine(ckpt, torch_optimizer)
    good = str(tmp_path / "good")
    engine.save_checkpoint(good)
    change(os.path.join(ckpt, "global_step1", name))
    before = snapshot(engine)
    with pytest.raises(zoe.Corruption, match=f"{name}'.* (checksum mismatch|holds)"):
        engine.load_checkpoint(ckpt, **how)
    assert_equal(snapshot(engine), before)
    assert_continues_exactly(engine, good, 2)
    if torch_optimizer:  # the module alone does not need the damaged file
        assert engine.load_checkpoint(ckpt, load_module_only=True)[0] is not None
    engine.close()


def test_a_save_without_a_record_loads_with_a_warning(tmp_path, caplog):
    ckpt = str(tmp_path / "ckpt")
    engine = saved_engine(ckpt)
    engine.save_checkpoint(ckpt)
    for tag in ("global_step1", "global_step2"):  # as an older zoe saved them
        os.remove(os.path.join(ckpt, tag, ds_checksums.RECORD))
    saved_at = os.path.join(ckpt, "global_step1")
    with caplog.at_level(logging.WARNING, logger="zoe.torch"):
        assert engine.load_checkpoint(ckpt, tag="global_step1")[0] == saved_at
    assert f"{saved_at!r} has no checksum record" in caplog.text
    os.truncate(os.path.join(saved_at, "model_states.pt"), 100)
    before = snapshot(engine)
    with pytest.raises(zoe.Corruption, match="model_states.pt' is not a file torch.save wrote"):
        engine.load_checkpoint(ckpt, tag="global_step1")
    hyper = os.path.join(ckpt, "global_step2", "optimizer", "zoe_torch_param_groups.json")
    open(hyper, "w").close()
    with pytest.raises(zoe.Corruption, match="zoe_torch_param_groups.json' is not a zoe "
                                             "optimizer's param groups"):
        engine.load_checkpoint(ckpt, tag="global_step2")
    assert_equal(snapshot(engine), before)
    engine.close()


# --- a save killed between its renames -----------------------------------------------------------

def test_a_save_killed_between_its_renames_loads_the_copy_it_replaced(tmp_path, monkeypatch,
                                                                      caplog):
    ckpt = str(tmp_path / "ckpt")
    engine = start()
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(ckpt, tag="t")
    first = snapshot(engine)
    train_engine(engine, 1, 2, 0, 1)
    rename = os.replace

    def killed_after_moving_aside(source, target):
        rename(source, target)
        if target.endswith(".replaced"):
            raise KeyboardInterrupt("killed")  # the process dies here
    monkeypatch.setattr(ds_checkpoint.os, "replace", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(ckpt, tag="t")
    monkeypatch.undo()
    assert listing(ckpt) == ["latest", "t.replaced"]
    assert open(os.path.join(ckpt, "latest")).read() == "t"
    engine.save_checkpoint(ckpt, tag="other", save_latest=False)  # keeps the only copy of t
    loading = start(seed=1)
    with caplog.at_level(logging.WARNING, logger="zoe.torch"):
        path, _ = loading.load_checkpoint(ckpt)
    assert path == os.path.join(ckpt, "t.replaced") and "loading that copy" in caplog.text
    assert_equal(snapshot(loading), first)
    loading.save_checkpoint(ckpt, tag="t")  # a complete t again: the copy is removed
    assert listing(ckpt) == ["latest", "other", "t"]
    loading.close()
    engine.close()


# --- a load that fails changes nothing -----------------------------------------------------------

def flip_state_file(ckpt):
    flip(os.path.join(ckpt, "global_step1", "optimizer", "v000001", "zoe.0.state"))


STEP_LR = {"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}}


def drop_schedule_type(ckpt):
    """The save as one made before the schedule's type was saved beside its state (its checksum
    record updated, as that save's would be)."""
    path = os.path.join(ckpt, "global_step1", "model_states.pt")
    state = torch.load(path)
    del state["lr_scheduler_type"]
    torch.save(state, path)
    ds_checksums.record_checksums(os.path.dirname(path))


# (how the save's engine differs, how the loading one does, what changes the save, the load's
# arguments, the error)
FAILED_LOADS = {
    "damaged optimizer state": ({}, {}, flip_state_file, {},
                                (zoe.Corruption, "zoe.0.state: checksum mismatch")),
    "saved without a schedule": ({"scheduler": None}, {}, None, {},
                                 (zoe.InvalidArgument, "saved without a learning-rate schedule"
                                  ".*load_lr_scheduler_states=False")),
    "another schedule": ({}, {"scheduler": STEP_LR}, None, {},
                         (zoe.InvalidArgument, "holds the state of a WarmupLR learning-rate "
                          "schedule and this engine's is a StepLR.*load_lr_scheduler_states=")),
    "another schedule saved without its type": (
        {}, {"scheduler": STEP_LR}, drop_schedule_type, {},
        (zoe.InvalidArgument, r"holds the state of a schedule with the state "
         r"\['last_batch_iteration'\] learning-rate schedule and this engine's is a StepLR")),
    "another shape": ({}, {"model": "wider"}, None, {},
                      (RuntimeError, "size mismatch for 0.weight")),
    "a torch optimizer's engine": ({}, {"torch_optimizer": True}, None, {},
                                   (zoe.InvalidArgument, "holds a zoe.torch optimizer's state; "
                                    "this engine's optimizer is torch.optim.adamw.AdamW")),
}


@pytest.mark.parametrize("case", sorted(FAILED_LOADS))
def test_a_load_that_fails_changes_nothing_and_training_continues_exactly(case, tmp_path):
    saving, loading, change, how, (error, message) = FAILED_LOADS[case]
    ckpt, good = str(tmp_path / "ckpt"), str(tmp_path / "good")
    engine = start(**saving)
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(ckpt)
    engine.close()
    if change is not None:
        change(ckpt)
    engine = engine_like(**loading)
    train_engine(engine, 0, 2, 0, 1)
    engine.save_checkpoint(good)
    before = snapshot(engine)
    with pytest.raises(error, match=message):
        engine.load_checkpoint(ckpt, **how)
    assert_equal(snapshot(engine), before)
    assert_continues_exactly(engine, good, 2)
    engine.close()


# --- a wrong load_dir or tag ---------------------------------------------------------------------

def test_a_wrong_directory_or_tag_is_an_error_naming_it(tmp_path, caplog):
    ckpt = str(tmp_path / "ckpt")
    engine = saved_engine(ckpt)
    with pytest.raises(zoe.NotFound, match=f"'{ckpt}_typo' does not exist"):
        engine.load_checkpoint(ckpt + "_typo")
    latest = os.path.join(ckpt, "latest")
    with pytest.raises(zoe.InvalidArgument, match=f"'{latest}' is not a directory"):
        engine.load_checkpoint(latest)
    with pytest.raises(zoe.NotFound, match="has no save 'nope' .*its saves: global_step1"):
        engine.load_checkpoint(ckpt, tag="nope")
    open(latest, "w").write("global_step99")
    with pytest.raises(zoe.NotFound, match=f"no save 'global_step99' \\('{latest}'\\); its "
                                           "saves: global_step1"):
        engine.load_checkpoint(ckpt)
    open(latest, "w").close()
    with pytest.raises(zoe.Corruption, match="latest' is empty: it names no tag"):
        engine.load_checkpoint(ckpt)
    os.remove(latest)
    with caplog.at_level(logging.WARNING, logger="zoe.torch"):
        assert engine.load_checkpoint(ckpt) == (None, None)  # DeepSpeed's, with a warning
    assert "no 'latest' file there and no tag given: nothing loaded" in caplog.text
    assert engine.global_steps == 2
    engine.close()


# --- a save between micro-batches ----------------------------------------------------------------

def test_a_save_between_micro_batches_warns_that_their_gradients_are_not_saved(tmp_path,
                                                                                caplog):
    engine = start()
    x = torch.randn(MICRO, 8)
    with caplog.at_level(logging.WARNING, logger="zoe.torch"):
        engine.backward(engine(x).pow(2).mean())
        engine.step()  # micro-batch 1 of ACCUMULATION
        engine.save_checkpoint(str(tmp_path / "a"))
        assert f"inside a gradient accumulation of {ACCUMULATION} micro-batches, 1 of them " \
               "stepped (step() called)" in caplog.text
        assert "the gradients accumulated so far are not saved" in caplog.text
        caplog.clear()
        engine.backward(engine(x).pow(2).mean())
        engine.save_checkpoint(str(tmp_path / "before-step"))  # a backward without its step()
        assert "the gradients accumulated so far are not saved" in caplog.text
        caplog.clear()
        engine.step()  # the boundary
        engine.save_checkpoint(str(tmp_path / "b"))
        assert caplog.text == ""
        engine.set_gradient_accumulation_boundary(False)  # accelerate's loop
        engine.backward(engine(x).pow(2).mean())
        engine.save_checkpoint(str(tmp_path / "c"))
        assert "between the micro-batches of a gradient accumulation" in caplog.text
    engine.close()


def test_a_load_after_a_backward_warns_that_its_gradients_stay(tmp_path, caplog):
    engine = start()
    x = torch.randn(MICRO, 8)
    for _ in range(ACCUMULATION):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.save_checkpoint(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="zoe.torch"):
        engine.load_checkpoint(str(tmp_path))  # after the step: nothing held
        assert caplog.text == ""
        engine.backward(engine(x).pow(2).mean())
        engine.load_checkpoint(str(tmp_path))
        assert "comes after a backward whose gradients no step() took: they stay in .grad" \
            in caplog.text
    engine.close()


def test_a_stage3_load_after_a_backward_drops_its_streamed_gradients_and_warns(tmp_path,
                                                                                caplog):
    """Stage 3's gradients wait in the optimizer's stores, which the load empties: the next
    step is the one of an engine that loaded before the backward."""
    x, y = torch.randn(MICRO, 8), torch.randn(MICRO, 8) * 3
    engine = start(3)
    train_engine(engine, 0, 3, 0, 1)
    engine.save_checkpoint(str(tmp_path))
    reference = start(3, seed=1)
    reference.load_checkpoint(str(tmp_path))
    for micro in (x, y):
        reference.backward(reference(micro).pow(2).mean())
        reference.step()
    with caplog.at_level(logging.WARNING, logger="zoe.torch"):
        engine.backward(engine(torch.randn(MICRO, 8) * 5).pow(2).mean())
        engine.step()
        engine.load_checkpoint(str(tmp_path))
    assert "at stage 3 they wait in the optimizer's gradient stores, which the load empties" \
        in caplog.text
    for micro in (x, y):
        engine.backward(engine(micro).pow(2).mean())
        engine.step()
    assert_same_state(module_values(engine), module_values(reference), atol=0)
    engine.close()
    reference.close()


# --- 2 ranks -------------------------------------------------------------------------------------

class Injected:
    """Failures of one step of a save on one rank (the others run it as usual)."""

    @staticmethod
    def state(patch, engine):  # the module's state cannot be taken
        def failing(*args, **kwargs):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        patch.setattr(engine, "module_state_dict", failing)

    @staticmethod
    def begin(patch, engine):  # the partial folder cannot be created (a read-only directory)
        make = os.makedirs

        def refused(path, *args, **kwargs):
            if path.endswith(".partial"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return make(path, *args, **kwargs)
        patch.setattr(ds_checkpoint.os, "makedirs", refused)

    @staticmethod
    def module(patch, engine):  # the disk fills while model_states.pt is written
        patch.setattr(ds_checkpoint, "TorchFileWriter", FullDisk)

    @staticmethod
    def optimizer(patch, engine):  # zoe's engine cannot write the optimizer's state
        def failing(directory):
            raise zoe.IoError(zoe._capi.Status.IO, f"save checkpoint {directory}: EIO")
        patch.setattr(engine.optimizer.engine, "save_checkpoint", failing)

    @staticmethod
    def commit(patch, engine):  # the save cannot be synced
        def failing(root):
            raise OSError(errno.EIO, os.strerror(errno.EIO), root)
        patch.setattr(ds_checkpoint, "fsync_tree", failing)


# (step, the failing rank, the error that rank raises): every rank takes the module's state;
# rank 0 alone begins, writes the module's state and commits; at stage 2 every rank writes its
# shard of the optimizer, at stage 0 rank 0 alone
FAILURES = [("state", 1, zoe.IoError), ("begin", 0, zoe.PermissionDenied),
            ("module", 0, zoe.NoSpace), ("optimizer", 1, zoe.IoError), ("commit", 0, zoe.IoError)]


def save_failures(rank, out_dir, stage, world):
    """Each step of a save failing on one rank: every rank raises, naming it; the saves before
    stay, and training and a later save and load go on."""
    ckpt = os.path.join(out_dir, f"failing{stage}")
    engine = start(stage, world=world)
    train_engine(engine, 0, 1, rank, world)
    engine.save_checkpoint(ckpt, tag="a")
    saved = snapshot(engine)
    for step, (what, failing, error) in enumerate(FAILURES):
        if what == "optimizer" and stage == 0:
            failing = 0  # the one copy is rank 0's
        with pytest.MonkeyPatch.context() as patch:
            if rank == failing:
                getattr(Injected, what)(patch, engine)
            with pytest.raises(error if rank == failing else zoe.Aborted,
                               match=f"failed on rank {failing}"):
                engine.save_checkpoint(ckpt)
        if rank == 0:
            assert listing(ckpt) == ["a", "latest"], what
            assert open(os.path.join(ckpt, "latest")).read() == "a"
        train_engine(engine, 1 + step, 2 + step, rank, world)  # the ranks are still paired
    engine.save_checkpoint(ckpt, tag="b")
    engine.load_checkpoint(ckpt, tag="a")
    assert_equal(snapshot(engine), saved)
    assert engine.load_checkpoint(ckpt)[0] == os.path.join(ckpt, "b")
    engine.close()


def failed_loads(rank, out_dir, world):
    """A shard damaged on rank 1, and a checkpoint of another stage: every rank raises and no
    rank changes; training continues exactly."""
    ckpt, good = os.path.join(out_dir, "stage2"), os.path.join(out_dir, "good2")
    engine = start(2, world=world)
    train_engine(engine, 0, 2, rank, world)
    engine.save_checkpoint(ckpt)
    engine.save_checkpoint(good)
    dist.barrier()
    if rank == 0:
        flip(_damaged_copy(good, os.path.join(out_dir, "damaged2")))
    dist.barrier()
    train_engine(engine, 2, 3, rank, world)
    engine.save_checkpoint(good, tag="now")
    before = snapshot(engine)
    with pytest.raises(zoe.Corruption if rank == 1 else zoe.Aborted, match="on rank 1"):
        engine.load_checkpoint(os.path.join(out_dir, "damaged2"))
    assert_equal(snapshot(engine), before)
    _continues(engine, good, rank, world)
    engine.close()
    stage3 = start(3, world=world)
    train_engine(stage3, 0, 1, rank, world)
    before = snapshot(stage3)
    with pytest.raises(zoe.FailedPrecondition, match="saved at ZeRO stage 2 on 2 ranks, its "
                                                     "optimizer state sharded over 2 ranks at "
                                                     "stage 1 or 2; this engine is stage 3"):
        stage3.load_checkpoint(ckpt)
    assert_equal(snapshot(stage3), before)
    stage3.load_checkpoint(ckpt, load_module_only=True)  # the module alone loads anywhere
    stage3.close()
    # a save of one process (its optimizer state one copy) at stage 2 on the ranks: refused,
    # naming how to keep the optimizer's state
    stage2 = start(2, world=world)
    with pytest.raises(zoe.FailedPrecondition, match="saved at ZeRO stage 2 on 1 rank, its "
                                                     "optimizer state one copy; .* load it in "
                                                     "one process, torch.save its "
                                                     r"optimizer.state_dict\(\)"):
        stage2.load_checkpoint(os.path.join(out_dir, "one-process"))
    stage2.close()


def _damaged_copy(source, target):
    """A copy of the save ``source``; returns the path of its rank 1's optimizer state."""
    shutil.copytree(source, target)
    return os.path.join(target, "global_step2", "optimizer", "rank-1", "save-000001",
                        "v000001", "zoe.0.state")


def _continues(engine, good, rank, world):
    """assert_continues_exactly from the save tagged "now" in ``good``."""
    train_engine(engine, 3, 4, rank, world)
    after = module_values(engine)
    engine.load_checkpoint(good, tag="now")
    train_engine(engine, 3, 4, rank, world)
    assert_same_state(module_values(engine), after, atol=0)


def calls_that_differ(rank, out_dir, world):
    """save_checkpoint and load_checkpoint given another directory, tag or switch on rank 1:
    every rank refuses before anything is written or loaded, naming the arguments."""
    ckpt = os.path.join(out_dir, "differ")
    engine = start(2, world=world)
    train_engine(engine, 0, 1, rank, world)
    engine.save_checkpoint(ckpt, tag="good")
    before = snapshot(engine)
    differing = [dict(save_dir=os.path.join(out_dir, "elsewhere") if rank else ckpt),
                 dict(save_dir=ckpt, tag="t" if rank else "u"),
                 dict(save_dir=ckpt, tag="t", save_latest=rank == 0)]
    for arguments in differing:
        with pytest.raises(zoe.InvalidArgument, match="save_checkpoint was called with other "
                                                      "arguments on other ranks .* on rank 0; "):
            engine.save_checkpoint(**arguments)
        assert listing(ckpt) == ["good", "latest"]
        assert not os.path.exists(os.path.join(out_dir, "elsewhere"))
    train_engine(engine, 1, 2, rank, world)  # the ranks are still paired
    with pytest.raises(zoe.InvalidArgument, match="load_checkpoint was called with other "
                                                  "arguments on other ranks"):
        engine.load_checkpoint(ckpt, tag="good", load_optimizer_states=rank == 0)
    engine.save_checkpoint(ckpt, tag="later")
    with pytest.raises(zoe.InvalidArgument, match=r"differ/good', True.* on rank 0; .*differ/"
                                                  r"later', True.* on rank 1"):
        engine.load_checkpoint(ckpt, tag="later" if rank else "good")
    engine.load_checkpoint(ckpt, tag="good")
    assert_equal(snapshot(engine), before)
    engine.close()


def rank_worker(rank, out_dir, world):
    with gloo_rank(rank, world, f"{out_dir}/init", out_dir):
        calls_that_differ(rank, out_dir, world)
        for stage in (0, 2):
            save_failures(rank, out_dir, stage, world)
        failed_loads(rank, out_dir, world)
        for stage in (1, 2):  # a warm start into an engine that stepped
            config = os.path.join(out_dir, f"warm{stage}")
            os.makedirs(config, exist_ok=True)
            results = warm_start(stage, None, HOWS["module-only"], 1, config, rank, world)
            torch.save(results, os.path.join(out_dir, f"warm{stage}-rank{rank}.pt"))


def test_on_two_ranks(tmp_path):
    world = 2
    out_dir = str(tmp_path)
    one = start(2)
    train_engine(one, 0, 1, 0, 1)
    one.save_checkpoint(os.path.join(out_dir, "one-process"))
    one.close()
    spawn_ranks(rank_worker, (out_dir, world), world, out_dir, JOIN_SECONDS)
    for stage in (1, 2):
        loaded, final, saved, _ = torch.load(os.path.join(out_dir, f"warm{stage}-rank0.pt"))
        assert_same_state(loaded, saved, atol=0)
        assert_same_state(final, warm_start_reference(saved, None, 1, world))
    # a stage 2 save of 2 ranks in one process: refused naming both and the way out
    engine = start(2)
    train_engine(engine, 0, 1, 0, 1)
    before = snapshot(engine)
    with pytest.raises(zoe.FailedPrecondition, match="saved at ZeRO stage 2 on 2 ranks, .* this "
                                                     "engine is stage 2 on 1 rank, its "
                                                     "optimizer state one copy: .*"
                                                     "consolidate_checkpoint.* at stage 1 or 2 "
                                                     "on any number of ranks, or in one "
                                                     "process at any stage"):
        engine.load_checkpoint(os.path.join(out_dir, "stage2"))
    assert_equal(snapshot(engine), before)
    engine.load_checkpoint(os.path.join(out_dir, "stage2"), load_module_only=True)
    engine.close()
