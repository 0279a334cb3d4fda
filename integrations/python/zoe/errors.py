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


class InvalidArgument(Error, ValueError):
    """Bad input: a configuration key or value, a size, a dtype, a handle."""

    status = _capi.Status.INVALID_ARGUMENT


class NotFound(Error, LookupError):
    """A named thing (file, directory, tensor, group, key) does not exist."""

    status = _capi.Status.NOT_FOUND


class IoError(Error):
    """An I/O system call failed."""

    status = _capi.Status.IO


class NoSpace(Error):
    """The swap space or the file system is full."""

    status = _capi.Status.NO_SPACE


class Corruption(Error):
    """A checksum, magic number or version did not match."""

    status = _capi.Status.CORRUPTION


class OutOfMemory(Error):
    """An allocation failed or a memory budget cannot be met."""

    status = _capi.Status.OUT_OF_MEMORY


class NotSupported(Error):
    """The machine, kernel or library lacks a feature."""

    status = _capi.Status.NOT_SUPPORTED


class FailedPrecondition(Error):
    """A call in the wrong order, or on a closed object."""

    status = _capi.Status.FAILED_PRECONDITION


class Busy(Error):
    """Every resource that could satisfy the request is held."""

    status = _capi.Status.BUSY


class PermissionDenied(Error):
    """The file system refused access."""

    status = _capi.Status.PERMISSION_DENIED


class Aborted(Error):
    """Cancelled, or skipped."""

    status = _capi.Status.ABORTED


class Internal(Error):
    """A broken invariant inside zoe: a bug to report."""

    status = _capi.Status.INTERNAL


_BY_CODE = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        NotFound,
        IoError,
        NoSpace,
        Corruption,
        OutOfMemory,
        NotSupported,
        FailedPrecondition,
        Busy,
        PermissionDenied,
        Aborted,
        Internal,
    )
}


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
