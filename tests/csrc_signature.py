"""The C entry points' parameter types, read from csrc/, for the ctypes argument-list tests."""

from __future__ import annotations

import ctypes

from dhp_backend.ops import cuda_build

# ctypes classes of the C entry point's parameter types (pointers: c_void_p).
_C_TYPES = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "float": ctypes.c_float, "int64_t": ctypes.c_int64}


def c_signature(source: str, name: str) -> list:
    """The ctypes classes of ``extern "C" int name(...)``'s parameters in csrc/<source>."""
    text = (cuda_build.csrc_dir() / source).read_text()
    params = text.split(f'extern "C" int {name}(', 1)[1].split(")", 1)[0]
    return [ctypes.c_void_p if "*" in a else _C_TYPES[" ".join(a.split()).rsplit(" ", 1)[0]]
            for a in params.split(",")]
