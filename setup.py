"""Build hook: generate the gRPC stubs into ``pshard/api/v1`` before the package is built.

Everything else about the package is in pyproject.toml. The stubs are generated, never committed,
so that `pip install .` of a clean clone works without `make` and the wire contract has one source:
``proto/``. The proto path mirrors the import path (``proto/pshard/api/v1/x.proto`` declares
``package pshard.api.v1`` and becomes ``pshard.api.v1.x_pb2``), so the generated imports are right as
they are.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"


def generate_stubs() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml [build-system])

    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    if not protos:
        # A wheel without its stubs would install and then fail at the first import.
        raise SystemExit(f"no .proto files under {PROTO_ROOT}: the stubs cannot be generated "
                         "(an sdist must carry proto/; see MANIFEST.in)")
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={ROOT}",
            f"--pyi_out={ROOT}", f"--grpc_python_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {protos}")


class BuildWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
