"""Regenerate the committed gRPC code in zerohop/grpc_gen from proto/ (grpcio-tools).

    python scripts/gen_grpc.py [OUT_DIR]    # default: zerohop/grpc_gen

protoc names modules after the proto path (`zerohop.v1.zerohop_pb2`), which would collide
with our own `zerohop` package, so the generated `_pb2_grpc` import is rewritten to the
package path the code lives under. tests/test_grpc.py checks the committed code is current.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTOS = ["zerohop/v1/zerohop.proto"]
PACKAGE = "zerohop.grpc_gen"  # the Python package OUT_DIR is
DEFAULT_OUT = ROOT / "zerohop" / "grpc_gen"
GENERATED = [
    "zerohop/v1/zerohop_pb2.py",
    "zerohop/v1/zerohop_pb2.pyi",
    "zerohop/v1/zerohop_pb2_grpc.py",
]


def generate(out_dir: Path) -> list[Path]:
    """Write the generated modules under out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_ROOT / p) for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for proto in PROTOS:
        _fix_imports(out_dir / proto.replace(".proto", "_pb2_grpc.py"), proto)
        _add_init_files(out_dir, Path(proto).parent)
    return [out_dir / name for name in GENERATED]


def _fix_imports(path: Path, proto: str) -> None:
    module_dir = str(Path(proto).parent).replace("/", ".")
    text = path.read_text()
    text = text.replace(f"from {module_dir} import", f"from {PACKAGE}.{module_dir} import")
    path.write_text(text)


def _add_init_files(out_dir: Path, folder: Path) -> None:
    for part in (folder, *folder.parents):
        init = out_dir / part / "__init__.py"
        if not init.exists():
            init.write_text("")


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    for path in generate(out_dir):
        print(path)


if __name__ == "__main__":
    main()
