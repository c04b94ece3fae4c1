"""Import rules of ARCHITECTURE.md §3, read from the source with `ast` (no model, no imports executed).

tests/unit/test_layout.py imports services.engine.core in a subprocess and inspects sys.modules; these
checks complement it: they see every file, including imports inside functions that a plain import never
runs, `importlib.import_module("...")` with a literal name, and relative imports.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = REPO_ROOT / "services"
RPC_MODULES = ("grpc", "grpc_health", "grpc_reflection", "grpc_status", "google.protobuf", "google.rpc", "llmserve")
CORE_FORBIDDEN = ("torch", "numpy", "triton", *RPC_MODULES)
# The gRPC boundary: the only files that may import grpc or generated protobuf code. Each service keeps its gRPC
# side in its `serving` package; there, the server, its conversions and the tokenizer's client of the engine
# (engine_client, and engine_batch for GenerateBatch) are the adapters. services/common holds what both share.
RPC_FILE_NAMES = {"server.py", "convert.py", "engine_client.py", "engine_batch.py"}
RPC_PACKAGE = "serving"
RPC_COMMON_FILES = {"services/common/grpc_server.py", "services/common/convert.py"}
MODEL_PACKAGES = ("runner", "models", "layers", "kernels", "loader")


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module name and where it is imported."""

    module: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve_relative(package: str, level: int, module: str | None) -> str:
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_in_source(source: str, path: str, package: str) -> list[Import]:
    """Every module a source imports: import / from-import statements anywhere, relative ones resolved,
    and literal importlib.import_module(...) / __import__(...) calls."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, path, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(package, node.level, node.module) if node.level else node.module or ""
            found.append(Import(base, path, node.lineno))
            found += [Import(f"{base}.{alias.name}", path, node.lineno) for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append(Import(first.value, path, node.lineno))
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def imports_of(path: Path) -> list[Import]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports_in_source(path.read_text(encoding="utf-8"), str(path.relative_to(REPO_ROOT)), package)


def python_files(directory: Path) -> list[Path]:
    files = sorted(directory.rglob("*.py"))
    assert files, f"no Python files under {directory}"
    return files


def matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [str(found) for path in files for found in imports_of(path) if matches(found.module, forbidden)]


# The checker itself


def test_checker_finds_every_kind_of_import():
    source = (
        "import torch.nn as nn\n"
        "from grpc import aio\n"
        "def lazy():\n"
        "    from llmserve.engine.v1 import engine_pb2\n"
        "    import importlib\n"
        "    return importlib.import_module('numpy')\n"
        "from . import sibling\n"
        "from ..runner import sampler\n"
    )
    modules = {found.module for found in imports_in_source(source, "x.py", "services.engine.core")}
    assert {"torch.nn", "grpc", "grpc.aio", "llmserve.engine.v1", "llmserve.engine.v1.engine_pb2", "numpy",
            "services.engine.core.sibling", "services.engine.runner", "services.engine.runner.sampler"} <= modules
    assert matches("torch.nn", ("torch",)) and not matches("torchvision", ("torch",))


def test_checker_sees_the_real_tree():
    files = python_files(SERVICES)
    names = {module_name(path) for path in files}
    assert {"services.engine.core.engine", "services.engine.serving.server", "services.tokenizer.serving.server",
            "services.common.grpc_server"} <= names
    seen = {found.module for path in files for found in imports_of(path)}
    # The rules below are not vacuous: the boundary files do import grpc and stubs, the runner imports core.
    assert {"grpc", "llmserve.engine.v1", "llmserve.textgen.v1", "services.engine.core.sequence"} <= seen


# The rules


def test_engine_core_imports_no_torch_numpy_triton_grpc_or_protobuf():
    assert violations(python_files(SERVICES / "engine" / "core"), CORE_FORBIDDEN) == []


@pytest.mark.parametrize("package", MODEL_PACKAGES)
def test_model_side_packages_import_no_grpc_or_stubs(package):
    assert violations(python_files(SERVICES / "engine" / package), RPC_MODULES) == []


def test_only_the_grpc_boundary_files_import_grpc_or_generated_code():
    outside = [path for path in python_files(SERVICES)
               if not (path.name in RPC_FILE_NAMES and path.parent.name == RPC_PACKAGE)
               and str(path.relative_to(REPO_ROOT)) not in RPC_COMMON_FILES]
    assert violations(outside, RPC_MODULES) == []


def test_tokenizer_service_never_imports_the_engine():
    assert violations(python_files(SERVICES / "tokenizer"), ("services.engine",)) == []


def test_engine_never_imports_the_tokenizer_service():
    assert violations(python_files(SERVICES / "engine"), ("services.tokenizer",)) == []


def test_model_files_import_nothing_from_runner_or_core():
    forbidden = ("services.engine.runner", "services.engine.core")
    assert violations(python_files(SERVICES / "engine" / "models"), forbidden) == []
