"""Memory limits for benchmarks and demos: a memory cgroup below this process's own (cgroup v2:
memory.max, with memory.swap.max 0; v1: memory.limit_in_bytes, and memory.memsw.limit_in_bytes
where swap is accounted) that a child process joins before it allocates, so that everything it
allocates counts. Making one needs write access to the cgroup hierarchy (root, usually):
``MemoryCgroup.possible()`` says whether it can be made here, and ``MemoryCgroup(...)`` raises
PermissionError / FileNotFoundError naming the folder otherwise.

    cgroup = MemoryCgroup(1 << 30, "my-run")
    subprocess.run([..., "--join-cgroup", cgroup.folder])   # the child: MemoryCgroup.join(folder)
    peak = cgroup.peak()
    cgroup.remove()
"""

import os
import time

CGROUP_V2 = "/sys/fs/cgroup"
CGROUP_V1 = "/sys/fs/cgroup/memory"


def parse_size(text):
    """Bytes from "1G", "512M", "3GiB", "64K" or a number."""
    text = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def own_cgroup():
    """(version, folder) of this process's memory cgroup, or (None, None) when none is mounted."""
    with open("/proc/self/cgroup") as lines:
        entries = [line.rstrip("\n").split(":", 2) for line in lines]
    for _, controllers, path in entries:
        if "memory" in controllers.split(",") and os.path.isdir(CGROUP_V1):
            return 1, CGROUP_V1 + path
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and not controllers:
            return 2, CGROUP_V2 + path
    return None, None


def _write(folder, name, value):
    with open(os.path.join(folder, name), "w") as out:
        out.write(str(value))


class MemoryCgroup:
    """A memory cgroup of ``limit`` bytes named ``name`` below this process's cgroup."""

    def __init__(self, limit, name):
        self.version, parent = own_cgroup()
        if self.version is None:
            raise FileNotFoundError("no memory cgroup is mounted (/proc/self/cgroup)")
        self.limit = int(limit)
        self.folder = os.path.join(parent, name)
        os.makedirs(self.folder, exist_ok=True)
        if self.version == 2:
            _write(self.folder, "memory.max", self.limit)
            if os.path.exists(os.path.join(self.folder, "memory.swap.max")):
                _write(self.folder, "memory.swap.max", 0)
        else:
            _write(self.folder, "memory.limit_in_bytes", self.limit)
            if os.path.exists(os.path.join(self.folder, "memory.memsw.limit_in_bytes")):
                _write(self.folder, "memory.memsw.limit_in_bytes", self.limit)

    @staticmethod
    def possible():
        """Whether a memory cgroup can be made here (one is mounted and this process may write
        below its own)."""
        version, parent = own_cgroup()
        return version is not None and os.access(parent, os.W_OK)

    @staticmethod
    def join(folder):
        """Moves the calling process into the cgroup at ``folder`` (a child, before it
        allocates)."""
        _write(folder, "cgroup.procs", os.getpid())

    def peak(self):
        """The cgroup's peak memory in bytes, or None where the kernel keeps none."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.folder, name)) as text:
                return int(text.read())
        except OSError:
            return None

    def remove(self):
        """Removes the cgroup once its processes have exited (their memory is uncharged shortly
        after they exit)."""
        for _ in range(50):
            try:
                os.rmdir(self.folder)
                return
            except OSError:
                time.sleep(0.1)
