"""The engine, its tensors, traces, optimizer groups and checkpoints, over the C API.

Every handle keeps its engine alive; after :meth:`Engine.close` (idempotent) every call on the
engine or on one of its handles raises :class:`zoe.FailedPrecondition`. An engine is a context
manager; so are :meth:`Engine.trace` and :meth:`Tensor.acquired`.
"""

import atexit
import contextlib
import ctypes
import json
import os
import threading
import weakref
import dataclasses
from dataclasses import dataclass

from . import _capi
from ._capi import Access, DType, StateSlot, Tier
from .errors import FailedPrecondition, InvalidArgument, NotFound, check


def version():
    """The loaded library's version, "MAJOR.MINOR.PATCH"."""
    return _capi.zoe_version().decode()


def shard_range(count, rank, world_size):
    """``(begin, end)`` of the shard ``rank`` keeps of ``count`` elements cut among
    ``world_size`` ranks: zoe's one shard formula (zoe_shard_range), that of every sharded group
    and of zoe.torch's sharded parameters."""
    begin, end = ctypes.c_uint64(), ctypes.c_uint64()
    check(
        _capi.zoe_shard_range(int(count), int(rank), int(world_size), ctypes.byref(begin),
                              ctypes.byref(end)),
        "shard range",
    )
    return begin.value, end.value


def whole_chunks(nbytes, chunk_bytes):
    """The bytes a registered tensor of ``nbytes`` occupies in a tier: whole chunks of
    ``chunk_bytes`` (zoe.chunk_size; the tiers hold and move tensors by chunks)."""
    return -(-int(nbytes) // chunk_bytes) * chunk_bytes


def _config_text(config):
    """The configuration as a JSON string: from a dict, a JSON string, or a path to a file."""
    if config is None:
        return ""
    if isinstance(config, dict):
        return json.dumps(config)
    if isinstance(config, bytes):
        config = config.decode("utf-8")
    if isinstance(config, os.PathLike) or (
        isinstance(config, str) and config.strip() and not config.lstrip().startswith("{")
    ):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as file:
                return file.read()
        except FileNotFoundError:
            raise NotFound(
                _capi.Status.NOT_FOUND, f"configuration file {path!r} does not exist"
            ) from None
    if isinstance(config, str):
        return config
    raise InvalidArgument(
        _capi.Status.INVALID_ARGUMENT,
        f"config must be a dict, a JSON string or a path, not {type(config).__name__}",
    )


@dataclass(frozen=True)
class BufferView:
    """A host buffer of ``count`` elements of ``dtype`` at address ``data`` (borrowed)."""

    data: int
    dtype: DType
    count: int

    @staticmethod
    def from_numpy(array):
        """A view of a C-contiguous numpy array of float32 (or uint16 read as bfloat16)."""
        import numpy

        if not array.flags["C_CONTIGUOUS"]:
            raise InvalidArgument(_capi.Status.INVALID_ARGUMENT, "array must be C-contiguous")
        dtypes = {numpy.dtype("float32"): DType.FLOAT32, numpy.dtype("float16"): DType.FLOAT16,
                  numpy.dtype("uint16"): DType.BFLOAT16}
        if array.dtype not in dtypes:
            raise InvalidArgument(
                _capi.Status.INVALID_ARGUMENT,
                f"array dtype {array.dtype} is not supported; allowed: float32, float16, "
                "uint16 (bfloat16 bits)",
            )
        return BufferView(array.ctypes.data, dtypes[array.dtype], array.size)


def _views(views):
    """A ctypes array of zoe_buffer_view from BufferViews (None, 0 for an empty list)."""
    views = list(views)
    if not views:
        return None, 0
    array = (_capi.zoe_buffer_view * len(views))()
    for slot, view in zip(array, views):
        slot.data, slot.dtype, slot.count = view.data, int(view.dtype), view.count
    return array, len(views)


def _hyper_params_class():
    """``zoe.HyperParams``, a frozen dataclass with the members of ``struct zoe_hyper_params``
    in its order and ZOE_HYPER_PARAMS_INIT's defaults, except ``lr``, which a caller always
    gives."""
    members = []
    for name, _ in _capi.zoe_hyper_params._fields_[1:]:
        if name == "lr":
            members.append((name, float))
        else:
            default = _capi.zoe_hyper_params.DEFAULTS[name]
            members.append((name, float, dataclasses.field(default=default)))
    cls = dataclasses.make_dataclass("HyperParams", members, frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = "The hyper-parameters of one optimizer step (struct zoe_hyper_params)."
    return cls


HyperParams = _hyper_params_class()


def _c_hyper_params(hyper):
    """A pointer to ``hyper`` as a ``zoe_hyper_params``, or None for None (the group's)."""
    if hyper is None:
        return None
    values = [getattr(hyper, name) for name, _ in _capi.zoe_hyper_params._fields_[1:]]
    return ctypes.byref(_capi.zoe_hyper_params(*values))


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    skipped: bool
    grad_norm: float
    steps_taken: int
    bytes_read: int
    bytes_written: int
    seconds: float


# Every engine not closed yet: those still open when the interpreter exits are closed then, so
# that their swap files (an engine without zoe.nvme_paths swaps into a directory of its own
# under TMPDIR or /var/tmp) do not outlive a script that never called close().
_OPEN_ENGINES = weakref.WeakSet()


@atexit.register
def _close_open_engines():
    for engine in list(_OPEN_ENGINES):
        with contextlib.suppress(Exception):
            engine.close()


def check_config(config=None):
    """Reads ``config`` (as Engine takes it) as an engine would, creating nothing and logging
    nothing: InvalidArgument naming the key for an unknown key or a bad value (whether swap,
    pinned memory or the device can be had is not checked). Returns the warnings an engine
    would log for it (a list of str)."""
    out = ctypes.c_void_p()
    check(_capi.zoe_config_check(_config_text(config).encode("utf-8"), ctypes.byref(out)),
          "check configuration")
    return json.loads(_capi.take_string(out.value))


# The sections of a DeepSpeed configuration that zoe_config_normalize reads (DeepSpeed's pydantic
# sections; Megatron-DeepSpeed writes bf16 as bfloat16).
_PYDANTIC_SECTIONS = ("zero_optimization", "fp16", "bf16", "bfloat16", "hybrid_engine",
                      "tensor_parallel")


def normalize_deepspeed_config(document):
    """The DeepSpeed configuration ``document`` (a dict) as a fresh dict with the sections
    DeepSpeed reads through pydantic models read as those models read them, as an engine reads
    them first (zoe_config_normalize): quoted booleans and numbers converted to the key's type,
    zero_optimization's deprecated cpu_offload and cpu_offload_param replaced by the sections
    they stand for; "auto", None and every other key left as given, in the order given.
    InvalidArgument naming the key, the value and what is allowed for what pydantic refuses."""
    sections = {key: document[key] for key in _PYDANTIC_SECTIONS if key in document}
    out = ctypes.c_void_p()
    status = _capi.zoe_config_normalize(json.dumps(sections).encode("utf-8"), ctypes.byref(out))
    try:
        check(status)
    except InvalidArgument as error:  # the message alone, as zoe.torch's other refusals
        raise InvalidArgument(error.code, error.message.removeprefix("invalid argument: ")) \
            from None
    normalized = json.loads(_capi.take_string(out.value))
    return {key: _in_given_order(value, normalized[key]) if key in sections else value
            for key, value in document.items()}


def _in_given_order(given, normalized):
    """``normalized`` (a value of ``given`` read by zoe_config_normalize) with the keys of its
    objects in the order of ``given``'s, the keys it added (a deprecated switch's section) last."""
    if not (isinstance(given, dict) and isinstance(normalized, dict)):
        return normalized
    ordered = {key: _in_given_order(value, normalized[key])
               for key, value in given.items() if key in normalized}
    ordered.update((key, value) for key, value in normalized.items() if key not in ordered)
    return ordered


class Engine:
    """A zoe engine: tiers, tensors, optimizer groups.

    ``config``: None (defaults), a dict, a JSON string, or the path of a JSON file such as a
    DeepSpeed configuration (see docs/configuration.md). An engine still open when the
    interpreter exits is closed then (its swap files removed).
    """

    def __init__(self, config=None):
        self._lock = threading.Lock()
        self._handle = None
        text = _config_text(config)
        handle = _capi.zoe_engine_p()
        check(_capi.zoe_engine_create(text.encode("utf-8"), ctypes.byref(handle)), "create engine")
        self._handle = handle
        _OPEN_ENGINES.add(self)

    # --- lifetime ------------------------------------------------------------------------------

    def close(self):
        """Flushes nothing, waits for background work, frees memory and removes swap files.

        Idempotent. Every later call on the engine or its handles raises FailedPrecondition.
        """
        with self._lock:
            handle, self._handle = self._handle, None
        if handle:
            _capi.zoe_engine_destroy(handle)

    @property
    def closed(self):
        """True after close()."""
        return not self._handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None):
            self.close()

    def _h(self):
        handle = self._handle
        if not handle:
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION, "zoe engine is closed; create a new Engine"
            )
        return handle

    # --- engine-wide ---------------------------------------------------------------------------

    def _json_call(self, function, what):
        out = ctypes.c_void_p()
        check(function(self._h(), ctypes.byref(out)), what)
        return json.loads(_capi.take_string(out.value))

    def stats(self):
        """Statistics (bytes per link, prefetch hits, stalls, occupancy, per group) as a dict."""
        return self._json_call(_capi.zoe_engine_stats_json, "stats")

    @property
    def config(self):
        """The configuration in effect, every key with its value."""
        return self._json_call(_capi.zoe_engine_config_json, "config")

    @property
    def chunk_bytes(self):
        """zoe.chunk_size in effect: a registered tensor occupies whole chunks of it
        (whole_chunks)."""
        return int(self.config["zoe"]["chunk_size"])

    def flush(self):
        """Writes every dirty tensor down to NVMe and waits."""
        check(_capi.zoe_engine_flush(self._h()), "flush")

    def check_async_error(self):
        """Raises the first failure of background work since the last check, if any."""
        check(_capi.zoe_engine_async_error(self._h()), "background work")

    # --- tensors -------------------------------------------------------------------------------

    def register_tensor(self, name, nbytes, dtype=DType.FLOAT32, home=Tier.NVME, group=None):
        """Places a tensor of ``nbytes`` (zeros until written); returns its :class:`Tensor`."""
        desc = _capi.zoe_tensor_desc(
            name.encode("utf-8"),
            int(nbytes),
            int(dtype),
            int(home),
            group.encode("utf-8") if group else None,
        )
        out = _capi.zoe_tensor_id()
        check(
            _capi.zoe_tensor_register(self._h(), ctypes.byref(desc), ctypes.byref(out)),
            f"register tensor {name!r}",
        )
        return Tensor(self, out.value, name, int(nbytes), DType(dtype))

    def find_tensor(self, name):
        """The id of a registered tensor, as a :class:`Tensor` (size unknown: nbytes is None)."""
        out = _capi.zoe_tensor_id()
        check(_capi.zoe_tensor_find(self._h(), name.encode("utf-8"), ctypes.byref(out)))
        return Tensor(self, out.value, name, None, None)

    # --- traces --------------------------------------------------------------------------------

    def trace_begin(self, name):
        """Starts an iteration: recorded the first time under ``name``, replayed afterwards."""
        check(_capi.zoe_trace_begin(self._h(), name.encode("utf-8")), f"trace {name!r}")

    def trace_end(self):
        """Ends the iteration started by trace_begin."""
        check(_capi.zoe_trace_end(self._h()), "trace end")

    @contextlib.contextmanager
    def trace(self, name):
        """``with engine.trace("step"):`` brackets one iteration (see trace_begin)."""
        self.trace_begin(name)
        try:
            yield self
        finally:
            self.trace_end()

    def save_trace(self, name, path):
        """Writes the recorded trace ``name`` to ``path``."""
        check(
            _capi.zoe_trace_save(self._h(), name.encode("utf-8"), os.fsencode(path)),
            f"save trace {name!r}",
        )

    def load_trace(self, path):
        """Loads a trace written by save_trace; returns its name."""
        out = ctypes.c_void_p()
        check(_capi.zoe_trace_load(self._h(), os.fsencode(path), ctypes.byref(out)), "load trace")
        return _capi.take_string(out.value)

    # --- optimizer groups and checkpoints ------------------------------------------------------

    def optimizer_group(self, name, params, type="AdamW", **options):
        """Creates an optimizer group whose master weights start as ``params``.

        ``params``: BufferViews that, concatenated, are the group's parameters (borrowed for the
        call). ``type``: "AdamW", "Adam", "Adagrad" or "Lion". ``options``: lr, betas, eps,
        weight_decay, lr_decay (Adagrad), max_grad_norm, moment_dtype ("fp32", "bf16" or "int8"),
        segments (lengths of the segments, each with its own step count), speculative (allows
        speculate()), master ("params": the fp32 ``params`` ARE the master weights, updated in
        place and borrowed for the group's life: keep them alive and in place; "zoe", the default:
        a copy), as zoe_optim_group_create describes.
        """
        spec = {"name": name, "type": type}
        spec.update({key: value for key, value in options.items() if value is not None})
        if "betas" in spec:
            spec["betas"] = list(spec["betas"])
        array, n = _views(params)
        out = _capi.zoe_group_id()
        check(
            _capi.zoe_optim_group_create(
                self._h(), json.dumps(spec).encode("utf-8"), array, n, ctypes.byref(out)
            ),
            f"create optimizer group {name!r}",
        )
        segments = len(spec["segments"]) if "segments" in spec else 1
        group = OptimizerGroup(self, out.value, name, sum(view.count for view in params), segments)
        group.master_in_params = spec.get("master") == "params"
        return group

    def save_checkpoint(self, directory):
        """Saves every optimizer group to ``directory`` (streamed, crash-safe)."""
        check(_capi.zoe_checkpoint_save(self._h(), os.fsencode(directory)), "save checkpoint")

    def load_checkpoint(self, directory):
        """Loads a checkpoint of the same groups; on error the state is unchanged."""
        check(_capi.zoe_checkpoint_load(self._h(), os.fsencode(directory)), "load checkpoint")


class Tensor:
    """A registered tensor of an engine."""

    def __init__(self, engine, tensor_id, name, nbytes, dtype):
        self.engine = engine
        self.id = tensor_id
        self.name = name
        self.nbytes = nbytes
        self.dtype = dtype

    def __repr__(self):
        return f"zoe.Tensor({self.name!r}, id={self.id}, nbytes={self.nbytes})"

    def acquire(self, tier=Tier.HOST, access=Access.READ_WRITE):
        """Makes the tensor resident in ``tier``; returns its address, valid until release()."""
        out = ctypes.c_void_p()
        check(
            _capi.zoe_tensor_acquire(
                self.engine._h(), self.id, int(tier), int(access), ctypes.byref(out)
            ),
            f"acquire tensor {self.name!r}",
        )
        return out.value

    def release(self):
        """Undoes the most recent acquire."""
        check(_capi.zoe_tensor_release(self.engine._h(), self.id), f"release tensor {self.name!r}")

    def prefetch(self, tier=Tier.HOST):
        """Starts moving the tensor towards ``tier``; never blocks."""
        check(
            _capi.zoe_tensor_prefetch(self.engine._h(), self.id, int(tier)),
            f"prefetch tensor {self.name!r}",
        )

    def evict(self):
        """Moves the tensor out of DEVICE and HOST (writing it to NVMe when dirty)."""
        check(_capi.zoe_tensor_evict(self.engine._h(), self.id), f"evict tensor {self.name!r}")

    @contextlib.contextmanager
    def acquired(self, tier=Tier.HOST, access=Access.READ_WRITE):
        """``with t.acquired() as buf:`` a writable memoryview of the tensor's bytes."""
        if self.nbytes is None:
            raise InvalidArgument(
                _capi.Status.INVALID_ARGUMENT, f"size of tensor {self.name!r} is unknown"
            )
        address = self.acquire(tier, access)
        try:
            yield memoryview((ctypes.c_char * self.nbytes).from_address(address)).cast("B")
        finally:
            self.release()


class OptimizerGroup:
    """An optimizer group: fp32 master weights and moments placed per the engine config."""

    def __init__(self, engine, group_id, name, count, segments=1):
        self.engine = engine
        self.id = group_id
        self.name = name
        self.count = count
        self.segments = segments
        self.master_in_params = False  # the master is the caller's parameters (master="params")

    def __repr__(self):
        return f"zoe.OptimizerGroup({self.name!r}, id={self.id}, count={self.count})"

    def step(self, hyper=None, grads=(), params_out=(), loss_scale=1.0):
        """One step. ``hyper``: HyperParams or None (keep the group's); ``grads`` and
        ``params_out``: BufferViews covering the group (``grads`` empty: those accumulated; a
        grads view with data 0 or None: no gradient for those elements, whole segments).
        Returns a :class:`StepResult`; a non-finite gradient skips the step (``skipped``)."""
        c_hyper = _c_hyper_params(hyper)
        grad_array, n_grads = _views(grads)
        param_array, n_params = _views(params_out)
        out = _capi.zoe_step_result()
        check(
            _capi.zoe_optim_step(
                self.engine._h(), self.id, c_hyper, grad_array, n_grads, param_array, n_params,
                float(loss_scale), ctypes.byref(out),
            ),
            f"step of optimizer group {self.name!r}",
        )
        return StepResult(
            bool(out.skipped), out.grad_norm, out.steps_taken, out.bytes_read,
            out.bytes_written, out.seconds,
        )

    def speculate(self, hyper=None, params_out=(), loss_scale=1.0):
        """Starts a speculative step (a group created with ``speculative=True``): the chunks
        whose gradients accumulate_grad completes from now on are updated at once, into a copy
        the step only keeps if it turns out final. The next step() commits them, recomputes them
        (clipping active, or other hyper-parameters, parameter views or loss scale) or discards
        them (a non-finite gradient), with the same result as a step without speculation.
        ``hyper``, ``params_out`` and ``loss_scale`` are what that step will be given."""
        c_hyper = _c_hyper_params(hyper)
        param_array, n_params = _views(params_out)
        check(
            _capi.zoe_optim_speculate(
                self.engine._h(), self.id, c_hyper, param_array, n_params, float(loss_scale)
            ),
            f"speculate in optimizer group {self.name!r}",
        )

    def speculation_stats(self):
        """What speculation did since the group was created: a dict of steps,
        chunks_speculative, chunks_committed, chunks_recomputed and chunks_discarded."""
        out = _capi.zoe_speculation_stats()
        check(
            _capi.zoe_optim_group_speculation_stats(self.engine._h(), self.id, ctypes.byref(out)),
            f"speculation statistics of group {self.name!r}",
        )
        return {
            name: getattr(out, name)
            for name, _ in _capi.zoe_speculation_stats._fields_
            if name != "struct_size"
        }

    def accumulate_grad(self, offset, grad):
        """Hands over the gradients of elements [offset, offset + grad.count) early (borrowed
        until the step that uses them returns)."""
        array, _ = _views([grad])
        check(
            _capi.zoe_optim_accumulate_grad(self.engine._h(), self.id, int(offset), array),
            f"accumulate gradient of group {self.name!r}",
        )

    def discard_grads(self):
        """Drops the gradients handed over with accumulate_grad since the last step (the state
        is unchanged; the next step needs gradients again)."""
        check(_capi.zoe_optim_discard_grads(self.engine._h(), self.id),
              f"discard the gradients of group {self.name!r}")

    def grad_sum_squares(self):
        """The sum of squares of the gradients handed over with accumulate_grad since the last
        step, as the step scans them (inf or NaN when one is not finite); FailedPrecondition
        until they cover the group."""
        out = ctypes.c_double(0.0)
        check(_capi.zoe_optim_grad_sum_squares(self.engine._h(), self.id, ctypes.byref(out)),
              f"sum the squares of the gradients of group {self.name!r}")
        return out.value

    def read_state(self, slot, offset, count, out_address):
        """Copies ``count`` fp32 elements of a state array from ``offset`` to ``out_address``."""
        check(
            _capi.zoe_optim_state_read(
                self.engine._h(), self.id, int(slot), int(offset), int(count), out_address
            ),
            f"read {StateSlot(slot).name.lower()} of group {self.name!r}",
        )

    def write_state(self, slot, offset, count, values_address):
        """Copies ``count`` fp32 elements from ``values_address`` into a state array."""
        check(
            _capi.zoe_optim_state_write(
                self.engine._h(), self.id, int(slot), int(offset), int(count), values_address
            ),
            f"write {StateSlot(slot).name.lower()} of group {self.name!r}",
        )

    @property
    def steps(self):
        """Steps taken (skipped ones excluded); settable (for loading a state dict)."""
        out = ctypes.c_int64()
        check(_capi.zoe_optim_group_steps(self.engine._h(), self.id, ctypes.byref(out)))
        return out.value

    @steps.setter
    def steps(self, value):
        check(_capi.zoe_optim_group_set_steps(self.engine._h(), self.id, int(value)))

    @property
    def segment_steps(self):
        """The step count of each segment, a list; settable (one count per segment, the group's
        steps become the largest)."""
        out = (ctypes.c_int64 * self.segments)()
        check(
            _capi.zoe_optim_group_segment_steps(self.engine._h(), self.id, out, self.segments),
            f"segment steps of group {self.name!r}",
        )
        return list(out)

    @segment_steps.setter
    def segment_steps(self, values):
        values = [int(value) for value in values]
        array = (ctypes.c_int64 * len(values))(*values)
        check(
            _capi.zoe_optim_group_set_segment_steps(self.engine._h(), self.id, array, len(values)),
            f"set segment steps of group {self.name!r}",
        )
