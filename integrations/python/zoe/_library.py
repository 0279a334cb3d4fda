"""Locating and loading libzoe.so.

The search order is:

1. the ``ZOE_LIBRARY`` environment variable (a path to the library file);
2. the build trees of a source checkout: ``build/release/integrations`` first, then every
   ``build/*/integrations`` (most recently built first);
3. install trees relative to this package (``<prefix>/lib``, ``<prefix>/lib64`` and
   ``<prefix>/lib/<multiarch>`` for the prefixes above the package directory);
4. the dynamic linker's own search path (``ldconfig``, ``LD_LIBRARY_PATH``).

When nothing loads, :func:`load` raises ``OSError`` listing every place it looked.
"""

import ctypes
import glob
import os
import sysconfig
import threading

_LIBRARY_NAMES = ("libzoe.so", "libzoe.so.0")
_lock = threading.Lock()
_loaded = None


def _package_dir():
    return os.path.dirname(os.path.abspath(__file__))


def _build_tree_candidates():
    """libzoe.so files in the build trees of the checkout this package sits in."""
    # integrations/python/zoe -> the repository root is three levels up.
    root = os.path.normpath(os.path.join(_package_dir(), "..", "..", ".."))
    preferred = os.path.join(root, "build", "release", "integrations", "libzoe.so")
    others = glob.glob(os.path.join(root, "build", "*", "integrations", "libzoe.so"))
    others = sorted((p for p in others if p != preferred), key=os.path.getmtime, reverse=True)
    return [preferred] + others


def _install_tree_candidates():
    """libzoe.so in the library directories of the prefixes above the package."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    candidates = []
    prefix = _package_dir()
    for _ in range(6):  # <prefix>/lib/python3/dist-packages/zoe is five levels deep
        prefix = os.path.dirname(prefix)
        for libdir in ("lib", "lib64", os.path.join("lib", multiarch) if multiarch else None):
            if libdir:
                candidates.append(os.path.join(prefix, libdir, "libzoe.so"))
    return candidates


def candidates():
    """Every path :func:`load` tries, in order (the linker's own search comes last)."""
    override = os.environ.get("ZOE_LIBRARY")
    if override:
        return [override]
    return _build_tree_candidates() + _install_tree_candidates()


def load():
    """Returns the loaded library (a ``ctypes.CDLL``), loading it on the first call."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load_first()
        return _loaded


def _load_first():
    tried = []
    for path in candidates():
        if not os.path.exists(path):
            tried.append(f"{path} (absent)")
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as error:
            tried.append(f"{path} ({error})")
    if not os.environ.get("ZOE_LIBRARY"):
        for name in _LIBRARY_NAMES:
            try:
                return ctypes.CDLL(name)
            except OSError:
                tried.append(f"{name} (not on the dynamic linker's search path)")
    raise OSError(
        "zoe: cannot load libzoe.so; build it (cmake --preset release && cmake --build "
        "--preset release --target zoe) or set ZOE_LIBRARY to its path. Looked at:\n  "
        + "\n  ".join(tried)
    )
