"""Mesh and hardware description: what the cost model knows about machines.

A `HardwareProfile` is per-device numbers (peak flop/s, memory bandwidth,
memory) plus two link levels: devices within a node talk over a fast link
(NVLink), nodes over a slower fabric (InfiniBand). A `MeshSpec` is a mesh's
axis names and sizes plus, per axis, the link bandwidth and latency of the
alpha-beta model. Axes are placed on links the way `jax.make_mesh` lays out
devices: the last (minor) axes vary fastest, so they fill a node first; an
axis whose devices span nodes uses the fabric. Every number can be
overridden (`HardwareProfile(...)`, `dataclasses.replace`, or
`MeshSpec(..., axis_bandwidth=..., axis_latency=...)`).

A mesh axis group (a set of mesh axes that one dim is sharded over) is
handled as a bit mask over the axes; `group_size[mask]`,
`group_bandwidth[mask]` (the slowest member link) and `group_latency[mask]`
are tables indexed by mask, so the cost model can be vectorised over many
candidate plans at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import jax
import numpy as np

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops: float            # per device, flop/s
    mem_bandwidth: float         # per device, bytes/s (elementwise work is bandwidth-bound)
    memory: float                # per device, bytes
    devices_per_node: int        # devices sharing the fast link
    intra_bandwidth: float       # bytes/s per device on the fast link
    intra_latency: float         # seconds per collective step on the fast link
    inter_bandwidth: float       # bytes/s per device across nodes
    inter_latency: float
    # XLA:CPU lowers reduce-scatter as all-reduce + slice; GPU emits it.
    reduce_scatter: bool = True
    # Collectives are a rendezvous of device threads (XLA:CPU): every kind
    # pays (n-1) latencies, an all-reduce no more than an all-gather
    # (`_ring.ring_time`); on links, an all-reduce is two ring passes.
    rendezvous: bool = False
    # XLA:CPU computes bfloat16 and float16 in float32 and, allowed excess
    # precision (its default), keeps the intermediates float32: only
    # arguments and results are 16-bit; it runs bfloat16 collectives in
    # float32 too (float16 ones stay float16). Measured: a bf16 step's
    # all-reduce bytes were twice the model's, its memory 1.6x; float16's
    # memory 1.6x.
    half_held_as_f32: bool = False


def cpu_profile(memory: float | None = None) -> HardwareProfile:
    """This class of machine: host 'devices' share one memory system, and a
    collective is a rendezvous of their threads, not a ring over wires.
    Latency as measured here (8 host devices on 2 cores, chains of 200
    dependent collectives on 64-byte shards, `benchmarks/cpu_collectives.py`):
    all-reduce, all-gather and reduce-scatter alike, 19-32 us for a group of
    2, 36-67 us of 4, 149-166 us of 8: 12-32 us per other device whatever
    the kind. The ring formulas' two passes made an all-reduce look twice as
    dear as an all-gather (and 1 us made a collective look nearly free next
    to compute)."""
    return HardwareProfile(
        name="cpu", peak_flops=5e10, mem_bandwidth=1e10, memory=memory or 24 * GiB,
        devices_per_node=1 << 20, intra_bandwidth=5e9, intra_latency=2.5e-5,
        inter_bandwidth=5e9, inter_latency=2.5e-5, reduce_scatter=False, rendezvous=True,
        half_held_as_f32=True)


def h100_profile() -> HardwareProfile:
    """8 x H100 SXM per node: NVLink 4 (450 GB/s/direction), 400 Gb/s IB per GPU."""
    return HardwareProfile(
        name="h100", peak_flops=989e12, mem_bandwidth=3.35e12, memory=80e9,
        devices_per_node=8, intra_bandwidth=450e9, intra_latency=3e-6,
        inter_bandwidth=50e9, inter_latency=1e-5)


def h200_profile() -> HardwareProfile:
    """8 x H200 per node: as H100 with 141 GB HBM3e at 4.8 TB/s."""
    return dataclasses.replace(h100_profile(), name="h200", mem_bandwidth=4.8e12, memory=141e9)


PROFILES = {"cpu": cpu_profile, "h100": h100_profile, "h200": h200_profile}
# GPU device kinds with a profile, by a word of `jax.Device.device_kind`
# ("NVIDIA H100 80GB HBM3", "NVIDIA H200"; a GH200 is an H200-class part).
_GPU_KINDS = (("H200", h200_profile), ("H100", h100_profile))


def device_profile(device=None) -> HardwareProfile:
    """The profile of the machine `device` is part of (default: the default
    backend's first device, which is where a device-free mesh's program
    would run): `cpu_profile` for host devices, each with its share of the
    host's memory; for a GPU, the profile its device kind names. Any other
    accelerator gets the H100 profile's speeds under its own kind, with a
    warning: JAX reports neither flop/s nor link speeds, so `profile=` is
    the way to give them. Memory is what the device's allocator may use
    (`memory_stats()["bytes_limit"]`, the share XLA preallocates), where it
    says; a plan sized to the card's full memory would run out of that."""
    device = jax.devices()[0] if device is None else device
    if device.platform == "cpu":
        # host devices (simulated ones too) share the host's memory: each
        # may use its share, or all of them together would not fit
        host = _host_memory()
        return cpu_profile(host / jax.local_device_count("cpu") if host else None)
    kind = str(device.device_kind)
    make = next((f for word, f in _GPU_KINDS if word in kind.upper()), None)
    if make is not None:
        profile = make()
    else:
        warnings.warn(f"jaxbackend: no hardware profile for {device.platform} device kind "
                      f"{kind!r}; planning with the H100 profile's flop/s and link speeds. "
                      f"Pass profile=jaxbackend.sharding.HardwareProfile(...) with this "
                      f"machine's numbers for plans made for it.", stacklevel=2)
        profile = dataclasses.replace(h100_profile(), name=f"h100-like ({kind})")
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    return dataclasses.replace(profile, memory=float(limit)) if limit else profile


def _host_memory() -> float | None:
    """Bytes of memory this process may use: the machine's, or its cgroup's
    limit where lower (a container); None where the OS does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):    # no sysconf (Windows)
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()                  # "max" where unlimited
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return float(total)


class MeshSpec:
    """Axis names, sizes and per-axis links of a device mesh (real or abstract)."""

    def __init__(self, axis_names, axis_sizes, profile: HardwareProfile | str | None = None, *,
                 axis_bandwidth: dict | None = None, axis_latency: dict | None = None,
                 mesh=None):
        self.axis_names = tuple(axis_names)
        self.axis_sizes = tuple(int(s) for s in axis_sizes)
        if len(self.axis_names) != len(self.axis_sizes):
            raise ValueError(f"MeshSpec: {len(self.axis_names)} axis names {self.axis_names} but "
                             f"{len(self.axis_sizes)} sizes {self.axis_sizes}; give one size per name.")
        self.mesh = mesh  # the jax Mesh, when built from one (needed to compile)
        if profile is None:   # the mesh's own devices' (`device_profile`)
            profile = device_profile(None if mesh is None else mesh.devices.flat[0])
        if isinstance(profile, str) and profile not in PROFILES:
            raise ValueError(f"profile={profile!r} is not a known machine ({', '.join(PROFILES)}); "
                             f"pass one of those names or a sharding.HardwareProfile(...).")
        if not isinstance(profile, (str, HardwareProfile)):
            raise TypeError(f"profile={profile!r} is of type {type(profile).__name__}; pass a name "
                            f"({', '.join(PROFILES)}) or a sharding.HardwareProfile(...).")
        self.profile = PROFILES[profile]() if isinstance(profile, str) else profile
        bw, lat = self._links()
        for name, d in (("axis_bandwidth", axis_bandwidth), ("axis_latency", axis_latency)):
            for k in d or {}:
                if k not in self.axis_names:
                    raise ValueError(f"MeshSpec: {name} names axis {k!r}, not one of {self.axis_names}.")
        self.axis_bandwidth = tuple((axis_bandwidth or {}).get(a, b) for a, b in zip(self.axis_names, bw))
        self.axis_latency = tuple((axis_latency or {}).get(a, t) for a, t in zip(self.axis_names, lat))
        self._tables()

    @classmethod
    def from_mesh(cls, mesh, profile: HardwareProfile | str | None = None, **kw) -> "MeshSpec":
        """From a `jax.sharding.Mesh` or `AbstractMesh` (axes should be
        AxisType.Auto); `profile` None: `device_profile` of its devices."""
        if isinstance(mesh, MeshSpec):
            return mesh
        names = tuple(mesh.axis_names)
        sizes = tuple(mesh.shape[a] for a in names)
        return cls(names, sizes, profile, mesh=mesh if isinstance(mesh, jax.sharding.Mesh) else None, **kw)

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes)

    def _links(self):
        # Minor axes fill a node first (jax.make_mesh's device order).
        p, inner = self.profile, 1
        bw, lat = [0.0] * len(self.axis_sizes), [0.0] * len(self.axis_sizes)
        for i in reversed(range(len(self.axis_sizes))):
            inner *= self.axis_sizes[i]
            intra = inner <= p.devices_per_node
            bw[i] = p.intra_bandwidth if intra else p.inter_bandwidth
            lat[i] = p.intra_latency if intra else p.inter_latency
        return bw, lat

    def _tables(self):
        n = len(self.axis_names)
        masks = range(1 << n)
        bits = [[i for i in range(n) if m >> i & 1] for m in masks]
        self.group_size = np.array([math.prod(self.axis_sizes[i] for i in b) for b in bits], np.float64)
        self.group_bandwidth = np.array([min((self.axis_bandwidth[i] for i in b), default=np.inf)
                                         for b in bits])
        self.group_latency = np.array([max((self.axis_latency[i] for i in b), default=0.0) for b in bits])

    def mask(self, axes) -> int:
        """Bit mask of a mesh axis name, tuple of names, or None."""
        if axes is None:
            return 0
        if isinstance(axes, str):
            axes = (axes,)
        m = 0
        if not isinstance(axes, tuple) or not all(isinstance(a, str) for a in axes):
            raise TypeError(f"mesh axes {axes!r}: give a mesh axis name, a tuple of names or None "
                            f"(the mesh's axes are {self.axis_names}).")
        for a in axes:
            if a not in self.axis_names:
                raise ValueError(f"mesh has no axis {a!r}; its axes are {self.axis_names}.")
            m |= 1 << self.axis_names.index(a)
        return m

    def axes(self, mask: int):
        """Inverse of `mask`: None, one name, or a tuple of names in mesh order."""
        names = tuple(a for i, a in enumerate(self.axis_names) if mask >> i & 1)
        return None if not names else names[0] if len(names) == 1 else names

    def __repr__(self):
        axes = ", ".join(f"{a}={s}" for a, s in zip(self.axis_names, self.axis_sizes))
        return f"MeshSpec({axes}; {self.profile.name})"


def auto_mesh(shape, axis_names, devices=None) -> jax.sharding.Mesh:
    """A real mesh with AxisType.Auto axes (jax.make_mesh defaults to Explicit)."""
    auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
    if devices is None:
        return jax.make_mesh(tuple(shape), tuple(axis_names), axis_types=auto)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), tuple(axis_names), axis_types=auto)


def abstract_mesh(shape, axis_names) -> jax.sharding.AbstractMesh:
    """A device-free mesh of any size, for planning without devices."""
    return jax.sharding.AbstractMesh(tuple(shape), tuple(axis_names),
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(axis_names))


def check_auto_axes(mesh) -> None:
    """A plan compiles with sharding constraints on its contractions, which
    JAX takes only on Auto mesh axes; `jax.make_mesh` makes Explicit ones by
    default (JAX 0.10), which fail deep inside JAX, so say so up front."""
    if not isinstance(mesh, jax.sharding.Mesh):
        what = ("an abstract mesh (it has no devices to compile for; plan on it with "
                "sharding.plan)" if isinstance(mesh, (jax.sharding.AbstractMesh, MeshSpec))
                else f"of type {type(mesh).__name__}")
        raise TypeError(f"mesh={mesh!r} is {what}; jb.jit needs a jax.sharding.Mesh of devices: "
                        f"jaxbackend.sharding.auto_mesh(shape, axis_names).")
    types = tuple(getattr(mesh, "axis_types", ()))
    bad = [n for n, t in zip(mesh.axis_names, types) if t != jax.sharding.AxisType.Auto]
    if bad:
        n = len(mesh.axis_names)
        raise ValueError(
            f"mesh axes ({', '.join(map(repr, bad))}) are not Auto (axis types "
            f"{tuple(t.name for t in types)}), and a sharding plan needs Auto axes to constrain "
            f"contractions; build it with jax.make_mesh(shape, names, "
            f"axis_types=(jax.sharding.AxisType.Auto,) * {n}) or jaxbackend.sharding.auto_mesh("
            f"shape, names).")
