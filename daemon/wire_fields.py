"""Field checks for decoding protocol messages: each returns the value or raises a
:class:`~specsched.daemon.messages.ProtocolError` (``invalid_field``) that names the field's path.

Strict by construction: ``bool`` is not an int, NaN/inf are not numbers, lengths and ranges are
bounded. :class:`FieldReader` reads one map and, when strict, rejects the keys nobody read.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from specsched.daemon.messages import ErrorCode, ProtocolError

__all__ = ["REQUIRED", "FieldReader", "bool_", "float_", "int_", "list_", "map_", "str_"]
REQUIRED = object()  # FieldReader.get's default: the field must be present
_WIRE_NAMES = {
    bool: "bool",
    int: "int",
    float: "float",
    str: "string",
    bytes: "binary",
    list: "array",
    dict: "map",
    type(None): "nil",
}


def _tname(value: Any) -> str:
    return _WIRE_NAMES.get(type(value), type(value).__name__)


def _bad(path: str, problem: str) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: {problem}")


def str_(lo: int, hi: int | None):
    def check(v, path):
        if not isinstance(v, str):
            raise _bad(path, f"must be a string, got {_tname(v)}")
        if len(v) < lo or (hi is not None and len(v) > hi):
            raise _bad(path, f"length must be in [{lo}, {hi if hi is not None else 'inf'}], got {len(v)}")
        return v

    return check


def int_(lo: int | None, hi: int | None):
    def check(v, path):
        if type(v) is not int:  # bool is not an int on the wire
            raise _bad(path, f"must be an int, got {_tname(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _bad(path, f"must be in [{lo}, {hi}], got {v}")
        return v

    return check


def float_(lo: float | None, hi: float | None, *, lo_open: bool = False):
    def check(v, path):
        if type(v) not in (int, float):
            raise _bad(path, f"must be a number, got {_tname(v)}")
        if not math.isfinite(v):
            raise _bad(path, f"must be finite, got {v}")
        if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
            raise _bad(path, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
        return float(v)

    return check


def bool_(v, path):
    if type(v) is not bool:
        raise _bad(path, f"must be a bool, got {_tname(v)}")
    return v


def list_(item, lo: int, hi: int | None):
    def check(v, path):
        if not isinstance(v, list):
            raise _bad(path, f"must be an array, got {_tname(v)}")
        if len(v) < lo or (hi is not None and len(v) > hi):
            raise _bad(path, f"must have [{lo}, {hi if hi is not None else 'inf'}] entries, got {len(v)}")
        return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]

    return check


def map_():
    def check(v, path):
        if not isinstance(v, dict):
            raise _bad(path, f"must be a map, got {_tname(v)}")
        return v

    return check


class FieldReader:
    """Reads the fields of one map; ``finish()`` rejects unread keys when ``strict``."""

    def __init__(
        self, obj: dict, where: str, *, strict: bool, request_id: str | None = None, skip=()
    ) -> None:
        self.obj, self.where, self.strict, self.request_id = obj, where, strict, request_id
        self._seen = set(skip)

    def get(self, name: str, check, *, default: Any = REQUIRED, nullable: bool = False):
        self._seen.add(name)
        path = f"{self.where}.{name}"
        if name not in self.obj:
            if default is REQUIRED:
                raise ProtocolError(
                    ErrorCode.INVALID_FIELD, f"{path}: required field is missing", self.request_id
                )
            return copy.deepcopy(default)
        value = self.obj[name]
        if value is None:
            if nullable:
                return None
            raise ProtocolError(ErrorCode.INVALID_FIELD, f"{path}: must not be nil", self.request_id)
        try:
            return check(value, path)
        except ProtocolError as e:
            e.request_id = e.request_id or self.request_id
            raise

    def finish(self) -> None:
        if not self.strict:
            return
        extra = [k for k in self.obj if k not in self._seen]
        if extra:
            name = str(extra[0])[:40]
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, f"{self.where}.{name}: unknown field", self.request_id
            )
