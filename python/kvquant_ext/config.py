"""Compression configs (validated dataclasses) and named presets.

Each config knows how to compress one block (``compress(x, role)``) and how to stream
tokens into a cache (``new_stream(role)``), so a new method plugs in by adding a config
class; :class:`kvquant_ext.KVCache` and :func:`kvquant_ext.compress` never special-case
methods.  C++ only ever receives ints and floats taken from these objects.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Type

ROLES = ("key", "value")

_REGISTRY: Dict[str, Type["CompressionConfig"]] = {}


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"argument 'role' must be 'key' or 'value', got {role!r}")
    return role


@dataclass(frozen=True)
class QuantSpec:
    """How one role is group-quantized: bits, group size (-1 = whole axis), grouping."""

    bits: int
    group_size: int
    per_channel: bool

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"argument 'bits' must be 2, 4 or 8, got {self.bits}")
        if not (self.group_size == -1 or self.group_size > 0):
            raise ValueError(f"argument 'group_size' must be positive or -1, got {self.group_size}")
        if not self.per_channel and self.group_size != -1:
            g = self.group_size
            if g < 8 or g & (g - 1):
                raise ValueError(
                    f"argument 'group_size' must be a power of two >= 8 for per-token grouping, got {g}")


@dataclass(frozen=True)
class CompressionConfig:
    """Base of every config.  Subclasses implement ``compress`` and ``new_stream``."""

    version: ClassVar[int] = 1
    method: ClassVar[str] = "base"

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        _REGISTRY[cls.__name__] = cls

    # -- behaviour ---------------------------------------------------------------
    def compress(self, x, role: str, *, check_finite: bool = True):
        raise NotImplementedError

    def new_stream(self, role: str, *, check_finite: bool = True):
        raise NotImplementedError

    # -- serialisation -----------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["__class__"] = type(self).__name__
        d["__version__"] = self.version
        return d

    @staticmethod
    def from_dict(d: dict) -> "CompressionConfig":
        d = dict(d)
        cls = _REGISTRY[d.pop("__class__")]
        d.pop("__version__", None)
        return cls(**d)


@dataclass(frozen=True)
class FP16Config(CompressionConfig):
    """No compression: tokens are kept in their input dtype (the reference)."""

    method: ClassVar[str] = "fp16"

    def compress(self, x, role, *, check_finite=True):
        from .compressed import FullPrecision
        _check_role(role)
        return FullPrecision(x)

    def new_stream(self, role, *, check_finite=True):
        from .streams import FullPrecisionStream
        _check_role(role)
        return FullPrecisionStream()


@dataclass(frozen=True)
class GroupQuantConfig(CompressionConfig):
    """Generic asymmetric group quantization of keys and values with a full-precision
    residual window (``residual_length`` tokens, KIVI's streaming rule).

    Per-channel keys use the block-flush rule (buffer of R tokens, quantized when full);
    per-token roles use a FIFO of the last R tokens.  Specialised below as KIVI, KCVT,
    naive per-token INT-b and FlexGen-style group quantization.
    """

    bits: int = 4
    key_group_size: int = 32
    value_group_size: int = 32
    key_per_channel: bool = True
    value_per_channel: bool = False
    residual_length: int = 128
    method: ClassVar[str] = "group"

    def __post_init__(self):
        ks, vs = self.key_spec(), self.value_spec()  # validates
        if self.residual_length < 0:
            raise ValueError(f"argument 'residual_length' must be >= 0, got {self.residual_length}")
        for spec, role in ((ks, "key"), (vs, "value")):
            if spec.per_channel:
                if self.residual_length == 0:
                    raise ValueError(
                        f"argument 'residual_length' must be > 0 with per-channel {role}s "
                        "(tokens are quantized R at a time)")
                if spec.group_size != -1 and self.residual_length % spec.group_size:
                    raise ValueError(
                        f"argument 'residual_length' ({self.residual_length}) must be a multiple "
                        f"of the {role} group size ({spec.group_size})")

    def key_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.key_group_size, self.key_per_channel)

    def value_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.value_group_size, self.value_per_channel)

    def spec(self, role: str) -> QuantSpec:
        return self.key_spec() if _check_role(role) == "key" else self.value_spec()

    def compress(self, x, role, *, check_finite=True):
        from .compressed import GroupQuantized
        return GroupQuantized.from_tensor(x, self.spec(role), check_finite=check_finite)

    def new_stream(self, role, *, check_finite=True):
        from .streams import BlockFlushStream, FifoStream
        spec = self.spec(role)
        if spec.per_channel:
            # In a stream each flushed block of R tokens is quantized on its own, so a
            # whole-axis (KCVT) channel group becomes "the whole block": G = R.
            if spec.group_size == -1:
                spec = QuantSpec(spec.bits, self.residual_length, True)
            return BlockFlushStream(spec, self.residual_length, check_finite=check_finite)
        return FifoStream(spec, self.residual_length, check_finite=check_finite)


class KIVIConfig(GroupQuantConfig):
    """KIVI: per-channel keys (G tokens), per-token values (G channels), residual R."""

    method: ClassVar[str] = "kivi"

    def __init__(self, bits: int = 2, group_size: int = 32, residual_length: int = 128, **kw):
        super().__init__(bits=bits, key_group_size=group_size, value_group_size=group_size,
                         key_per_channel=True, value_per_channel=False,
                         residual_length=residual_length)

    @property
    def group_size(self) -> int:
        return self.key_group_size

    def to_dict(self):
        return {"__class__": "KIVIConfig", "__version__": self.version, "bits": self.bits,
                "group_size": self.group_size, "residual_length": self.residual_length}


class KCVTConfig(GroupQuantConfig):
    """KCVT: one scale/zero per whole key channel and per whole value token."""

    method: ClassVar[str] = "kcvt"

    def __init__(self, bits: int = 4, residual_length: int = 128, **kw):
        super().__init__(bits=bits, key_group_size=-1, value_group_size=-1,
                         key_per_channel=True, value_per_channel=False,
                         residual_length=residual_length)

    def to_dict(self):
        return {"__class__": "KCVTConfig", "__version__": self.version, "bits": self.bits,
                "residual_length": self.residual_length}


class PerTokenIntConfig(GroupQuantConfig):
    """Naive per-token INT-b: one asymmetric scale/zero per token vector, keys and values,
    every token quantized on arrival (no residual)."""

    method: ClassVar[str] = "int-per-token"

    def __init__(self, bits: int = 4, residual_length: int = 0, **kw):
        super().__init__(bits=bits, key_group_size=-1, value_group_size=-1,
                         key_per_channel=False, value_per_channel=False,
                         residual_length=residual_length)

    def to_dict(self):
        return {"__class__": "PerTokenIntConfig", "__version__": self.version, "bits": self.bits,
                "residual_length": self.residual_length}


class FlexGenConfig(GroupQuantConfig):
    """FlexGen-style: per-token groups of 64 channels for keys and values, 4-bit."""

    method: ClassVar[str] = "flexgen"

    def __init__(self, bits: int = 4, group_size: int = 64, residual_length: int = 0, **kw):
        super().__init__(bits=bits, key_group_size=group_size, value_group_size=group_size,
                         key_per_channel=False, value_per_channel=False,
                         residual_length=residual_length)

    def to_dict(self):
        return {"__class__": "FlexGenConfig", "__version__": self.version, "bits": self.bits,
                "group_size": self.key_group_size, "residual_length": self.residual_length}


# ----------------------------------------------------------------------------- presets
PRESETS: Dict[str, CompressionConfig] = {
    "fp16": FP16Config(),
    "kivi-2": KIVIConfig(bits=2, group_size=32, residual_length=128),
    "kivi-4": KIVIConfig(bits=4, group_size=32, residual_length=128),
    "kcvt-4": KCVTConfig(bits=4, residual_length=128),
    "int4-per-token": PerTokenIntConfig(bits=4),
    "int2-per-token": PerTokenIntConfig(bits=2),
    "flexgen-4": FlexGenConfig(bits=4, group_size=64),
}


def register_preset(name: str, config: CompressionConfig) -> None:
    """Add (or replace) a named preset."""
    if not isinstance(config, CompressionConfig):
        raise TypeError(f"argument 'config' must be a CompressionConfig, got {type(config).__name__}")
    PRESETS[name] = config


def get_config(name: str) -> CompressionConfig:
    """Return the preset called ``name`` (see ``kvq.PRESETS``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"argument 'name': unknown preset {name!r}; known: {sorted(PRESETS)}") from None


# ----------------------------------------------------------------------------- HQMQ
@dataclass(frozen=True)
class HQMQConfig(CompressionConfig):
    """HQMQ: Hurwitz quaternion multiplicative quantization of every 4-element chunk
    (direction: nearest of 24 x ``secondary_size`` codewords p.s; radius: ``radius_bits``
    uniform against the token's largest non-outlier chunk radius), optionally with Med3x
    outliers (``outlier_factor`` x the per-head median chunk norm, stored exactly).

    Keys and values are treated alike; every token is encoded on arrival.  The secondary
    sets differ per (layer, KV head, role) and derive from ``seed`` (see
    :func:`kvquant_ext.hqmq.derive_seed`).
    """

    secondary_size: int = 96
    radius_bits: int = 4
    outlier_factor: "Optional[float]" = None
    seed: int = 0
    method: ClassVar[str] = "hqmq"

    def __post_init__(self):
        import math
        s, b, f = self.secondary_size, self.radius_bits, self.outlier_factor
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= 2048:
            raise ValueError(f"argument 'secondary_size' must be an int in 1..2048, got {s!r}")
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8:
            raise ValueError(f"argument 'radius_bits' must be an int in 1..8, got {b!r}")
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float))
                              or not math.isfinite(f) or f <= 0):
            raise ValueError(f"argument 'outlier_factor' must be None or a finite number > 0, got {f!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"argument 'seed' must be a non-negative int, got {self.seed!r}")

    def compress(self, x, role, *, check_finite=True, layer_idx: int = 0):
        from .hqmq import HQMQCompressed
        _check_role(role)
        return HQMQCompressed.from_tensor(x, self, role, layer_idx=layer_idx,
                                          check_finite=check_finite)

    def new_stream(self, role, *, check_finite=True, layer_idx: int = 0):
        from .hqmq import HQMQStream
        _check_role(role)
        return HQMQStream(self, role, layer_idx=layer_idx, check_finite=check_finite)


PRESETS["hqmq-3.79"] = HQMQConfig(secondary_size=96, radius_bits=4)
PRESETS["hqmq-5"] = HQMQConfig(secondary_size=192, radius_bits=6, outlier_factor=3.0)


# ----------------------------------------------------------------------------- GEAR
@dataclass(frozen=True)
class GEARConfig(CompressionConfig):
    """GEAR (Kang et al. 2024): quantized backbone + exact sparse outliers + low-rank
    residual, streamed with a full-precision buffer of ``buffer_length`` tokens.

    Parameters
    ----------
    bits : backbone bits (2, 4 or 8).
    group_size : KIVI group size G (tokens per key-channel group, channels per value-token
        group); ignored by the "kcvt" backbone (whole key channel / whole value token).
    sparsity : s in [0, 0.5): per vector the ceil(s/2 * L) largest and as many smallest
        entries are kept exactly.  0 gives GEAR-L.
    rank : rank of the residual factors of a prefill block (0: outlier-aware quantization).
    rank_decode : rank of the factors of each streamed decode block.
    iters : power iterations.
    buffer_length : n_b, decode tokens kept in full precision before being compressed as
        one block (a multiple of G with the KIVI backbone).
    backbone : "kivi" (per-channel keys / per-token values, groups of G) or "kcvt".
    seed : seed of the power iteration's start vectors.
    """

    bits: int = 2
    group_size: int = 64
    sparsity: float = 0.02
    rank: int = 4
    rank_decode: int = 2
    iters: int = 8
    buffer_length: int = 64
    backbone: str = "kivi"
    seed: int = 0
    method: ClassVar[str] = "gear"

    def __post_init__(self):
        if self.backbone not in ("kivi", "kcvt"):
            raise ValueError(f"argument 'backbone' must be 'kivi' or 'kcvt', got {self.backbone!r}")
        self.key_spec()  # validates bits / group_size
        self.value_spec()
        if not (isinstance(self.sparsity, (int, float)) and 0.0 <= self.sparsity < 0.5):
            raise ValueError(f"argument 'sparsity' must be in [0, 0.5), got {self.sparsity!r}")
        for name in ("rank", "rank_decode"):
            r = getattr(self, name)
            if not (isinstance(r, int) and 0 <= r <= 8):
                raise ValueError(f"argument '{name}' must be an int in [0, 8], got {r!r}")
        if not (isinstance(self.iters, int) and self.iters >= 1):
            raise ValueError(f"argument 'iters' must be an int >= 1, got {self.iters!r}")
        if not (isinstance(self.buffer_length, int) and self.buffer_length >= 1):
            raise ValueError(f"argument 'buffer_length' must be an int >= 1, got {self.buffer_length!r}")
        if self.backbone == "kivi" and self.buffer_length % self.group_size:
            raise ValueError(f"argument 'buffer_length' ({self.buffer_length}) must be a multiple of "
                             f"'group_size' ({self.group_size}) with the KIVI backbone")
        if self.rank_decode > self.buffer_length:
            raise ValueError(f"argument 'rank_decode' ({self.rank_decode}) must be <= "
                             f"'buffer_length' ({self.buffer_length})")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"argument 'seed' must be a non-negative int, got {self.seed!r}")

    def key_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size if self.backbone == "kivi" else -1, True)

    def value_spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size if self.backbone == "kivi" else -1, False)

    def spec(self, role: str) -> QuantSpec:
        return self.key_spec() if _check_role(role) == "key" else self.value_spec()

    def compress(self, x, role, *, check_finite=True, rank=None):
        """Compress one whole block (prefill rank unless ``rank`` is given)."""
        from .gear import GEARCompressed
        return GEARCompressed.from_tensor(x, self, role, rank=self.rank if rank is None else rank,
                                          check_finite=check_finite)

    def new_stream(self, role, *, check_finite=True):
        from .gear import GEARStream
        _check_role(role)
        return GEARStream(self, role, check_finite=check_finite)


PRESETS["gear-2"] = GEARConfig(bits=2, group_size=64, sparsity=0.02, rank=4, rank_decode=2,
                               iters=8, buffer_length=64, backbone="kivi")
PRESETS["gear-4"] = GEARConfig(bits=4, sparsity=0.02, rank=4, rank_decode=2, iters=8,
                               buffer_length=20, backbone="kcvt")
PRESETS["gearl-2"] = GEARConfig(bits=2, group_size=64, sparsity=0.0, rank=4, rank_decode=2,
                                iters=8, buffer_length=64, backbone="kivi")
PRESETS["gearl-4"] = GEARConfig(bits=4, sparsity=0.0, rank=4, rank_decode=2, iters=8,
                                buffer_length=20, backbone="kcvt")
PRESETS["outlier-2"] = GEARConfig(bits=2, group_size=64, sparsity=0.02, rank=0, rank_decode=0,
                                  iters=3, buffer_length=64, backbone="kivi")
