"""protoc plugin that runs grpcio-tools' built-in gRPC Python generator.

buf cannot find a ``protoc-gen-grpc_python`` binary (grpcio-tools links the
generator into its own protoc), so this plugin reads buf's
``CodeGeneratorRequest`` from stdin, hands the request's file descriptors to
``grpc_tools.protoc`` through ``--descriptor_set_in`` and returns the generated
``*_pb2_grpc.py`` files as a ``CodeGeneratorResponse`` on stdout.
"""

import pathlib
import sys
import tempfile

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc


def main() -> None:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL
    )
    with tempfile.TemporaryDirectory() as tmp:
        descriptors = pathlib.Path(tmp, "descriptors.pb")
        descriptors.write_bytes(
            descriptor_pb2.FileDescriptorSet(file=request.proto_file).SerializeToString()
        )
        out = pathlib.Path(tmp, "out")
        out.mkdir()
        args = ["protoc", f"--descriptor_set_in={descriptors}", f"--grpc_python_out={out}"]
        if protoc.main([*args, *request.file_to_generate]) != 0:
            response.error = "grpc_tools.protoc failed"
        for path in sorted(out.rglob("*.py")):
            response.file.add(name=str(path.relative_to(out)), content=path.read_text())
    sys.stdout.buffer.write(response.SerializeToString())


if __name__ == "__main__":
    main()
