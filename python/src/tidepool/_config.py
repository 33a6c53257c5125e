"""Python face of tidepool's one configuration parser (allocator/config.{h,cpp}).

No parsing happens here: every call goes to the C++ parser through the C ABI, so the
Python hook, the LD_PRELOAD shim and C++ trainers accept exactly the same strings and
give exactly the same error texts. The keys are documented in allocator/config.h,
Note [tidepool keys], and in python/README.md.
"""

from __future__ import annotations

import ctypes
import json
import os
from typing import NamedTuple

from . import _lib

VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def variable_pytorch_reads() -> str:
    """PYTORCH_CUDA_ALLOC_CONF when it is set at all (even empty), else PYTORCH_ALLOC_CONF:
    the one PyTorch 2.11 reads (Note [the variable PyTorch reads] in allocator/config.cpp)."""
    return "PYTORCH_CUDA_ALLOC_CONF" if "PYTORCH_CUDA_ALLOC_CONF" in os.environ \
        else "PYTORCH_ALLOC_CONF"
_ERROR_SIZE = 2048
_JSON_SIZE = 4096


class ConfigError(ValueError):
    """A PYTORCH_*_ALLOC_CONF string tidepool cannot accept; the message names the key."""


class ClaimResult(NamedTuple):
    enabled: bool  # the string names tidepool
    remaining: str  # what PyTorch should see, its own entries verbatim and in order
    config: dict  # the parsed configuration (see allocator/config.h)


def claim(conf: str) -> ClaimResult:
    """Splits `conf` into tidepool's configuration and the string left for PyTorch."""
    lib = _lib.load()
    raw = conf.encode("utf-8")
    remaining = ctypes.create_string_buffer(len(raw) + 1)
    config_json = ctypes.create_string_buffer(_JSON_SIZE)
    error = ctypes.create_string_buffer(_ERROR_SIZE)
    status = lib.tidepool_config_claim(raw, remaining, len(remaining), config_json,
                                       len(config_json), error, len(error))
    if status < 0:
        raise ConfigError(error.value.decode("utf-8", "replace"))
    return ClaimResult(status == 1, remaining.value.decode("utf-8"),
                       json.loads(config_json.value.decode("utf-8")))


def active_config() -> dict:
    """The configuration libtidepool applied last (enabled: false before any)."""
    lib = _lib.load()
    size = lib.tidepool_config_active_json(None, 0)
    out = ctypes.create_string_buffer(size + 1)
    lib.tidepool_config_active_json(out, len(out))
    return json.loads(out.value.decode("utf-8"))


def apply(conf: str) -> dict:
    """Claims `conf` and makes it libtidepool's active configuration; returns it."""
    lib = _lib.load()
    error = ctypes.create_string_buffer(_ERROR_SIZE)
    if lib.tidepool_config_apply(conf.encode("utf-8"), error, len(error)) < 0:
        raise ConfigError(error.value.decode("utf-8", "replace"))
    return active_config()


def install_from_env() -> bool:
    """tidepool::install_from_env(): claims the tidepool keys of the two variables,
    rewrites them for PyTorch, keeps the keys in TIDEPOOL_ALLOC_CONF for child processes
    (or applies an inherited TIDEPOOL_ALLOC_CONF), applies the configuration. True when
    tidepool was named.

    The C++ side changes the C environment (what PyTorch reads); os.environ is a copy
    taken at start-up, so it is brought in line here.
    """
    lib = _lib.load()
    error = ctypes.create_string_buffer(_ERROR_SIZE)
    status = lib.tidepool_install_from_env(error, len(error))
    if status < 0:
        raise ConfigError(error.value.decode("utf-8", "replace"))
    if status == 1:
        sync_environ()
    return status == 1


def plan_for_preload() -> tuple[bool, dict]:
    """What the LD_PRELOAD shim's set-up would claim from the environment, checked with
    the shim's rules across both PyTorch variables and TIDEPOOL_ALLOC_CONF, changing
    nothing: (names tidepool, configuration). Raises ConfigError with the message the shim
    would end the process with."""
    lib = _lib.load()
    config_json = ctypes.create_string_buffer(_JSON_SIZE)
    error = ctypes.create_string_buffer(_ERROR_SIZE)
    status = lib.tidepool_config_plan_for_preload(config_json, len(config_json), error,
                                                  len(error))
    if status < 0:
        raise ConfigError(error.value.decode("utf-8", "replace"))
    return status == 1, json.loads(config_json.value.decode("utf-8"))


def sync_environ() -> None:
    """Brings os.environ (a copy taken at start-up) in line with the C environment's
    PyTorch variables and TIDEPOOL_ALLOC_CONF, after libtidepool or the LD_PRELOAD shim
    rewrote them (what PyTorch reads, and what os.environ hands to child processes)."""
    libc_getenv = ctypes.CDLL(None).getenv
    libc_getenv.restype, libc_getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    for name in VARIABLES + ("TIDEPOOL_ALLOC_CONF",):
        value = libc_getenv(name.encode())
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = os.fsdecode(value)  # as os.environ decodes: any bytes
