"""zoe.torch.initialize's engine, its checkpoints (ds_engine.py's contract): the methods of
save_checkpoint, load_checkpoint, module_state_dict and save_16bit_model, mixed into
DeepSpeedEngine, over the engine's module, optimizer, schedule, loss scaler, counters and
process group."""

import os
import pickle

import torch

from .._collective_ops import agreed, differences
from . import ds_checkpoint, ds_checksums, ds_load
from .checkpoint import saved_param_groups
from .common import _invalid
from .ds_stage3 import check_module_state
from .lr_schedules import schedule_state
from .optimizer import ZoeOptimizer

MODEL_STATES = ds_checkpoint.MODEL_STATES
OPTIMIZER_DIR = ds_load.OPTIMIZER_DIR
TORCH_OPTIMIZER = ds_load.TORCH_OPTIMIZER
log = ds_checkpoint.log


def without_frozen(state, module, prefix=""):
    """``state`` (a state dict of ``module`` with keys ``prefix`` + name) without the
    parameters that do not require gradients, by the names named_parameters() gives them."""
    frozen = {prefix + name for name, param in module.named_parameters()
              if not param.requires_grad}
    for key in [key for key in state if key in frozen]:
        del state[key]
    return state


def _checked_client_state(client_state):
    """``client_state`` (None: {}) as a dict, checked to pickle as torch.save will pickle it:
    InvalidArgument naming what does not, before anything is written."""
    if client_state is None:
        return {}
    if not isinstance(client_state, dict):
        raise _invalid(f"client_state is a {type(client_state).__name__}; save_checkpoint takes "
                       "a dict (its values: whatever torch.save can pickle)")
    for key, value in client_state.items():
        try:
            pickle.dumps(value)
        except Exception as error:  # any failure to pickle: named, before the save begins
            raise _invalid(f"client_state[{key!r}] cannot be saved ({type(error).__name__}: "
                           f"{error}); save_checkpoint pickles client_state with torch.save: "
                           "keep only picklable values (numbers, strings, tensors, dicts and "
                           "lists of them, state_dict()s) there") from None
    return client_state


class EngineCheckpoints:
    """DeepSpeedEngine's checkpoints (see ds_engine.py's contract), over the engine's module,
    optimizer, lr_scheduler, loss_scaler, counters, process group (_group), stage 3 pages
    (_stage3) and settings (_training)."""

    def _agreed(self, what, step):
        """``step()`` on this rank; over ranks every rank's, and when one fails every rank
        raises together (_collective_ops.agreed), none left waiting."""
        if self._group is None:
            return step()
        return agreed(what, step, self._group)

    def _engine_state(self, client_state, exclude_frozen_parameters):
        module, schedule = self.module_state_dict(), self.lr_scheduler
        if exclude_frozen_parameters:
            without_frozen(module, self.module)
        return {
            "module": module,
            "lr_scheduler": None if schedule is None else schedule_state(schedule),
            "lr_scheduler_type": None if schedule is None else type(schedule).__name__,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "global_steps": self.global_steps, "global_samples": self.global_samples,
            "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
            "world_size": self.world_size, "zero_stage": self._training.zero_stage,
            "client_state": dict(client_state or {}),
        }

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """Saves everything training needs to resume to ``<save_dir>/<tag>`` (default tag
        ``global_step<N>``), crash-safe, and points ``<save_dir>/latest`` at it (unless
        save_latest is false); with ``exclude_frozen_parameters`` the module's parameters that
        do not require gradients are left out (a strict load then refuses the checkpoint:
        load it with load_module_strict=False). Every rank calls it. Returns True, as
        DeepSpeed's. Each step (beginning, the module's state, the optimizer's, the commit)
        is agreed: when it fails on any rank, every rank raises together naming the failing
        ranks and the cause (one process: the error itself; a full disk zoe.NoSpace), what
        the save wrote is removed, the saves before it and ``latest`` are unchanged and
        training goes on. A bad tag is refused before anything is written (InvalidArgument).
        Saving between the micro-batches of an accumulation logs a warning: their gradients
        are not saved."""
        self._check_open("save_checkpoint")
        client_state = self._agreed("checking the client_state of save_checkpoint",
                                    lambda: _checked_client_state(client_state))
        tag = f"global_step{self.global_steps}" if tag is None else tag
        where = f"the save of tag {str(tag)!r} in {save_dir!r}"
        self._check_same_call("save_checkpoint", "save_dir, tag, save_latest, "
                              "exclude_frozen_parameters", (os.path.abspath(save_dir), str(tag),
                                                           save_latest, exclude_frozen_parameters))
        self._warn_if_mid_accumulation(where)
        state = self._module_and_engine_state(where, client_state, exclude_frozen_parameters)
        try:
            partial = self._agreed(f"beginning {where}", lambda: ds_checkpoint.begin_save(
                save_dir, tag, self.global_rank, save_latest))
            written = self._agreed(f"writing the module's state of {where}",
                                   lambda: self._write_model_states(partial, state))
            written.update(self._save_optimizer(partial, where))
            self._agreed(f"committing {where}",
                         lambda: self._commit_save(save_dir, str(tag), written, save_latest))
        except BaseException:
            if self.global_rank == 0:
                ds_checkpoint.abandon_save(save_dir, str(tag))
            raise
        return True

    def _check_same_call(self, call, names, arguments):
        """InvalidArgument on every rank, before anything is written or loaded, when ``call``
        got other ``arguments`` (``names``) on other ranks: the ranks write or read one
        checkpoint together. A collective over several ranks."""
        if self._group is None:
            return
        differing = differences(arguments, self._group, f"the arguments of {call}")
        if differing is not None:
            raise _invalid(f"{call} was called with other arguments on other ranks ({names}: "
                           f"{differing}): every rank must call it with the same ones, as they "
                           "write or read one checkpoint together")

    def _module_and_engine_state(self, where, client_state, exclude_frozen_parameters):
        """What model_states.pt holds (_engine_state): at stage 3 gathered (a collective),
        else taken by every rank in an agreed step."""
        if self._stage3 is not None:
            return self._engine_state(client_state, exclude_frozen_parameters)
        return self._agreed(f"taking the module's state for {where}",
                            lambda: self._engine_state(client_state, exclude_frozen_parameters))

    def _warn_if_mid_accumulation(self, where):
        """Logs (rank 0) that a save between the micro-batches of a gradient accumulation
        keeps none of the gradients they accumulated, as DeepSpeed's keeps none."""
        gas = self.gradient_accumulation_steps()
        done = self.micro_steps % gas if self._boundary is None else None
        holding = any(self._accumulation.present(param) for param in self.module.parameters())
        if self.global_rank != 0 or not (done or holding):
            return
        after = (f"inside a gradient accumulation of {gas} micro-batches, {done} of them "
                 "stepped (step() called)" if done else
                 "between the micro-batches of a gradient accumulation")
        log.warning("%s comes %s: the gradients accumulated so far are not saved (DeepSpeed "
                    "does not save them either), so a run resumed from it takes its next "
                    "optimizer step with the remaining micro-batches' gradients only; save "
                    "after the step() that ends an accumulation to resume exactly", where, after)

    def _write_model_states(self, partial, state):
        """Rank 0 writes model_states.pt (ds_checkpoint.write_torch_file: a full disk is
        NoSpace); returns {name: (size, sha256)} of what it wrote and hashed."""
        if self.global_rank != 0:
            return {}
        return {MODEL_STATES: ds_checkpoint.write_torch_file(partial, MODEL_STATES, state)}

    def _commit_save(self, save_dir, tag, written, save_latest):
        """Rank 0 records the checksums of the files zoe's optimizer does not checksum
        (``written``: those hashed as they were written) and commits the save."""
        if self.global_rank == 0:
            ds_checksums.record_checksums(ds_checkpoint.partial_directory(save_dir, tag),
                                          written)
            ds_checkpoint.commit_save(save_dir, tag, save_latest)

    def _save_optimizer(self, directory, where):
        """zoe's sharded optimizer: every rank its shard (each step agreed by save_sharded); at
        stage 3 with the values of the frozen parameters (ds_stage3.Stage3.save); otherwise the
        ranks' optimizers are identical and rank 0 saves its own (agreed). Returns
        {name: (size, sha256)} of a file hashed as it was written."""
        path = os.path.join(directory, OPTIMIZER_DIR)
        if self._stage3 is not None:  # with the values of the frozen parameters
            self._stage3.save(path, self.optimizer, self.global_rank)
            return {}
        if self._sharded():
            self.optimizer.save_checkpoint(path)
            return {}

        def save_whole():
            if self.global_rank != 0:
                return {}
            if isinstance(self.optimizer, ZoeOptimizer):
                self.optimizer.save_checkpoint(path)
                return {}
            return {TORCH_OPTIMIZER: ds_checkpoint.write_torch_file(
                directory, TORCH_OPTIMIZER, self.optimizer.state_dict())}

        return self._agreed(f"saving the optimizer's state of {where}", save_whole)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """Loads the save ``tag`` (default: the one ``<load_dir>/latest`` names). Returns
        (its path, the client_state saved with it), or (None, None), with a logged warning,
        when ``load_dir`` has no ``latest`` and no tag is given. ``load_module_only`` loads
        the module alone; ``load_optimizer_states=False`` all but the optimizer. Then, as
        DeepSpeed's, the optimizer's master weights follow the loaded parameters and its
        moments stay. ``custom_load_fn(src=saved module state, dst=engine.module)`` loads the
        module instead of load_state_dict (at stage 3 inside the pager's materialized(): the
        whole model held at once).

        Everything is checked before anything changes (ds_load.py): the files against their
        checksums, the optimizer's kind and layout (the world size and stage it was saved
        at), its param groups, the module's keys and shapes, the schedule and loss scale. The
        optimizer loads first, all or nothing on every rank, then the module, the schedule,
        the loss scale and the counters, which cannot fail once checked: a failed load leaves
        the engine as it was (only a custom_load_fn that raises leaves what it did, after the
        optimizer loaded). Every step is agreed over the ranks."""
        self._check_open("load_checkpoint")
        path = self._agreed(f"finding the checkpoint in {load_dir!r}",
                            lambda: ds_checkpoint.find_save(load_dir, tag))
        self._check_same_call(
            "load_checkpoint", "the save found (its tag, or latest), load_module_strict, "
            "load_optimizer_states, load_lr_scheduler_states, load_module_only",
            (path and os.path.abspath(path), load_module_strict, load_optimizer_states,
             load_lr_scheduler_states, load_module_only))
        if path is None:
            if self.global_rank == 0:
                log.warning("load_checkpoint(%r): no 'latest' file there and no tag given: "
                            "nothing loaded (%s)", load_dir, ds_checkpoint.listing(load_dir))
            return None, None
        plan = ds_load.LoadPlan(load_module_strict, load_optimizer_states and not load_module_only,
                                not load_module_only, load_lr_scheduler_states, custom_load_fn)
        checked = self._agreed(f"checking the checkpoint {path!r}",
                               lambda: self._checked_load(path, plan))
        self._warn_if_holding_gradients(path)
        if plan.optimizer:
            self._load_optimizer(path, checked.torch_optimizer)
        self._load_module(checked.state["module"], plan)
        if plan.rest:
            self._load_rest(checked.state, plan)
        if isinstance(self.optimizer, ZoeOptimizer):  # stage 3: as _warn_if_holding_gradients
            self.optimizer.drop_streamed_gradients()
        return path, checked.state["client_state"]

    def _warn_if_holding_gradients(self, path):
        """Logs (rank 0) that a load between a backward and its step() keeps the gradients in
        .grad, as DeepSpeed's keeps them: the next step adds them to the loaded state's; at
        stage 3, that it drops those streamed into the optimizer's gradient stores."""
        if self.global_rank != 0:
            return
        if (isinstance(self.optimizer, ZoeOptimizer)
                and self.optimizer.holds_streamed_gradients()):
            log.warning("load_checkpoint(%r) comes after a backward whose gradients no step() "
                        "took: at stage 3 they wait in the optimizer's gradient stores, which "
                        "the load empties, so the next step takes the later micro-batches' "
                        "gradients only; load before the accumulation's first backward (or "
                        "after its step()) to resume exactly", path)
            return
        if all(param.grad is None for param in self.module.parameters()):
            return
        log.warning("load_checkpoint(%r) comes after a backward whose gradients no step() took: "
                    "they stay in .grad (as in DeepSpeed) and the next step adds them to the "
                    "loaded state's (under fp16 at the loss scale before the load); call "
                    "zero_grad() first to start the loaded step afresh", path)

    def _checked_load(self, path, plan):
        """ds_load's checks of the save in ``path`` for ``plan`` (this rank; changes nothing);
        returns the ds_load.Checked to load."""
        verified = ds_checksums.verify_checksums(
            path, lambda name: plan.optimizer or name == MODEL_STATES)
        if not verified and self.global_rank == 0:
            log.warning("%r has no checksum record (%s; a save of a zoe before it kept one): "
                        "its files load unverified", path, ds_checksums.RECORD)
        checked = ds_load.Checked(ds_load.read_model_states(path))
        if plan.optimizer:
            checked.torch_optimizer = self._check_optimizer(path, checked.state)
        if plan.custom_load_fn is None:
            self._check_module_state(checked.state["module"], plan.strict)
        if plan.rest:
            self._check_schedule_and_scale(path, checked.state, plan)
        return checked

    def _check_optimizer(self, path, state):
        """The optimizer's saved state checked for this optimizer (ds_load: its kind, the
        layout it was saved in, and a zoe optimizer's param groups); returns a torch
        optimizer's state dict, None for zoe's."""
        kind, sharding = ds_load.saved_sharding(path)
        is_zoe = isinstance(self.optimizer, ZoeOptimizer)
        ds_load.check_kind(path, kind, self.optimizer, is_zoe)
        if not is_zoe:
            return ds_load.torch_optimizer_state(path, self.optimizer)
        mine = None
        if self._sharded():
            mine = (3 if self._stage3 is not None else 1, self.world_size)
        ds_load.check_sharding(path, state, sharding,
                               (self._training.zero_stage, self.world_size, mine))
        directory = os.path.join(path, OPTIMIZER_DIR)
        groups, kind_name = saved_param_groups(directory, self._sharded())
        self.optimizer.check_loadable(groups, f"the checkpoint in {directory!r}", kind_name,
                                      created_now=True)
        return None

    def _check_module_state(self, module_state, strict):
        """The saved module state's keys (when ``strict``) and shapes checked against the
        module's, as load_state_dict would, before anything loads (RuntimeError as torch's)."""
        if self._stage3 is not None:
            check_module_state(self.module, module_state, strict)
            return
        expected = {key: tuple(value.shape) if torch.is_tensor(value) else None
                    for key, value in self.module.state_dict(keep_vars=True).items()}
        check_module_state(self.module, module_state, strict, expected)

    def _check_schedule_kind(self, path, state):
        """InvalidArgument when the saved schedule is of another kind than this engine's: its
        type, saved beside its state (in saves without it, its state's keys), differs. A torch
        schedule's load_state_dict takes any dict without a word."""
        mine = type(self.lr_scheduler).__name__
        saved_kind = state.get("lr_scheduler_type")
        saved_keys, my_keys = set(state["lr_scheduler"]), set(schedule_state(self.lr_scheduler))
        if saved_kind in (None, mine) and saved_keys == my_keys:
            return
        what = saved_kind or f"schedule with the state {sorted(saved_keys)}"
        raise _invalid(f"the checkpoint {path!r} holds the state of a {what} learning-rate "
                       f"schedule and this engine's is a {mine}: configure the schedule it was "
                       "saved with, or load it with load_lr_scheduler_states=False to keep this "
                       "engine's schedule as it is")

    def _check_schedule_and_scale(self, path, state, plan):
        """The schedule (when loaded) and the loss scaler take their saved states (tried and
        put back: ds_load.check_loadable). A schedule this engine has and the save has not is
        refused; a loss scale the save has not leaves this engine's (a warning)."""
        if plan.schedule and self.lr_scheduler is not None:
            if state.get("lr_scheduler") is None:
                schedule = type(self.lr_scheduler).__name__
                raise _invalid(f"the checkpoint {path!r} was saved without a learning-rate "
                               f"schedule and this engine has one ({schedule}): load it with "
                               "load_lr_scheduler_states=False to keep this engine's schedule "
                               "as it is")
            self._check_schedule_kind(path, state)
            ds_load.check_loadable(self.lr_scheduler, state["lr_scheduler"],
                                   "this engine's learning-rate schedule",
                                   "load it with load_lr_scheduler_states=False",
                                   state_of=schedule_state)
        if self.loss_scaler is None:
            return
        if state.get("loss_scaler") is None:
            if self.global_rank == 0:
                log.warning("the checkpoint %r was saved without fp16 loss scaling: the loss "
                            "scale stays this engine's (%s)", path, self.loss_scaler.loss_scale)
            return
        ds_load.check_loadable(self.loss_scaler, state["loss_scaler"],
                               "this engine's fp16 loss scaler",
                               "save and load with the same fp16 loss_scale setting")

    def _load_optimizer(self, path, torch_state):
        """The optimizer's saved state, all or nothing on every rank: zoe's sharded load is
        agreed and puts back every rank's state when one fails (checkpoint.load_shard), an
        unsharded one loads transactionally on each rank (agreed)."""
        directory = os.path.join(path, OPTIMIZER_DIR)
        if self._stage3 is not None:  # with the frozen parameters' values
            self._stage3.load(directory, self.optimizer)
        elif self._sharded():
            self.optimizer.load_checkpoint(directory)
        elif torch_state is not None:
            self._agreed(f"loading the optimizer's state of {path!r}",
                         lambda: self.optimizer.load_state_dict(torch_state))
        else:
            self._agreed(f"loading the optimizer's state of {path!r}",
                         lambda: self.optimizer.load_checkpoint(directory))

    def _load_module(self, state, plan):
        """The module's saved ``state`` (through ``custom_load_fn`` when given). The optimizer
        loaded before, when it did, and set the parameters it steps to its master weights:
        only the rest loads (a custom_load_fn's writes to them are replaced by the masters, as
        the optimizer's load replaced them before). Without the optimizer's state its master
        weights follow the loaded parameters: the optimizer takes writes from outside before its
        next step's gradients reach zoe (at stage 3 ds_stage3 writes the pages)."""
        zoe_optimizer = isinstance(self.optimizer, ZoeOptimizer)
        if self._stage3 is not None:
            self._stage3.load_module(state, self.optimizer, plan.strict, plan.custom_load_fn,
                                     plan.optimizer)
            return
        self._agreed("loading the module's state",
                     lambda: self._load_module_state(state, plan, zoe_optimizer))
        if zoe_optimizer and plan.optimizer and plan.custom_load_fn is not None:
            self.optimizer.write_back_masters()

    def _load_module_state(self, state, plan, zoe_optimizer):
        """This rank's part of _load_module: through custom_load_fn when given; without the
        parameters a zoe optimizer's load set; else the whole state."""
        if plan.custom_load_fn is not None:
            plan.custom_load_fn(src=state, dst=self.module)
        elif plan.optimizer and zoe_optimizer:
            self.module.load_state_dict(self._without_optimizer_parameters(state), strict=False)
        else:
            self.module.load_state_dict(state, strict=plan.strict)

    def _without_optimizer_parameters(self, state):
        """``state`` without the parameters the optimizer steps (its load set them)."""
        stepped = {id(param) for group in self.optimizer.param_groups for param in group["params"]}
        owned = {key for key, value in self.module.state_dict(keep_vars=True).items()
                 if id(value) in stepped}
        return type(state)((key, value) for key, value in state.items() if key not in owned)

    def _load_rest(self, state, plan):
        """The schedule, the loss scale and the counters (checked loadable already)."""
        if plan.schedule and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for key in ds_load.COUNTERS:
            setattr(self, key, state[key])

    def module_state_dict(self, destination=None, prefix="", keep_vars=False,
                          exclude_frozen_parameters=False):
        """The module's state dict, as module.state_dict(destination, prefix, keep_vars), with
        its parameters' current values: at stage 3 copies of the full values, gathered (a
        collective over the ranks; keep_vars does not apply). Without the parameters that do
        not require gradients when ``exclude_frozen_parameters``."""
        if self._stage3 is None:
            state = self.module.state_dict(destination=destination, prefix=prefix,
                                           keep_vars=keep_vars)
        else:
            state = self._stage3.module_state(destination, prefix)
        if exclude_frozen_parameters:
            without_frozen(state, self.module, prefix)
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """DeepSpeed's, for accelerate and Hugging Face's save at stage 3: the module's full
        state dict (module_state_dict(), on the CPU) on rank 0, None on the other ranks. Every
        rank calls it; InvalidArgument (a ValueError, as DeepSpeed's) below stage 3."""
        if self._stage3 is None:
            raise _invalid("_zero3_consolidated_16bit_state_dict needs zero_optimization.stage 3"
                           "; call module_state_dict() at the other stages")
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.global_rank != 0:
            return None
        return type(state)((key, value.cpu()) for key, value in state.items())

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False):
        """DeepSpeed's: the module's state dict (module_state_dict(): the full parameters at
        every stage, in the module's dtype, 16-bit under fp16 or bf16), without the parameters
        that do not require gradients when ``exclude_frozen_parameters``, written by rank 0 to
        ``<save_dir>/<save_filename>`` with torch.save, atomically (a save that fails keeps the
        previous file; a full disk is zoe.NoSpace). Every rank calls it (stage 3 gathers).
        Returns True."""
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        path = os.path.join(save_dir, save_filename)

        def save():
            if self.global_rank == 0:
                os.makedirs(save_dir, exist_ok=True)
                ds_checkpoint.replace_torch_file(path, state)

        self._agreed(f"saving the model to {path!r}", save)
        return True
