"""Build hook: compile the public API's protos into the package as a ``FileDescriptorSet``.

``build_proto`` runs grpcio-tools' protoc on ``proto/pdserve/v1/api.proto`` of the repository (two
levels up, or ``$PDSERVE_PROTO_ROOT``) with its imports, appends grpc's ``health.proto`` (taken from
grpcio-health-checking, a build requirement only), and writes ``src/pdserve_sdk/pdserve_api.binpb``.
``pdserve_sdk._wire`` loads it into a private descriptor pool at import time (see there for why not
``--python_out``). It runs before ``build_py`` (wheels, editable installs) and ``sdist`` (so an sdist
builds without the repository).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.errors import SetupError

HERE = Path(__file__).resolve().parent
PROTO_ROOT = Path(os.environ.get("PDSERVE_PROTO_ROOT", HERE.parent.parent / "proto"))
API_PROTO = "pdserve/v1/api.proto"
OUTPUT = HERE / "src" / "pdserve_sdk" / "pdserve_api.binpb"


class BuildProto(Command):
    """Compile ``API_PROTO`` (+ imports) and grpc's health.proto into ``OUTPUT``."""

    description = "compile the pdserve public API protos into pdserve_sdk/pdserve_api.binpb"
    user_options: list = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        if not (PROTO_ROOT / API_PROTO).is_file():
            if OUTPUT.is_file():  # an sdist: compiled when the sdist was made
                return
            raise SetupError(
                f"{PROTO_ROOT / API_PROTO} not found: set PDSERVE_PROTO_ROOT to the repo's proto/"
            )
        from google.protobuf import descriptor_pb2
        from grpc_health.v1 import health_pb2
        from grpc_tools import protoc

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "api.binpb"
            args = [
                "protoc",
                f"-I{PROTO_ROOT}",
                f"--descriptor_set_out={out}",
                "--include_imports",
                API_PROTO,
            ]
            if protoc.main(args) != 0:
                raise SetupError(f"protoc failed on {PROTO_ROOT / API_PROTO}")
            files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
        files.file.append(descriptor_pb2.FileDescriptorProto.FromString(health_pb2.DESCRIPTOR.serialized_pb))
        OUTPUT.write_bytes(files.SerializeToString())


class BuildPy(build_py):
    def run(self) -> None:
        self.run_command("build_proto")
        super().run()


class Sdist(sdist):
    def run(self) -> None:
        self.run_command("build_proto")
        super().run()


setup(cmdclass={"build_proto": BuildProto, "build_py": BuildPy, "sdist": Sdist})
