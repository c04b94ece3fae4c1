"""Regenerate the Python protobuf/gRPC code in clients/python from protos/, the one source of truth.

The proto package path is the Python import path: protoc runs with `-I protos` and writes into clients/python,
so `llmserve/textgen/v1/textgen.proto` becomes `llmserve.textgen.v1.textgen_pb2` (+ `_pb2_grpc`, `.pyi`) and its
imports resolve without patching. The `__init__.py` files of those packages are written by hand, not generated.

    python tools/gen_protos.py           # regenerate in place (stale generated files are removed first)
    python tools/gen_protos.py --check   # exit 1, listing the files, when the checked-in code is stale

Run it with the project venv's Python: the pinned grpcio-tools decides the generated code byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
CLIENT_ROOT = REPO_ROOT / "clients" / "python"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def find_protos(proto_root: Path) -> list[str]:
    """Every .proto file under proto_root, as sorted paths relative to it (what protoc expects with -I)."""
    return sorted(path.relative_to(proto_root).as_posix() for path in proto_root.rglob("*.proto"))


def find_generated(root: Path) -> list[str]:
    """Every generated file under root, as sorted relative paths."""
    return sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*")
        if path.is_file() and path.name.endswith(GENERATED_SUFFIXES)
    )


def generate(proto_root: Path, out_dir: Path) -> None:
    """Run the bundled protoc (grpcio-tools) over every proto under proto_root, writing into out_dir."""
    from grpc_tools import protoc

    protos = find_protos(proto_root)
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}")
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_root}")


def stale_files(proto_root: Path = PROTO_ROOT, generated_root: Path = CLIENT_ROOT) -> list[str]:
    """Generate into a temporary directory and list how generated_root differs from it.

    Returns lines such as "differs: llmserve/common/v1/common_pb2.py"; an empty list means up to date.
    """
    with tempfile.TemporaryDirectory(prefix="llmserve-protos-") as tmp:
        fresh_root = Path(tmp)
        generate(proto_root, fresh_root)
        fresh = set(find_generated(fresh_root))
        current = set(find_generated(generated_root))
        problems = [f"missing: {name}" for name in sorted(fresh - current)]
        problems += [f"not generated from any proto: {name}" for name in sorted(current - fresh)]
        problems += [
            f"differs: {name}"
            for name in sorted(fresh & current)
            if not filecmp.cmp(fresh_root / name, generated_root / name, shallow=False)
        ]
    return problems


def regenerate(proto_root: Path = PROTO_ROOT, out_dir: Path = CLIENT_ROOT) -> list[str]:
    """Remove the old generated files under out_dir, generate afresh, and return the generated paths."""
    for name in find_generated(out_dir):
        (out_dir / name).unlink()
    generate(proto_root, out_dir)
    return find_generated(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale generated files (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_files()
        for line in problems:
            print(line)
        if problems:
            print("generated code is stale: run `python tools/gen_protos.py`", file=sys.stderr)
        return 1 if problems else 0
    for name in regenerate():
        print(f"wrote clients/python/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
