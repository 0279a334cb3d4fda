"""zoe.Error and one subclass per zoe_status, raised by :func:`check` after every C call."""

import errno

from . import _capi


class Error(Exception):
    """A failed zoe call: ``code`` is the numeric zoe_status, ``message`` zoe_last_error()."""

    status = None  # the zoe_status of the subclass

    def __init__(self, code, message):
        super().__init__(code, message)
        self.code = int(code)
        self.message = message

    def __str__(self):
        return self.message

    def __reduce__(self):
        return (type(self), (self.code, self.message))


# One subclass of Error per zoe_status (zoe.h), with the Python exception it also is, if any.
_BY_CODE = {}


def _error_class(name, status, doc, *bases):
    """The Error subclass ``name`` for ``status``, registered for error_for()."""
    cls = type(name, (Error, *bases), {"status": status, "__doc__": doc, "__module__": __name__})
    _BY_CODE[status] = cls
    return cls


InvalidArgument = _error_class(
    "InvalidArgument",
    _capi.Status.INVALID_ARGUMENT,
    "Bad input: a configuration key or value, a size, a dtype, a handle.",
    ValueError,
)
NotFound = _error_class(
    "NotFound",
    _capi.Status.NOT_FOUND,
    "A named thing (file, directory, tensor, group, key) does not exist.",
    LookupError,
)
IoError = _error_class(
    "IoError",
    _capi.Status.IO,
    "An I/O system call failed.",
)
NoSpace = _error_class(
    "NoSpace",
    _capi.Status.NO_SPACE,
    "The swap space or the file system is full.",
)
Corruption = _error_class(
    "Corruption",
    _capi.Status.CORRUPTION,
    "A checksum, magic number or version did not match.",
)
OutOfMemory = _error_class(
    "OutOfMemory",
    _capi.Status.OUT_OF_MEMORY,
    "An allocation failed or a memory budget cannot be met.",
)
NotSupported = _error_class(
    "NotSupported",
    _capi.Status.NOT_SUPPORTED,
    "The machine, kernel or library lacks a feature.",
)
FailedPrecondition = _error_class(
    "FailedPrecondition",
    _capi.Status.FAILED_PRECONDITION,
    "A call in the wrong order, or on a closed object.",
)
Busy = _error_class(
    "Busy",
    _capi.Status.BUSY,
    "Every resource that could satisfy the request is held.",
)
PermissionDenied = _error_class(
    "PermissionDenied",
    _capi.Status.PERMISSION_DENIED,
    "The file system refused access.",
)
Aborted = _error_class(
    "Aborted",
    _capi.Status.ABORTED,
    "Cancelled, or skipped.",
)
Internal = _error_class(
    "Internal",
    _capi.Status.INTERNAL,
    "A broken invariant inside zoe: a bug to report.",
)


# errno -> the class zoe's C++ Status gives it (core/status.cc CodeForErrno); others are IoError.
_BY_ERRNO = {
    **dict.fromkeys((errno.ENOSPC, errno.EFBIG, errno.EDQUOT), NoSpace),
    **dict.fromkeys((errno.ENOENT, errno.ENOTDIR), NotFound),
    **dict.fromkeys((errno.EACCES, errno.EPERM, errno.EROFS), PermissionDenied),
    errno.ENOMEM: OutOfMemory,
    **dict.fromkeys((errno.EINVAL, errno.EBADF, errno.EFAULT), InvalidArgument),
    **dict.fromkeys((errno.ENOSYS, errno.EOPNOTSUPP), NotSupported),
    errno.EBUSY: Busy,
    errno.ECANCELED: Aborted,
}


def as_zoe_error(error, message):
    """``error`` (any exception) as zoe's, with ``message``: a zoe.Error keeps its class, an
    OSError gets the class of its errno (IoError where zoe names none), anything else is
    Internal."""
    if isinstance(error, Error):
        return type(error)(error.code, message)
    cls = _BY_ERRNO.get(error.errno, IoError) if isinstance(error, OSError) else Internal
    return cls(cls.status, message)


def error_for(code, message):
    """The exception for a status code (``Error`` itself for numbers zoe.h does not name)."""
    return _BY_CODE.get(code, Error)(code, message)


def check(status, what=None):
    """Raises the zoe.Error subclass for a non-OK ``status``, with zoe_last_error()'s message.

    ``what`` (optional) names the operation and is prepended to the message.
    """
    if status == _capi.Status.OK:
        return
    message = (_capi.zoe_last_error() or b"").decode("utf-8", "replace")
    if not message:
        message = _capi.zoe_status_string(status).decode("utf-8", "replace")
    if what:
        message = f"{what}: {message}"
    raise error_for(status, message)
