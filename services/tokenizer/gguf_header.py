"""Read one metadata value from a GGUF file's header without parsing the rest (gguf.GGUFReader maps and parses
every tensor's description first, which takes seconds for a model that the tokenizer service never loads)."""

import struct
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_metadata(path: str, wanted: set[str]) -> dict[str, Any]:
    """The values of the `wanted` keys found in the header (scalars and strings); stops once all are found."""
    found: dict[str, Any] = {}
    with open(path, "rb") as file:
        magic, _version, _num_tensors, num_kvs = struct.unpack("<4sIQQ", file.read(24))
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        for _ in range(num_kvs):
            key = _read_string(file)
            (value_type,) = struct.unpack("<I", file.read(4))
            value = _read_value(file, value_type)
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found


def _read_string(file: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", file.read(8))
    return file.read(length).decode("utf-8", errors="replace")


def _read_value(file: BinaryIO, value_type: int) -> Any:
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack(fmt, file.read(struct.calcsize(fmt)))[0]
    if value_type == _STRING:
        return _read_string(file)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", file.read(12))
        if item_type in _SCALARS:  # skipped: no wanted value is an array
            file.seek(count * struct.calcsize(_SCALARS[item_type]), 1)
            return None
        for _ in range(count):
            _read_value(file, item_type)
        return None
    raise ValueError(f"unknown GGUF value type {value_type}")
